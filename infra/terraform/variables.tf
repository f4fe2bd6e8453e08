# -- cluster access --------------------------------------------------------------------------------

variable "kubeconfig_path" {
  description = "Path to the kubeconfig the kubernetes provider uses."
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
  description = "The control-plane image built from the repository's Dockerfile (`make images`; no torch), pinned by digest: registry.example.com/keel@sha256:.... A new value re-runs the migrate Job and rolls the services."
  type        = string

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.image))
    error_message = "image must be pinned by digest (registry.example.com/keel@sha256:<64 hex digits>; a tag may stand before the @): a tag can move under a running job. `podman image inspect --format '{{.Digest}}'` or your registry prints it."
  }
}

variable "agent_image" {
  description = "The node-agent image (infra/images/agent.Dockerfile: `keel run` with torch; build your training image FROM it), pinned by digest."
  type        = string

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.agent_image))
    error_message = "agent_image must be pinned by digest (registry.example.com/keel-agent@sha256:<64 hex digits>; a tag may stand before the @): a tag can move under a running job. `podman image inspect --format '{{.Digest}}'` or your registry prints it."
  }
}

variable "nats_image" {
  description = "The NATS server image (official `nats`, 2.10 or newer, or infra/images/nats.Dockerfile), pinned by digest: nats:2.10-alpine@sha256:..."
  type        = string

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.nats_image))
    error_message = "nats_image must be pinned by digest (registry.example.com/nats@sha256:<64 hex digits>; a tag may stand before the @): a tag can move under a running job. `podman image inspect --format '{{.Digest}}'` or your registry prints it."
  }
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

variable "database_cidrs" {
  description = "Where the managed PostgreSQL is (its primary and standbys, for an HA endpoint that fails over): the only addresses the migrate Job, the recorder and the deciders may connect to on database_port (NetworkPolicy keel-database-egress). No other Keel pod may reach them."
  type        = list(string)

  validation {
    condition     = length(var.database_cidrs) > 0 && alltrue([for cidr in var.database_cidrs : can(cidrhost(cidr, 0))])
    error_message = "database_cidrs must list the PostgreSQL servers' networks as CIDRs (10.20.0.0/24, or 10.20.0.5/32 for one address)."
  }
}

variable "database_port" {
  description = "PostgreSQL's port (in the egress NetworkPolicy; the URL carries it for the clients)."
  type        = number
  default     = 5432
}

