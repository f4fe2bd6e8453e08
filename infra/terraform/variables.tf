# -- cluster access --------------------------------------------------------------------------------

variable "kubeconfig_path" {
  description = "Path to the kubeconfig used by both the kubernetes and the helm provider."
  type        = string
  default     = "~/.kube/config"
}

variable "kube_context" {
  description = "kubeconfig context to use; null means the file's current context."
  type        = string
  default     = null
}

variable "cluster_domain" {
  description = "The cluster's DNS domain (used to build the in-cluster NATS URL)."
  type        = string
  default     = "cluster.local"
}

# -- namespace and image ---------------------------------------------------------------------------

variable "namespace" {
  description = "Namespace for the whole Keel control plane (NATS, recorder, controller, migrate Job). Created by this module."
  type        = string
  default     = "keel"
}

variable "image" {
  description = "The Keel image built from the repository's Dockerfile, e.g. registry.example.com/keel:0.1.0. Pin a tag or digest: a new value re-runs the migrate Job and rolls the services."
  type        = string
}

variable "image_pull_policy" {
  description = "Pull policy for the Keel containers."
  type        = string
  default     = "IfNotPresent"

  validation {
    condition     = contains(["Always", "IfNotPresent", "Never"], var.image_pull_policy)
    error_message = "image_pull_policy must be Always, IfNotPresent or Never."
  }
}

variable "image_pull_secrets" {
  description = "Names of existing docker-registry Secrets in the namespace, for a private registry."
  type        = list(string)
  default     = []
}

variable "labels" {
  description = "Extra labels for every Kubernetes object this module creates."
  type        = map(string)
  default     = {}
}

variable "node_selector" {
  description = "Node selector for the Keel control-plane pods (recorder, controller, migrate)."
  type        = map(string)
  default     = {}
}

# -- PostgreSQL (managed, outside this module) ---------------------------------------------------

variable "database_url" {
  description = "URL of the role that owns the event store's tables (keel_migrate: the only role with DDL, used only by the migrate Job) on the managed PostgreSQL, with its password and an explicit sslmode, e.g. postgresql://keel_migrate:PASSWORD@db.example.com:5432/keel?sslmode=verify-full&sslrootcert=system. The services' URLs are this one with their own role and generated password. Stored in Kubernetes Secrets (and, like every sensitive value, in the Terraform state)."
  type        = string
  sensitive   = true

  validation {
    condition     = can(regex("^postgres(ql)?://[^@/]+:[^@/]+@", var.database_url))
    error_message = "database_url must be a postgresql:// (or postgres://) URL with user and password (postgresql://keel_migrate:PASSWORD@host:5432/keel?sslmode=verify-full)."
  }
  validation {
    condition     = can(regex("[?&]sslmode=(disable|allow|prefer|require|verify-ca|verify-full)(&|$)", var.database_url))
    error_message = "database_url must say how it uses TLS: add sslmode=verify-full (recommended, with sslrootcert=<CA file mounted in the pods> or sslrootcert=system), or sslmode=require (encrypted, server not verified); sslmode=disable only on a network you trust."
  }
}

variable "db_schema" {
  description = "PostgreSQL schema for the event store and read models (KEEL_DB_SCHEMA)."
  type        = string
  default     = "public"

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_]*$", var.db_schema))
    error_message = "db_schema must be a lower-case SQL identifier."
  }
}

# -- NATS JetStream --------------------------------------------------------------------------------

variable "nats_release_name" {
  description = "Helm release name for NATS; the chart names its client Service after it."
  type        = string
  default     = "nats"
}

variable "nats_chart_version" {
  description = "Version of the official nats Helm chart (https://nats-io.github.io/k8s/helm/charts/, 1.x value layout)."
  type        = string
  default     = "1.2.4"
}

variable "nats_image_tag" {
  description = "Tag of the official nats image run by the chart."
  type        = string
  default     = "2.10-alpine"
}

variable "nats_replicas" {
  description = "NATS servers in the JetStream cluster. 3 gives an R3 cluster that survives the loss of one server (a Raft majority of 2 remains); 1 is for development only."
  type        = number
  default     = 3

  validation {
    condition     = contains([1, 3, 5], var.nats_replicas)
    error_message = "nats_replicas must be 1 (development), 3 or 5: JetStream needs an odd-sized Raft group."
  }
}