variable "kube_api_cidrs" {
  description = "The Kubernetes API server's addresses (`kubectl get endpoints kubernetes -n default`): the only place the actuator's pod may connect to, on 443 or 6443 (NetworkPolicy keel-kube-api-egress)."
  type        = list(string)

  validation {
    condition     = length(var.kube_api_cidrs) > 0 && alltrue([for cidr in var.kube_api_cidrs : can(cidrhost(cidr, 0))])
    error_message = "kube_api_cidrs must list the API server's addresses as CIDRs (10.0.0.1/32)."
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

variable "nats_name" {
  description = "Name of the NATS StatefulSet and its client Service (`<nats_name>`) and headless Service (`<nats_name>-headless`): the server's TLS certificate must name them (README)."
  type        = string
  default     = "nats"
}

variable "nats_resources" {
  description = "Resource requests and limits of each NATS server."
  type = object({
    requests = map(string)
    limits   = map(string)
  })
  default = {
    requests = { cpu = "500m", memory = "1Gi" }
    limits   = { memory = "2Gi" }
  }
}

variable "nats_client_cidrs" {
  description = "Networks outside the cluster's pods allowed to reach NATS's client port (4222): the operators' machines running the `keel` CLI, and the training nodes' own addresses (the node agents use the host network, which pod selectors do not match). Empty: only Keel's control-plane pods. TLS and Keel's identities are required either way. With an overlay CNI, a host-network pod may reach NATS from a tunnel address: list that range too (Calico), or let node addresses match ipBlocks (Cilium's policy-cidr-match-mode=nodes)."
  type        = list(string)
  default     = []

  validation {
    condition     = var.job == null || length(var.nats_client_cidrs) > 0
    error_message = "with a job, nats_client_cidrs must list the training nodes' addresses: the node agents use the host network, and NATS admits no other host."
  }
  validation {
    condition     = alltrue([for cidr in var.nats_client_cidrs : can(cidrhost(cidr, 0))])
    error_message = "nats_client_cidrs must be CIDRs (10.30.0.0/16)."
  }
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
  description = "Size of each JetStream PVC. Both Keel streams (events and dead letters) reserve bus_max_bytes each, so it must exceed 2 x bus_max_bytes plus headroom."
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
  description = "The credentials folder that `keel-credentials init --tls-host HOST ... --auth-file DIR/nats-authorization.conf` filled on the operator's machine (KEEL_CREDENTIALS_DIR there; README: NATS identities and TLS). Terraform reads the NATS server's certificate, key and CA, its authorization, and each service's NATS identity and signing key from it into Kubernetes Secrets (and its state). Keep the folder: it holds the CA's key and is where new identities (an agent's) are issued."
  type        = string

  validation {
    condition     = fileexists("${pathexpand(var.credentials_dir)}/nats/admin.json") && fileexists("${pathexpand(var.credentials_dir)}/nats/shard-ca/tls/nodes/nats-server/cert.pem")
    error_message = "credentials_dir has no NATS identities or no NATS server certificate: run `KEEL_CREDENTIALS_DIR=<credentials_dir> keel-credentials init --tls-host <nats host> ... --auth-file <credentials_dir>/nats-authorization.conf` first (infra/terraform/README.md lists the hosts)."
  }
}

variable "nats_authorization_file" {
  description = "The NATS server's authorization, as `keel-credentials init --auth-file` wrote it or `keel-credentials issue-agent --export-server DIR` rewrote it (DIR/authorization.conf); null: <credentials_dir>/nats-authorization.conf. Re-apply after issuing an identity: the servers restart one at a time with it (the pods carry its digest)."
  type        = string
  default     = null
}

variable "agent_bundles_dir" {
  description = "Where each node agent's bundle is, one folder per node: `keel-credentials issue-agent --job <job.id> --node <node> --store-host <node> --store-host <node's IP> --export <agent_bundles_dir>/<node>`. null: <credentials_dir>/agents."
  type        = string
  default     = null
}

# -- the training job: node agents and standbys --------------------------------------------------------

variable "job" {
  description = <<-EOT
    The training job whose node agents this deploys; null deploys the control plane only. Its nodes run the
    node-agent DaemonSet (`keel run`: the ranks, health probes, py-spy stacks, every-step checkpoints in
    /dev/shm, the shard store), its spare nodes the standby Deployment (`keel run --keel-standby`), which the
    actuator scales when it promotes a standby.
      id             the job's id (`--keel-job-id`); agents' identities are issued for it
      nodes          the workers' node names (Keel's node ids; each has a bundle in agent_bundles_dir)
      standby_nodes  spare nodes a standby may run on (each has a bundle too)
      node_selector / standby_selector  labels of the workers' / spare nodes
      nproc_per_node, gpus_per_node     ranks per node; GPUs the agent's container gets (nvidia.com/gpu)
      command        the training command after `keel run ...` (python -m your.train --flags)
      rdzv_endpoint  HOST:PORT of the c10d rendezvous (a worker node's address), as torchrun's
      store_port     the shard store's port on each node (host network)
      shm_size       /dev/shm for the in-memory checkpoints: at least twice the node's model and optimizer state
      run_as_root    run the agent as root: its SYS_PTRACE then takes effect (Kubernetes gives a non-root process
                     no capability), which py-spy needs where kernel.yama.ptrace_scope is 1 (Ubuntu's default)
  EOT
  type = object({
    id                 = string
    nodes              = list(string)
    standby_nodes      = optional(list(string), [])
    node_selector      = optional(map(string), {})
    standby_selector   = optional(map(string), {})
    nproc_per_node     = number
    gpus_per_node      = optional(number, 0)
    command            = list(string)
    rdzv_endpoint      = string
    store_port         = optional(number, 29600)
    shm_size           = optional(string, "64Gi")
    runtime_class_name = optional(string)
    run_as_root        = optional(bool, false)
    resources = optional(object({
      requests = map(string)
      limits   = map(string)
    }), { requests = { cpu = "4", memory = "32Gi" }, limits = {} })
    tolerations = optional(list(object({
      key      = optional(string)
      operator = optional(string)
      value    = optional(string)
      effect   = optional(string)
    })), [])
  })
  default = null

  validation {
    condition     = var.job == null ? true : (can(regex("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", var.job.id)))
    error_message = "job.id must be a lower-case DNS label (it names Kubernetes objects and labels)."
  }
  validation {
    condition     = var.job == null ? true : ((length(var.job.nodes) > 0 && alltrue([for node in concat(var.job.nodes, var.job.standby_nodes) : can(regex("^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", node))])))
    error_message = "job.nodes must name at least one node, and every node name must be a Kubernetes node name (lower-case DNS subdomain)."
  }
  validation {
    condition     = var.job == null ? true : (length(setintersection(var.job.nodes, var.job.standby_nodes)) == 0)
    error_message = "a node is either a worker (job.nodes) or a spare (job.standby_nodes), not both."
  }
}

variable "api_tokens" {
  description = "Who may call the HTTP API (keel-api): each token's name, scope (read or operator), SHA-256 and, for an operator token, the operator signing identity it acts as (identity; default: its name), as `keel-api --new-token NAME [--scope operator [--identity ID]]` prints them; the tokens themselves stay with their holders. Empty: every request but /healthz is refused. An operator token's key must be in credentials_dir (signing/<identity>.key): the API signs its actions with it and connects to NATS as `chatops` (README: The HTTP API's actions)."
  type = list(object({
    name     = string
    scope    = string
    sha256   = string
    identity = optional(string)
  }))
  default = []

  validation {
    condition     = alltrue([for t in var.api_tokens : contains(["read", "operator"], t.scope) && can(regex("^[0-9a-f]{64}$", t.sha256))])
    error_message = "every api_tokens entry needs scope read or operator and sha256 as 64 lowercase hex digits (what keel-api --new-token prints)."
  }

  validation {
    condition     = alltrue([for t in var.api_tokens : can(regex("^[A-Za-z0-9_.@-]{1,64}$", t.name)) && (t.identity == null ? true : t.scope == "operator" && can(regex("^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$", t.identity)))])
    error_message = "api_tokens: a name is 1-64 of letters, digits, _ . @ -; only an operator token has an identity (a read token cannot act), and it is 1-64 of letters, digits, _ . @ -, starting with a letter or digit."
  }

  # The API refuses to start without them (exit 2): refused here, before anything is applied.
  validation {
    condition = alltrue([
      for t in var.api_tokens : fileexists("${pathexpand(var.credentials_dir)}/signing/${coalesce(t.identity, t.name)}.key") if t.scope == "operator"
    ])
    error_message = "api_tokens: an operator token acts as an operator signing identity whose key must be in credentials_dir, and these have none: ${join(", ", [for t in var.api_tokens : "${t.name} (identity ${coalesce(t.identity, t.name)}: ${pathexpand(var.credentials_dir)}/signing/${coalesce(t.identity, t.name)}.key)" if t.scope == "operator" && !fileexists("${pathexpand(var.credentials_dir)}/signing/${coalesce(t.identity, t.name)}.key")])}. Create each with `KEEL_CREDENTIALS_DIR=<credentials_dir> keel-credentials init --operator <identity>` (or make the token there: `keel-api --new-token NAME --scope operator --identity <identity>`), or set the token's identity to an operator that has a key."
  }

  # A token named after a service (controller, actuator, ...) would copy that service's private key into the
  # API's Secret: only operators' keys go there.
  validation {
    condition = alltrue([
      for t in var.api_tokens : try(jsondecode(file("${pathexpand(var.credentials_dir)}/signing/keyring.json")).identities[coalesce(t.identity, t.name)].role, "operator") == "operator" if t.scope == "operator"
    ])
    error_message = "api_tokens: an operator token must act as an operator's identity, and these name another role's (its private key would go into the API's Secret): ${join(", ", [for t in var.api_tokens : "${t.name} (identity ${coalesce(t.identity, t.name)})" if t.scope == "operator" && try(jsondecode(file("${pathexpand(var.credentials_dir)}/signing/keyring.json")).identities[coalesce(t.identity, t.name)].role, "operator") != "operator"])}. Give each an operator identity (`identity`)."
  }
}

variable "api_chatops" {
  description = "Chat-ops approvals served by the API (docs/api.md): Slack's buttons (slack_signing_secret_file: a file holding the Slack app's signing secret; slack_approvers: Slack user id -> operator name) and signed generic callbacks (callbacks: name, secret_file, approvers), timestamp_tolerance (e.g. \"5m\"; null: the default). The secret files are read on the machine you apply from, like credentials_dir, into the API's credentials Secret. null (or neither Slack nor a callback): off. On: the API connects to NATS as `chatops` and signs answers with the chatops key of credentials_dir."
  type = object({
    slack_signing_secret_file = optional(string)
    slack_approvers           = optional(map(string), {})
    callbacks = optional(list(object({
      name        = string
      secret_file = string
      approvers   = optional(list(string), [])
    })), [])
    timestamp_tolerance = optional(string)
  })
  default = null

  validation {
    condition = var.api_chatops == null ? true : alltrue(concat(
      var.api_chatops.slack_signing_secret_file == null ? [] : [fileexists(pathexpand(var.api_chatops.slack_signing_secret_file))],
      [for c in var.api_chatops.callbacks : fileexists(pathexpand(c.secret_file)) && can(regex("^[A-Za-z0-9_.-]{1,64}$", c.name))],
    ))
    error_message = "api_chatops: slack_signing_secret_file and every callback's secret_file must be files on this machine, and a callback's name 1-64 of letters, digits, _ . -."
  }
}

variable "api_replicas" {
  description = "HTTP API pods (stateless: they serve side by side behind the keel-api Service)."
  type        = number
  default     = 1
}

variable "api_resources" {
  description = "Resource requests and limits of the HTTP API container."
  type = object({
    requests = map(string)
    limits   = map(string)
  })
  default = {
    requests = { cpu = "100m", memory = "256Mi" }
    limits   = { memory = "512Mi" }
  }
}

variable "api_client_cidrs" {
  description = "Networks outside the cluster's pods allowed to reach the HTTP API's port (8380), e.g. the operators' VPN. Pods labelled keel.dev/api-client=true (a TLS proxy, a dashboard) reach it whatever this says."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for cidr in var.api_client_cidrs : can(cidrhost(cidr, 0))])
    error_message = "api_client_cidrs must be CIDRs (10.40.0.0/16)."
  }
}