variable "nats_storage_class" {
  description = "StorageClass for the JetStream file-store PVCs (one per NATS server); null uses the cluster default. Prefer SSD-backed, zone-local volumes."
  type        = string
  default     = null
}

variable "nats_storage_size" {
  description = "Size of each JetStream PVC. The chart also uses it as max_file_store, and both Keel streams (events and dead letters) reserve bus_max_bytes each, so it must exceed 2 x bus_max_bytes plus headroom."
  type        = string
  default     = "32Gi"
}

variable "nats_sync_always" {
  description = "JetStream sync_interval: always (fsync every write before the ack). With R3 streams (KEEL_BUS__REPLICAS follows nats_replicas), replication carries durability and false trades a small window of correlated-power-loss risk for throughput."
  type        = bool
  default     = true
}

# -- Keel settings ---------------------------------------------------------------------------------

variable "bus_max_age" {
  description = "Retention of the JetStream stream (KEEL_BUS__MAX_AGE). PostgreSQL keeps history for good; the stream is a durable buffer in front of it. Durations need a unit: 7d, 24h."
  type        = string
  default     = "7d"
}

variable "bus_max_bytes" {
  description = "Size limit of each Keel stream (KEEL_BUS__MAX_BYTES), with a unit: 8GiB."
  type        = string
  default     = "8GiB"
}

variable "controller_observe_only" {
  description = "Run the controller in observe mode (KEEL_CONTROLLER__OBSERVE_ONLY): it decides and records, and executes nothing. On by default for a first rollout; turn it off once its decisions have been reviewed."
  type        = bool
  default     = true
}

variable "extra_settings" {
  description = "Further KEEL_* settings for every Keel container, e.g. { KEEL_RECORDER__BATCH_SIZE = \"500\" }. Names follow KEEL_<SECTION>__<FIELD> (libs/infra/keel/infra/config.py); unknown names fail at start."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.extra_settings) : can(regex("^KEEL_[A-Z0-9_]+$", k)) && k != "KEEL_DATABASE_URL"])
    error_message = "extra_settings keys must be KEEL_* names; pass the database URL through database_url, not here."
  }
}

variable "recorder_resources" {
  description = "Resource requests and limits of the recorder container."
  type = object({
    requests = map(string)
    limits   = map(string)
  })
  default = {
    requests = { cpu = "250m", memory = "512Mi" }
    limits   = { memory = "1Gi" }
  }
}

variable "controller_resources" {
  description = "Resource requests and limits of the controller container."
  type = object({
    requests = map(string)
    limits   = map(string)
  })
  default = {
    requests = { cpu = "250m", memory = "512Mi" }
    limits   = { memory = "1Gi" }
  }
}

variable "checkpoint_volume_claim" {
  description = "A ReadWriteMany PersistentVolumeClaim holding the persistent checkpoint tier (the shared filesystem the training nodes persist shards to). The checkpoint broker mounts it at /var/lib/keel/checkpoints to write the manifests; null leaves it unmounted and no step is committed on the disk tier."
  type        = string
  default     = null
}

# -- NATS identities and TLS -----------------------------------------------------------------------

variable "credentials_dir" {
  description = "The credentials folder that `keel credentials init --tls-host HOST ... --auth-file DIR/nats-authorization.conf` filled on the operator's machine (KEEL_CREDENTIALS_DIR there; README: NATS identities and TLS). Terraform reads the NATS server's certificate, key and CA, its authorization, and each service's NATS identity and signing key from it into Kubernetes Secrets (and its state). Keep the folder: it holds the CA's key and is where new identities (an agent's) are issued."
  type        = string

  validation {
    condition     = fileexists("${pathexpand(var.credentials_dir)}/nats/admin.json") && fileexists("${pathexpand(var.credentials_dir)}/nats/shard-ca/tls/nodes/nats-server/cert.pem")
    error_message = "credentials_dir has no NATS identities or no NATS server certificate: run `KEEL_CREDENTIALS_DIR=<credentials_dir> keel credentials init --tls-host <nats host> ... --auth-file <credentials_dir>/nats-authorization.conf` first (infra/terraform/README.md lists the hosts)."
  }
}

variable "nats_authorization_file" {
  description = "The NATS server's authorization, as `keel credentials init --auth-file` (or `keel credentials issue-agent --auth-file`) wrote it; null: <credentials_dir>/nats-authorization.conf. Re-apply after issuing an identity: the chart's config reloader has the servers load it."
  type        = string
  default     = null
}
