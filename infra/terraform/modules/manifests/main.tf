# Every Kubernetes object of a Keel deployment, as plain manifests (the API's own field names), computed from
# the inputs and nothing else: this module has no provider and creates nothing. The root module applies them
# (kubernetes_manifest); the tests run this module with the real `terraform` and validate every manifest
# against the Kubernetes API's published schema (tests/integration/test_terraform_manifests.py).
#
#   namespace
#   Secrets: NATS TLS and authorization, each consumer's credentials, each node agent's, the database URLs
#   ConfigMap of KEEL_* settings; NATS's config
#   NATS JetStream: a StatefulSet of var.nats_replicas servers (TLS, Keel's identities), its Services and PDB
#   migrate Job; one Deployment per control-plane service, each with startup, readiness and liveness probes
#   the actuator's ServiceAccount and RBAC (exactly the Kubernetes API calls keel.actuator.kubernetes makes)
#   the HTTP API (keel-api: as the auditor role, behind var.api_tokens; with an operator token or var.api_chatops
#   it also gets the chatops NATS identity and the keys it signs with) and its Service
#   the node-agent DaemonSet and the standby Deployment of the job (var.job), when one is given
#   NetworkPolicies: ingress denied by default; NATS only from Keel's pods (and var.nats_client_cidrs); the
#   managed PostgreSQL only from the pods that use it; the Kubernetes API only from the actuator; the HTTP API
#   only from pods labelled keel.dev/api-client and var.api_client_cidrs (and it reaches NATS only when it acts)

locals {
  ns = var.namespace

  common_labels = merge(
    {
      "app.kubernetes.io/part-of"    = "keel"
      "app.kubernetes.io/managed-by" = "terraform"
    },
    var.labels,
  )

  # Labels the NetworkPolicies select on: who talks to NATS, to PostgreSQL, to the Kubernetes API.
  nats_client     = { "keel.dev/nats-client" = "true" }
  database_client = { "keel.dev/database-client" = "true" }
  kube_api_client = { "keel.dev/kube-api-client" = "true" }
  control_plane   = { "keel.dev/plane" = "control" }

  # TLS only: the server's certificate must name this host (README: "NATS identities and TLS").
  nats_host     = "${var.nats_name}.${local.ns}.svc.${var.cluster_domain}"
  nats_headless = "${var.nats_name}-headless"
  nats_url      = "tls://${local.nats_host}:4222"
  nats_labels   = { "app.kubernetes.io/name" = var.nats_name, "app.kubernetes.io/component" = "nats" }

  # Where every Keel container finds its credentials (KEEL_CREDENTIALS_DIR): a private copy its init container
  # makes of its credentials Secret, in a memory-backed emptyDir.
  credentials_run_dir = "/var/lib/keel/run"
  credentials_dir     = "${local.credentials_run_dir}/credentials"
  credentials_source  = "/etc/keel/credentials"

  # A service writes this file once it consumes live and touches it every 10 s from its event loop
  # (keel.infra.service.run_service): present = ready; older than 60 s = the loop is wedged.
  alive_file = "/tmp/keel-alive"

  keel_settings = merge(
    {
      KEEL_NATS_URL                 = local.nats_url
      KEEL_CREDENTIALS_DIR          = local.credentials_dir
      KEEL_DB_SCHEMA                = var.db_schema
      KEEL_HOME                     = "/tmp/keel"
      KEEL_BUS__MAX_AGE             = var.bus_max_age
      KEEL_BUS__MAX_BYTES           = var.bus_max_bytes
      KEEL_BUS__REPLICAS            = tostring(var.nats_replicas)
      KEEL_CONTROLLER__OBSERVE_ONLY = tostring(var.controller_observe_only)
    },
    var.extra_settings,
  )

  job_id             = var.job == null ? "default" : var.job.id
  standby_deployment = "keel-standby"

  # The long-running services. Each is ONE replica with the Recreate strategy, never two at once: the recorder
  # owns one durable JetStream consumer and records batches in commit order (a second would interleave them);
  # the controller hosts the one job clock, and every decider is one logical instance (two would decide twice).
  services = {
    recorder = {
      command   = ["keel-recorder"]
      resources = var.recorder_resources
      database  = "recorder"
      env       = {}
    }
    controller = {
      command   = ["keel-controller"]
      resources = var.controller_resources
      database  = "decider"
      env       = {}
    }
    checkpoint-broker = {
      command   = ["keel-checkpoint-broker"]
      resources = var.controller_resources
      database  = "decider"
      env       = var.checkpoint_volume_claim == null ? {} : { KEEL_CHECKPOINT__PERSIST_ROOT = "/var/lib/keel/checkpoints" }
    }
    analyzer = {
      command   = ["keel-analyzer"]
      resources = var.controller_resources
      database  = "decider"
      env       = {}
    }
    hot-update = {
      command   = ["keel-hot-update"]
      resources = var.controller_resources
      database  = "decider"
      env       = {}
    }
    # Reads no log: it sends incidents, approvals, stops and rollbacks to people (docs/notifications.md). Its
    # destinations come from var.extra_settings (KEEL_NOTIFIER__DESTINATIONS); their secret files are the operator's
    # to mount.
    notifier = {
      command   = ["keel-notifier"]
      resources = var.controller_resources
      database  = null
      env       = {}
    }
    # Reads no log: it carries the controller's evictions and refills out to Kubernetes.
    actuator = {
      command   = ["keel-actuator"]
      resources = var.controller_resources
      database  = null
      env = {
        KEEL_ACTUATOR__KIND                           = "kubernetes"
        KEEL_ACTUATOR__KUBERNETES__NAMESPACE          = local.ns
        KEEL_ACTUATOR__KUBERNETES__STANDBY_DEPLOYMENT = local.standby_deployment
        KEEL_JOB_ID                                   = local.job_id
      }
    }
  }

  # The images run as an unprivileged user (Dockerfile, agent.Dockerfile: uid 10001, gid 0).
  run_as_user  = 10001
  run_as_group = 0

  # -- credentials, read from the operator's folders (keel.infra.provision: the same layout) -------------
  master  = pathexpand(var.credentials_dir)
  ca_path = "nats/shard-ca/tls/ca.pem"
  keyring = "signing/keyring.json"
  bundle_paths = merge(
    # keel-migrate administers the streams as NATS's admin; it signs nothing.
    { migrate = ["nats/admin.json", local.ca_path, local.keyring] },
    { for name in keys(local.services) : name => ["nats/${name}.json", local.ca_path, local.keyring, "signing/${name}.key"] },
    # The HTTP API, only when it acts (keel.infra.provision.api_bundle): NATS as chatops (which may publish
    # ApprovalGiven and NodeCordoned only), the chatops key with chat-ops, and each operator token's key. A
    # read-only API gets no bundle.
    {
      for name in(local.api_acts ? ["api"] : []) : name => concat(
        ["nats/chatops.json", local.ca_path, local.keyring],
        local.api_chatops ? ["signing/chatops.key"] : [],
        [for signer in local.api_signers : "signing/${signer}.key"],
      )
    },
  )
  # The operator identities the API's operator tokens act as (each one's identity, else its name).
  api_signers = distinct([for t in var.api_tokens : coalesce(t.identity, t.name) if t.scope == "operator"])
  api_chatops = var.api_chatops == null ? false : var.api_chatops.slack_signing_secret_file != null || length(var.api_chatops.callbacks) > 0
  api_acts    = local.api_chatops || length(local.api_signers) > 0
  # Chat-ops' secrets join the API's bundle (path in the bundle => file on the machine applying): Keel reads a
  # secret only from a private file of its own, which the init container's copy is.
  api_chatops_files = local.api_chatops ? merge(
    var.api_chatops.slack_signing_secret_file == null ? {} : { "chatops/slack.secret" = pathexpand(var.api_chatops.slack_signing_secret_file) },
    { for c in var.api_chatops.callbacks : "chatops/callback-${c.name}.secret" => pathexpand(c.secret_file) },
  ) : {}
  bundle_sources = {
    for name, paths in local.bundle_paths : name => merge(
      { for p in paths : p => "${local.master}/${p}" },
      name == "api" ? local.api_chatops_files : {},
    )
  }
  # Secret keys cannot hold "/" (nor "@", which an operator's name may): the file's path with "/" as "_" and "@"
  # as "_at_"; the pod's volume puts each key back at its path.
  bundle_items = {
    for name, files in local.bundle_sources : name => [for p in keys(files) : { key = replace(replace(p, "/", "_"), "@", "_at_"), path = p }]
  }
  bundles = {
    for name, files in local.bundle_sources : name => {
      for p, source in files : replace(replace(p, "/", "_"), "@", "_at_") => base64encode(sensitive(file(source)))
    }
  }

  # Each node's agent bundle (`keel-credentials issue-agent --job J --node N --store-host ... --export
  # <agent_bundles_dir>/N`): its own NATS identity, the CA, the keyring, and its shard store's certificate.
  # Every node an agent may run on: the workers' and the spare nodes' (standbys).
  agent_nodes = var.job == null ? [] : distinct(concat(var.job.nodes, var.job.standby_nodes))
  agent_paths = {
    for node in local.agent_nodes : node => [
      "nats/agent.${local.job_id}.${node}.json", local.ca_path, local.keyring, "store/ca.pem", "store/cert.pem", "store/key.pem",
    ]
  }
  agent_bundles = {
    for node, paths in local.agent_paths : node => {
      for p in paths : replace(p, "/", "_") => base64encode(sensitive(file("${pathexpand(var.agent_bundles_dir)}/${node}/${p}")))
    }
  }

  authorization_file = var.nats_authorization_file == null ? "${local.master}/nats-authorization.conf" : pathexpand(var.nats_authorization_file)
  nats_tls = {
    "tls.crt" = base64encode(sensitive(file("${local.master}/nats/shard-ca/tls/nodes/nats-server/cert.pem")))
    "tls.key" = base64encode(sensitive(file("${local.master}/nats/shard-ca/tls/nodes/nats-server/key.pem")))
    "ca.crt"  = base64encode(sensitive(file("${local.master}/${local.ca_path}")))
  }
  nats_authorization = { "authorization.conf" = base64encode(sensitive(file(local.authorization_file))) }

  # database_url with its user and password replaced by each role's.
  database_urls = merge(
    { migrate = var.database_url },
    {
      for role, password in var.database_passwords :
      role => replace(var.database_url, "/^(postgres(ql)?://)[^@/]*@/", "$${1}keel_${role}:${password}@")
    },
  )
  database_secrets = { for role in ["migrate", "recorder", "decider", "auditor"] : role => { KEEL_DATABASE_URL = base64encode(local.database_urls[role]) } }

  # Changing a Secret or the settings rolls the pods that read them (env and the credentials copy are read at
  # start only). A digest of a secret is no secret.
  settings_checksum    = sha256(jsonencode(local.keel_settings))
  bundle_checksums     = { for name, data in local.bundles : name => nonsensitive(sha256(jsonencode(data))) }
  database_checksums   = { for role, data in local.database_secrets : role => nonsensitive(sha256(jsonencode(data))) }
  agent_checksum       = nonsensitive(sha256(jsonencode(local.agent_bundles)))
  nats_secret_checksum = nonsensitive(sha256(jsonencode([local.nats_tls, local.nats_authorization])))

  # -- pod building blocks ----------------------------------------------------------------------------
  pod_security = {
    runAsNonRoot   = true
    runAsUser      = local.run_as_user
    runAsGroup     = local.run_as_group
    seccompProfile = { type = "RuntimeDefault" }
  }
  container_security = {
    allowPrivilegeEscalation = false
    readOnlyRootFilesystem   = true
    capabilities             = { drop = ["ALL"] }
  }
  # The API server drops an empty list or map (`nodeSelector: {}`), and the provider then reports an object
  # inconsistent with its manifest: optional fields are left out when empty, never sent empty.
  pull_secrets = length(var.image_pull_secrets) == 0 ? {} : { imagePullSecrets = [for name in var.image_pull_secrets : { name = name }] }
  pod_placement = merge(
    length(var.node_selector) == 0 ? {} : { nodeSelector = var.node_selector },
    local.pull_secrets,
  )

  # Keel reads a secret only from a private file of its own user (0600 in 0700 folders, keel.infra.secrets); a
  # Secret volume's files belong to root. The init container copies the Secret into a private folder of uid
  # 10001 (memory-backed) that the container uses as KEEL_CREDENTIALS_DIR.
  credentials_init = {
    for name in keys(local.bundle_paths) : name => {
      name            = "credentials"
      image           = var.images.control_plane
      imagePullPolicy = var.image_pull_policy
      command         = ["keel-credentials", "install", "--from", local.credentials_source, "--to", local.credentials_dir]
      resources       = { requests = { cpu = "10m", memory = "64Mi" }, limits = { memory = "128Mi" } }
      securityContext = local.container_security
      volumeMounts = [
        { name = "credentials-source", mountPath = local.credentials_source, readOnly = true },
        { name = "credentials", mountPath = local.credentials_run_dir },
      ]
    }
  }
  credentials_volumes = {
    for name, items in local.bundle_items : name => [
      { name = "tmp", emptyDir = {} },
      # readable by the pod's group (gid 0) for the init container's copy
      { name = "credentials-source", secret = { secretName = "keel-credentials-${name}", defaultMode = 288, items = items } }, # 0440
      { name = "credentials", emptyDir = { medium = "Memory", sizeLimit = "1Mi" } },
    ]
  }

  probes = {
    # A cold start folds the log (from the newest snapshot): up to 10 minutes before it consumes live.
    startupProbe   = { exec = { command = ["test", "-f", local.alive_file] }, periodSeconds = 5, failureThreshold = 120 }
    readinessProbe = { exec = { command = ["test", "-f", local.alive_file] }, periodSeconds = 10, failureThreshold = 3 }
    livenessProbe = {
      exec             = { command = ["sh", "-c", "test $(( $(date +%s) - $(stat -c %Y ${local.alive_file}) )) -lt 60"] }
      periodSeconds    = 20
      timeoutSeconds   = 5
      failureThreshold = 3
    }
  }
}

# -- namespace and Secrets -------------------------------------------------------------------------------

locals {
  namespace_manifest = {
    apiVersion = "v1"
    kind       = "Namespace"
    metadata = {
      name = local.ns
      # The Pod Security Standard that admits the node agent (host PID and network, SYS_PTRACE); the control
      # plane's pods meet "restricted" (non-root, no capabilities, RuntimeDefault seccomp).
      labels = merge(local.common_labels, {
        "pod-security.kubernetes.io/enforce" = var.job == null ? "restricted" : "privileged"
        "pod-security.kubernetes.io/warn"    = "restricted"
      })
    }
  }

  secret_manifests = merge(
    {
      "Secret/${var.nats_name}-tls" = {
        apiVersion = "v1", kind = "Secret", type = "Opaque", data = local.nats_tls
        metadata   = { name = "${var.nats_name}-tls", namespace = local.ns, labels = local.common_labels }
      }
      "Secret/${var.nats_name}-authorization" = {
        apiVersion = "v1", kind = "Secret", type = "Opaque", data = local.nats_authorization
        metadata   = { name = "${var.nats_name}-authorization", namespace = local.ns, labels = local.common_labels }
      }
    },
    {
      for name, data in local.bundles : "Secret/keel-credentials-${name}" => {
        apiVersion = "v1", kind = "Secret", type = "Opaque", data = data
        metadata   = { name = "keel-credentials-${name}", namespace = local.ns, labels = local.common_labels }
      }
    },
    {
      for node, data in local.agent_bundles : "Secret/keel-agent-${node}" => {
        apiVersion = "v1", kind = "Secret", type = "Opaque", data = data
        metadata   = { name = "keel-agent-${node}", namespace = local.ns, labels = merge(local.common_labels, { "keel.dev/job" = local.job_id }) }
      }
    },
    {
      for role, data in local.database_secrets : "Secret/keel-database-${role}" => {
        apiVersion = "v1", kind = "Secret", type = "Opaque", data = data
        metadata   = { name = "keel-database-${role}", namespace = local.ns, labels = local.common_labels }
      }
    },
  )
}

# -- settings and NATS -------------------------------------------------------------------------------------

locals {
  nats_routes = [for i in range(var.nats_replicas) : "nats-route://${var.nats_name}-${i}.${local.nats_headless}.${local.ns}.svc.${var.cluster_domain}:6222"]

  # The same server settings as compose's infra/nats/nats.conf and the embedded runtime, clustered.
  nats_conf = <<-EOT
    server_name: $SERVER_NAME
    listen: "0.0.0.0:4222"
    # Monitoring (probes, /varz, /jsz): plain HTTP, no message and no secret; NetworkPolicy admits no client to it.
    http_port: 8222
    # 1 MiB: the stream's max_msg_size is 1 MiB so an oversized event reaches the recorder and is dead-lettered.
    max_payload: 1048576
    lame_duck_duration: "30s"
    # The preStop hook signals lame duck mode through it.
    pid_file: "/var/run/nats/nats.pid"
    # Only Keel's identities connect, each with its own permissions (keel.infra.nats_auth renders the block).
    include "../auth/authorization.conf"
    # Clients over TLS only.
    tls {
      cert_file: "/etc/nats/tls/tls.crt"
      key_file: "/etc/nats/tls/tls.key"
      ca_file: "/etc/nats/tls/ca.crt"
    }
    jetstream {
      store_dir: "/data"
      %{~if var.nats_sync_always}
      # fsync every write before the ack.
      sync_interval: always
      %{~endif}
    }
    %{~if var.nats_replicas > 1}
    cluster {
      name: "keel"
      listen: "0.0.0.0:6222"
      # Routes over TLS, verified both ways, with the same certificate (it names *.${local.nats_headless}).
      tls {
        cert_file: "/etc/nats/tls/tls.crt"
        key_file: "/etc/nats/tls/tls.key"
        ca_file: "/etc/nats/tls/ca.crt"
      }
      routes: [
        %{~for route in local.nats_routes}
        "${route}"
        %{~endfor}
      ]
      no_advertise: true
    }
    %{~endif}
  EOT

  settings_manifests = {
    "ConfigMap/keel-settings" = {
      apiVersion = "v1", kind = "ConfigMap", data = local.keel_settings
      metadata   = { name = "keel-settings", namespace = local.ns, labels = local.common_labels }
    }
    "ConfigMap/${var.nats_name}-config" = {
      apiVersion = "v1", kind = "ConfigMap", data = { "nats.conf" = local.nats_conf }
      metadata   = { name = "${var.nats_name}-config", namespace = local.ns, labels = local.common_labels }
    }
  }

  nats_manifests = {
    "Service/${var.nats_name}" = {
      apiVersion = "v1", kind = "Service"
      metadata   = { name = var.nats_name, namespace = local.ns, labels = merge(local.common_labels, local.nats_labels) }
      spec = {
        selector = local.nats_labels
        ports    = [{ name = "client", port = 4222, targetPort = 4222, protocol = "TCP" }]
      }
    }
    "Service/${local.nats_headless}" = {
      apiVersion = "v1", kind = "Service"
      metadata   = { name = local.nats_headless, namespace = local.ns, labels = merge(local.common_labels, local.nats_labels) }
      spec = {
        clusterIP                = "None"
        publishNotReadyAddresses = true # the servers find each other before they are ready
        selector                 = local.nats_labels
        ports = [
          { name = "client", port = 4222, targetPort = 4222, protocol = "TCP" },
          { name = "cluster", port = 6222, targetPort = 6222, protocol = "TCP" },
          { name = "monitor", port = 8222, targetPort = 8222, protocol = "TCP" },
        ]
      }
    }
    "PodDisruptionBudget/${var.nats_name}" = {
      apiVersion = "policy/v1", kind = "PodDisruptionBudget"
      metadata   = { name = var.nats_name, namespace = local.ns, labels = local.common_labels }
      spec       = { maxUnavailable = 1, selector = { matchLabels = local.nats_labels } }
    }
    "StatefulSet/${var.nats_name}" = {
      apiVersion = "apps/v1", kind = "StatefulSet"
      metadata   = { name = var.nats_name, namespace = local.ns, labels = merge(local.common_labels, local.nats_labels) }
      spec = {
        replicas            = var.nats_replicas
        serviceName         = local.nats_headless
        podManagementPolicy = "Parallel"
        selector            = { matchLabels = local.nats_labels }
        template = {
          metadata = {
            labels = merge(local.common_labels, local.nats_labels)
            annotations = {
              "checksum/nats-config"  = sha256(local.nats_conf)
              "checksum/nats-secrets" = local.nats_secret_checksum
            }
          }
          spec = merge(local.pod_placement, {
            automountServiceAccountToken  = false
            enableServiceLinks            = false
            terminationGracePeriodSeconds = 60
            securityContext               = { runAsNonRoot = true, runAsUser = 1000, runAsGroup = 1000, fsGroup = 1000, seccompProfile = { type = "RuntimeDefault" } }
            # One server per Kubernetes node: three servers on one node would make R3 a formality.
            topologySpreadConstraints = [{
              maxSkew           = 1
              topologyKey       = "kubernetes.io/hostname"
              whenUnsatisfiable = "DoNotSchedule"
              labelSelector     = { matchLabels = local.nats_labels }
            }]
            containers = [{
              name            = "nats"
              image           = var.images.nats
              imagePullPolicy = var.image_pull_policy
              args            = ["--config", "/etc/nats/config/nats.conf"]
              env             = [{ name = "SERVER_NAME", valueFrom = { fieldRef = { fieldPath = "metadata.name" } } }]
              ports = [
                { name = "client", containerPort = 4222, protocol = "TCP" },
                { name = "cluster", containerPort = 6222, protocol = "TCP" },
                { name = "monitor", containerPort = 8222, protocol = "TCP" },
              ]
              resources       = var.nats_resources
              securityContext = local.container_security
              # Lame duck: clients move to another server before this one stops.
              lifecycle      = { preStop = { exec = { command = ["nats-server", "-sl=ldm=/var/run/nats/nats.pid"] } } }
              startupProbe   = { httpGet = { path = "/healthz", port = "monitor" }, periodSeconds = 5, failureThreshold = 90 }
              readinessProbe = { httpGet = { path = "/healthz?js-enabled-only=true", port = "monitor" }, periodSeconds = 10, failureThreshold = 3 }
              livenessProbe  = { httpGet = { path = "/healthz?js-enabled-only=true", port = "monitor" }, periodSeconds = 30, timeoutSeconds = 5, failureThreshold = 3 }
              volumeMounts = [
                { name = "config", mountPath = "/etc/nats/config", readOnly = true },
                { name = "tls", mountPath = "/etc/nats/tls", readOnly = true },
                { name = "auth", mountPath = "/etc/nats/auth", readOnly = true },
                { name = "data", mountPath = "/data" },
                { name = "run", mountPath = "/var/run/nats" },
              ]
            }]
            volumes = [
              { name = "config", configMap = { name = "${var.nats_name}-config" } },
              { name = "tls", secret = { secretName = "${var.nats_name}-tls", defaultMode = 288 } },            # 0440, group fsGroup
              { name = "auth", secret = { secretName = "${var.nats_name}-authorization", defaultMode = 288 } }, # 0440
              { name = "run", emptyDir = { medium = "Memory", sizeLimit = "1Mi" } },
            ]
          })
        }
        # Immutable once created: a new size or class needs the StatefulSet recreated (README), and the claims'
        # labels are fixed so that var.labels can change.
        volumeClaimTemplates = [{
          metadata = { name = "data", labels = { "app.kubernetes.io/part-of" = "keel" } }
          spec = merge(
            { accessModes = ["ReadWriteOnce"], resources = { requests = { storage = var.nats_storage_size } } },
            var.nats_storage_class == null ? {} : { storageClassName = var.nats_storage_class },
          )
        }]
      }
    }
  }
}

# -- migrate Job -----------------------------------------------------------------------------------------

locals {
  # A Job's pod template cannot change: any change is a new Job (its name carries a digest of its spec, the
  # settings and its database Secret), so the migration runs again, which is also what brings the streams to
  # new settings (`keel-migrate` administers them; the services do not change an existing stream). The root
  # module waits for it to complete before it rolls the services.
  migrate_labels = merge(local.common_labels, local.nats_client, local.database_client, local.control_plane,
  { "app.kubernetes.io/name" = "keel-migrate" })
  migrate_spec = {
    backoffLimit = 4
    template = {
      metadata = { labels = local.migrate_labels }
      spec = merge(local.pod_placement, {
        restartPolicy                = "Never"
        automountServiceAccountToken = false
        enableServiceLinks           = false
        securityContext              = local.pod_security
        initContainers               = [local.credentials_init["migrate"]]
        containers = [{
          name            = "migrate"
          image           = var.images.control_plane
          imagePullPolicy = var.image_pull_policy
          command         = ["keel-migrate"]
          envFrom         = [{ configMapRef = { name = "keel-settings" } }, { secretRef = { name = "keel-database-migrate" } }]
          resources       = { requests = { cpu = "100m", memory = "256Mi" }, limits = { memory = "512Mi" } }
          securityContext = local.container_security
          volumeMounts = [
            { name = "tmp", mountPath = "/tmp" },
            { name = "credentials", mountPath = local.credentials_run_dir },
          ]
        }]
        volumes = local.credentials_volumes["migrate"]
      })
    }
  }
  migrate_name = "keel-migrate-${substr(sha256(jsonencode([local.migrate_spec, local.settings_checksum, local.database_checksums["migrate"]])), 0, 10)}"

  # Keyed by a fixed name: the digest is unknown at the first plan (the database passwords are generated during
  # the apply), and for_each needs known keys. A new metadata.name makes the provider replace the Job.
  migrate_manifests = {
    "Job/keel-migrate" = {
      apiVersion = "batch/v1", kind = "Job"
      metadata   = { name = local.migrate_name, namespace = local.ns, labels = local.migrate_labels }
      spec       = local.migrate_spec
    }
  }
}

# -- control-plane services ----------------------------------------------------------------------------

locals {
  service_labels = {
    for name, service in local.services : name => merge(
      local.common_labels, local.nats_client, local.control_plane,
      service.database == null ? {} : local.database_client,
      name == "actuator" ? local.kube_api_client : {},
      { "app.kubernetes.io/name" = "keel-${name}", "app.kubernetes.io/component" = name },
    )
  }
  checkpoints_mounted = var.checkpoint_volume_claim != null

  service_manifests = {
    for name, service in local.services : "Deployment/keel-${name}" => {
      apiVersion = "apps/v1", kind = "Deployment"
      metadata   = { name = "keel-${name}", namespace = local.ns, labels = local.service_labels[name] }
      spec = {
        # Exactly one: see local.services. Do not scale, and do not switch to RollingUpdate (it would run the
        # old and the new pod side by side for a moment).
        replicas             = 1
        revisionHistoryLimit = 5
        strategy             = { type = "Recreate" }
        selector             = { matchLabels = { "app.kubernetes.io/name" = "keel-${name}" } }
        template = {
          metadata = {
            labels = local.service_labels[name]
            annotations = merge(
              {
                "checksum/keel-settings"    = local.settings_checksum
                "checksum/keel-credentials" = local.bundle_checksums[name]
              },
              service.database == null ? {} : { "checksum/keel-database" = local.database_checksums[service.database] },
            )
          }
          spec = merge(
            {
              automountServiceAccountToken  = name == "actuator"
              enableServiceLinks            = false
              terminationGracePeriodSeconds = 30
              securityContext               = local.pod_security
              initContainers                = [local.credentials_init[name]]
              containers = [merge(local.probes, {
                name            = name
                image           = var.images.control_plane
                imagePullPolicy = var.image_pull_policy
                command         = service.command
                envFrom = concat(
                  [{ configMapRef = { name = "keel-settings" } }],
                  service.database == null ? [] : [{ secretRef = { name = "keel-database-${service.database}" } }],
                )
                env             = [for key, value in merge(service.env, { KEEL_SERVICE_READY_FILE = local.alive_file }) : { name = key, value = value }]
                resources       = service.resources
                securityContext = local.container_security
                volumeMounts = concat(
                  [
                    { name = "tmp", mountPath = "/tmp" },
                    { name = "credentials", mountPath = local.credentials_run_dir },
                  ],
                  # The broker writes the persistent tier's manifests beside the shards the nodes write.
                  name == "checkpoint-broker" && local.checkpoints_mounted ? [{ name = "checkpoints", mountPath = "/var/lib/keel/checkpoints" }] : [],
                )
              })]
              volumes = concat(
                local.credentials_volumes[name],
                name == "checkpoint-broker" && local.checkpoints_mounted ? [{ name = "checkpoints", persistentVolumeClaim = { claimName = var.checkpoint_volume_claim } }] : [],
              )
            },
            name == "actuator" ? { serviceAccountName = "keel-actuator" } : {},
            local.pod_placement,
          )
        }
      }
    }
  }
}

# -- the HTTP API ---------------------------------------------------------------------------------------

locals {
  # Reads the event store as keel_auditor. Read-only (no operator token, no chat-ops): no NATS identity, no
  # settings of the services, its own few settings below. When it acts (local.api_acts) it is a NATS client like
  # the control plane: the settings ConfigMap (KEEL_NATS_URL, KEEL_CREDENTIALS_DIR, the bus's subjects), its
  # bundle copied by the init container, the nats-client label and the egress to NATS. Stateless:
  # var.api_replicas of it may serve side by side.
  api_port = 8380
  api_labels = merge(local.common_labels, local.database_client, local.api_acts ? local.nats_client : {},
  { "app.kubernetes.io/name" = "keel-api", "app.kubernetes.io/component" = "api" })
  api_init = [for name in(local.api_acts ? ["api"] : []) : local.credentials_init[name]]
  # Chat-ops' settings, its secrets where the init container's copy puts them.
  api_chatops_env = local.api_chatops ? merge(
    var.api_chatops.slack_signing_secret_file == null ? {} : { KEEL_API__CHATOPS__SLACK_SIGNING_SECRET_FILE = "${local.credentials_dir}/chatops/slack.secret" },
    length(var.api_chatops.slack_approvers) == 0 ? {} : { KEEL_API__CHATOPS__SLACK_APPROVERS = jsonencode(var.api_chatops.slack_approvers) },
    length(var.api_chatops.callbacks) == 0 ? {} : {
      KEEL_API__CHATOPS__CALLBACKS = jsonencode([
        for c in var.api_chatops.callbacks : { name = c.name, secret_file = "${local.credentials_dir}/chatops/callback-${c.name}.secret", approvers = c.approvers }
      ])
    },
    var.api_chatops.timestamp_tolerance == null ? {} : { KEEL_API__CHATOPS__TIMESTAMP_TOLERANCE = var.api_chatops.timestamp_tolerance },
  ) : {}
  api_client = { "keel.dev/api-client" = "true" }
  api_probe  = { httpGet = { path = "/healthz", port = "http" } }

  api_manifests = {
    "Deployment/keel-api" = {
      apiVersion = "apps/v1", kind = "Deployment"
      metadata   = { name = "keel-api", namespace = local.ns, labels = local.api_labels }
      spec = {
        replicas             = var.api_replicas
        revisionHistoryLimit = 5
        selector             = { matchLabels = { "app.kubernetes.io/name" = "keel-api" } }
        template = {
          metadata = {
            labels = local.api_labels
            annotations = merge(
              {
                "checksum/keel-database"   = local.database_checksums["auditor"]
                "checksum/keel-api-tokens" = sha256(jsonencode(var.api_tokens))
              },
              local.api_acts ? {
                "checksum/keel-settings"    = local.settings_checksum
                "checksum/keel-credentials" = lookup(local.bundle_checksums, "api", "")
              } : {},
            )
          }
          spec = merge(
            {
              automountServiceAccountToken  = false
              enableServiceLinks            = false
              terminationGracePeriodSeconds = 30
              securityContext               = local.pod_security
              containers = [{
                name            = "api"
                image           = var.images.control_plane
                imagePullPolicy = var.image_pull_policy
                command         = ["keel-api"]
                ports           = [{ name = "http", containerPort = local.api_port, protocol = "TCP" }]
                envFrom = concat(
                  local.api_acts ? [{ configMapRef = { name = "keel-settings" } }] : [],
                  [{ secretRef = { name = "keel-database-auditor" } }],
                )
                env = [for key, value in merge({
                  KEEL_DB_SCHEMA        = var.db_schema
                  KEEL_HOME             = "/tmp/keel"
                  KEEL_API__LISTEN_HOST = "0.0.0.0"
                  KEEL_API__LISTEN_PORT = tostring(local.api_port)
                  # Only each token's name, scope, SHA-256 and an operator token's identity: no token is in the cluster.
                  KEEL_API__TOKENS = jsonencode([for t in var.api_tokens : { for k, v in t : k => v if v != null }])
                }, local.api_chatops_env) : { name = key, value = value }]
                resources       = var.api_resources
                securityContext = local.container_security
                volumeMounts = concat(
                  [{ name = "tmp", mountPath = "/tmp" }],
                  local.api_acts ? [{ name = "credentials", mountPath = local.credentials_run_dir }] : [],
                )
                startupProbe   = merge(local.api_probe, { periodSeconds = 5, failureThreshold = 60 })
                readinessProbe = merge(local.api_probe, { periodSeconds = 10, failureThreshold = 3 })
                livenessProbe  = merge(local.api_probe, { periodSeconds = 20, timeoutSeconds = 5, failureThreshold = 3 })
              }]
              volumes = concat([{ name = "tmp", emptyDir = {} }], flatten([for name in(local.api_acts ? ["api"] : []) : [for v in local.credentials_volumes[name] : v if v.name != "tmp"]]))
            },
            length(local.api_init) == 0 ? {} : { initContainers = local.api_init },
            local.pod_placement,
          )
        }
      }
    }
    "Service/keel-api" = {
      apiVersion = "v1", kind = "Service"
      metadata   = { name = "keel-api", namespace = local.ns, labels = local.api_labels }
      spec = {
        selector = { "app.kubernetes.io/name" = "keel-api" }
        ports    = [{ name = "http", port = local.api_port, targetPort = "http", protocol = "TCP" }]
      }
    }
  }
}

# -- the actuator's RBAC: exactly the calls keel.actuator.kubernetes makes --------------------------------

locals {
  rbac_manifests = {
    "ServiceAccount/keel-actuator" = {
      apiVersion = "v1", kind = "ServiceAccount"
      metadata   = { name = "keel-actuator", namespace = local.ns, labels = local.common_labels }
    }
    # Cluster-wide: nodes are cluster objects, and the job's pods are found in every namespace by their label.
    "ClusterRole/keel-actuator-${local.ns}" = {
      apiVersion = "rbac.authorization.k8s.io/v1", kind = "ClusterRole"
      metadata   = { name = "keel-actuator-${local.ns}", labels = local.common_labels }
      rules = [
        # evict: read the node, then cordon, taint and label it in one strategic-merge patch
        { apiGroups = [""], resources = ["nodes"], verbs = ["get", "patch"] },
        # evict: the job's pods on that node (label and field selector), deleted
        { apiGroups = [""], resources = ["pods"], verbs = ["list", "delete"] },
      ]
    }
    "ClusterRoleBinding/keel-actuator-${local.ns}" = {
      apiVersion = "rbac.authorization.k8s.io/v1", kind = "ClusterRoleBinding"
      metadata   = { name = "keel-actuator-${local.ns}", labels = local.common_labels }
      roleRef    = { apiGroup = "rbac.authorization.k8s.io", kind = "ClusterRole", name = "keel-actuator-${local.ns}" }
      subjects   = [{ kind = "ServiceAccount", name = "keel-actuator", namespace = local.ns }]
    }
    # In Keel's namespace only: the standby pods (listed, a promoted one labelled) and the standby set's scale.
    "Role/keel-actuator" = {
      apiVersion = "rbac.authorization.k8s.io/v1", kind = "Role"
      metadata   = { name = "keel-actuator", namespace = local.ns, labels = local.common_labels }
      rules = [
        { apiGroups = [""], resources = ["pods"], verbs = ["list", "patch"] },
        { apiGroups = ["apps"], resources = ["deployments/scale"], resourceNames = [local.standby_deployment], verbs = ["get", "patch"] },
      ]
    }
    "RoleBinding/keel-actuator" = {
      apiVersion = "rbac.authorization.k8s.io/v1", kind = "RoleBinding"
      metadata   = { name = "keel-actuator", namespace = local.ns, labels = local.common_labels }
      roleRef    = { apiGroup = "rbac.authorization.k8s.io", kind = "Role", name = "keel-actuator" }
      subjects   = [{ kind = "ServiceAccount", name = "keel-actuator", namespace = local.ns }]
    }
  }
}

# -- the job's node agents and standbys ----------------------------------------------------------------

locals {
  agent_bundle_root = "/etc/keel/agents"

  # One pod template for both: a worker agent (the DaemonSet, one per node of var.job.node_selector) and a
  # standby (`--keel-standby`: ready, no ranks, until the controller promotes it).
  agent_roles    = var.job == null ? [] : ["worker", "standby"]
  agent_selector = var.job == null ? {} : { worker = var.job.node_selector, standby = var.job.standby_selector }
  agent_pod = {
    for role in local.agent_roles : role => {
      metadata = {
        labels = merge(local.common_labels, local.nats_client, {
          "app.kubernetes.io/name"      = "keel-agent"
          "app.kubernetes.io/component" = "agent"
          "keel.dev/job"                = var.job.id
          "keel.dev/role"               = role
        })
        annotations = {
          "checksum/keel-settings"      = local.settings_checksum
          "checksum/keel-agent-bundles" = local.agent_checksum
        }
      }
      spec = merge(
        {
          # Host PID: py-spy reads the stacks of the ranks, wherever they run on the node. Host network: the
          # ranks' collectives and the shard store use the node's addresses (its certificate names them).
          hostPID                       = true
          hostNetwork                   = true
          dnsPolicy                     = "ClusterFirstWithHostNet"
          automountServiceAccountToken  = false
          enableServiceLinks            = false
          terminationGracePeriodSeconds = 60
          # Kubernetes gives a non-root process no effective capability: SYS_PTRACE (py-spy on ranks that are
          # not its descendants, under kernel.yama.ptrace_scope=1) takes effect only with job.run_as_root.
          securityContext = merge(
            { runAsGroup = local.run_as_group, seccompProfile = { type = "RuntimeDefault" } },
            var.job.run_as_root ? { runAsUser = 0, runAsNonRoot = false } : { runAsUser = local.run_as_user, runAsNonRoot = true },
          )
          initContainers = [{
            # This node's bundle only: every node's is in the projected volume (a DaemonSet's pods share one
            # template), the agent container sees just its own copy.
            name            = "credentials"
            image           = var.images.agent
            imagePullPolicy = var.image_pull_policy
            command         = ["keel-credentials", "install", "--from", "${local.agent_bundle_root}/$(NODE_NAME)", "--to", local.credentials_dir]
            env             = [{ name = "NODE_NAME", valueFrom = { fieldRef = { fieldPath = "spec.nodeName" } } }]
            resources       = { requests = { cpu = "10m", memory = "64Mi" }, limits = { memory = "128Mi" } }
            securityContext = local.container_security
            volumeMounts = [
              { name = "agent-bundles", mountPath = local.agent_bundle_root, readOnly = true },
              { name = "credentials", mountPath = local.credentials_run_dir },
            ]
          }]
          containers = [{
            name            = "agent"
            image           = var.images.agent
            imagePullPolicy = var.image_pull_policy
            command = concat(
              ["keel", "run",
                "--nnodes", tostring(length(var.job.nodes)), "--nproc-per-node", tostring(var.job.nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", var.job.rdzv_endpoint, "--rdzv-id", var.job.id,
                "--keel-job-id", var.job.id, "--keel-node-id", "$(NODE_NAME)", "--keel-fault-domain", "$(NODE_NAME)",
                "--keel-agent-dir", "/var/lib/keel/node", "--keel-ckpt-dir", "/dev/shm/keel",
                "--keel-store-address", "0.0.0.0:${var.job.store_port}", "--keel-store-advertise", "$(HOST_IP)",
                "--keel-tls-cert", "${local.credentials_dir}/store/cert.pem", "--keel-tls-key", "${local.credentials_dir}/store/key.pem",
              "--keel-tls-ca", "${local.credentials_dir}/store/ca.pem"],
              local.checkpoints_mounted ? ["--keel-persist-root", "/var/lib/keel/checkpoints"] : [],
              role == "standby" ? ["--keel-standby"] : [],
              var.job.command,
            )
            envFrom = [{ configMapRef = { name = "keel-settings" } }]
            env = [
              { name = "NODE_NAME", valueFrom = { fieldRef = { fieldPath = "spec.nodeName" } } },
              { name = "HOST_IP", valueFrom = { fieldRef = { fieldPath = "status.hostIP" } } },
              { name = "KEEL_HOME", value = "/var/lib/keel/node/home" },
              # NVML (GPU health, the GPU self-test) needs the driver's utility libraries as well as compute.
              { name = "NVIDIA_DRIVER_CAPABILITIES", value = "compute,utility" },
            ]
            resources = { for key, value in {
              requests = var.job.resources.requests
              limits   = merge(var.job.resources.limits, var.job.gpus_per_node > 0 ? { "nvidia.com/gpu" = tostring(var.job.gpus_per_node) } : {})
            } : key => value if length(value) > 0 }
            securityContext = {
              allowPrivilegeEscalation = false
              # py-spy attaches to the ranks (the agent's children; other processes of the node need the capability).
              capabilities = { drop = ["ALL"], add = ["SYS_PTRACE"] }
            }
            volumeMounts = concat(
              [
                { name = "dshm", mountPath = "/dev/shm" },
                { name = "node", mountPath = "/var/lib/keel/node" },
                { name = "credentials", mountPath = local.credentials_run_dir },
              ],
              local.checkpoints_mounted ? [{ name = "checkpoints", mountPath = "/var/lib/keel/checkpoints" }] : [],
            )
          }]
          volumes = concat(
            [
              # Every-step checkpoints live in /dev/shm/keel: memory, sized for two copies of the node's state.
              { name = "dshm", emptyDir = { medium = "Memory", sizeLimit = var.job.shm_size } },
              { name = "node", emptyDir = {} },
              { name = "credentials", emptyDir = { medium = "Memory", sizeLimit = "1Mi" } },
              {
                name = "agent-bundles"
                projected = {
                  defaultMode = 288 # 0440
                  sources = [
                    for node, paths in local.agent_paths : {
                      secret = { name = "keel-agent-${node}", items = [for p in paths : { key = replace(p, "/", "_"), path = "${node}/${p}" }] }
                    }
                  ]
                }
              },
            ],
            local.checkpoints_mounted ? [{ name = "checkpoints", persistentVolumeClaim = { claimName = var.checkpoint_volume_claim } }] : [],
          )
        },
        var.job.runtime_class_name == null ? {} : { runtimeClassName = var.job.runtime_class_name },
        local.pull_secrets,
        length(local.agent_selector[role]) == 0 ? {} : { nodeSelector = local.agent_selector[role] },
        length(var.job.tolerations) == 0 ? {} : { tolerations = [for t in var.job.tolerations : { for k, v in t : k => v if v != null }] },
      )
    }
  }

  agent_manifests = merge(
    {
      for role, pod in local.agent_pod : "DaemonSet/keel-agent-${var.job.id}" => {
        apiVersion = "apps/v1", kind = "DaemonSet"
        metadata   = { name = "keel-agent-${var.job.id}", namespace = local.ns, labels = pod.metadata.labels }
        spec = {
          selector = { matchLabels = { "keel.dev/job" = var.job.id, "keel.dev/role" = "worker" } }
          # A rolling update would restart the job's nodes one by one under a running job: a new agent image is
          # rolled out by deleting the pods when the job allows it (hot-update handles the training code).
          updateStrategy = { type = "OnDelete" }
          template       = pod
        }
      } if role == "worker"
    },
    {
      for role, pod in local.agent_pod : "Deployment/${local.standby_deployment}" => {
        apiVersion = "apps/v1", kind = "Deployment"
        metadata   = { name = local.standby_deployment, namespace = local.ns, labels = pod.metadata.labels }
        spec = {
          # No replicas: the actuator owns the scale (a refill adds the standbys it promoted), and a count here
          # would have every apply take them back. A new Deployment starts with one.
          selector = { matchLabels = { "keel.dev/job" = var.job.id, "keel.dev/role" = "standby" } }
          template = {
            # Without the checksums: a changed setting or bundle must not roll the standbys, since a promoted one
            # runs ranks (it restarts with its node's next restart). A changed template still rolls them all.
            metadata = { labels = pod.metadata.labels }
            spec = merge(pod.spec, {
              # One standby per spare node, and never on a node of the job's workers.
              affinity = {
                podAntiAffinity = {
                  requiredDuringSchedulingIgnoredDuringExecution = [{
                    topologyKey   = "kubernetes.io/hostname"
                    labelSelector = { matchLabels = { "keel.dev/job" = var.job.id } }
                  }]
                }
              }
            })
          }
        }
      } if role == "standby"
    },
  )
}

# -- NetworkPolicies -----------------------------------------------------------------------------------

locals {
  dns_egress = {
    to    = [{ namespaceSelector = { matchLabels = { "kubernetes.io/metadata.name" = "kube-system" } }, podSelector = { matchLabels = { "k8s-app" = "kube-dns" } } }]
    ports = [{ protocol = "UDP", port = 53 }, { protocol = "TCP", port = 53 }]
  }

  network_manifests = {
    # Nothing in the namespace accepts a connection unless a policy below says so.
    "NetworkPolicy/keel-default-deny-ingress" = {
      apiVersion = "networking.k8s.io/v1", kind = "NetworkPolicy"
      metadata   = { name = "keel-default-deny-ingress", namespace = local.ns, labels = local.common_labels }
      spec       = { podSelector = {}, policyTypes = ["Ingress"] }
    }
    # NATS: clients from Keel's pods (and the node agents' hosts, and operators' networks) on 4222; the servers'
    # routes from each other on 6222. The monitoring port admits nobody (the kubelet's probes are not policed).
    "NetworkPolicy/${var.nats_name}" = {
      apiVersion = "networking.k8s.io/v1", kind = "NetworkPolicy"
      metadata   = { name = var.nats_name, namespace = local.ns, labels = local.common_labels }
      spec = {
        podSelector = { matchLabels = local.nats_labels }
        policyTypes = ["Ingress", "Egress"]
        ingress = concat(
          [
            { from = [{ podSelector = { matchLabels = local.nats_client } }], ports = [{ protocol = "TCP", port = 4222 }] },
            { from = [{ podSelector = { matchLabels = local.nats_labels } }], ports = [{ protocol = "TCP", port = 6222 }] },
          ],
          length(var.nats_client_cidrs) == 0 ? [] : [{
            from = [for cidr in var.nats_client_cidrs : { ipBlock = { cidr = cidr } }], ports = [{ protocol = "TCP", port = 4222 }]
          }],
        )
        egress = [
          local.dns_egress,
          { to = [{ podSelector = { matchLabels = local.nats_labels } }], ports = [{ protocol = "TCP", port = 6222 }] },
        ]
      }
    }
    # The control plane reaches DNS and NATS, nothing else (the two policies below add the database and the API).
    "NetworkPolicy/keel-control-plane-egress" = {
      apiVersion = "networking.k8s.io/v1", kind = "NetworkPolicy"
      metadata   = { name = "keel-control-plane-egress", namespace = local.ns, labels = local.common_labels }
      spec = {
        podSelector = { matchLabels = local.control_plane }
        policyTypes = ["Egress"]
        egress = [
          local.dns_egress,
          { to = [{ podSelector = { matchLabels = local.nats_labels } }], ports = [{ protocol = "TCP", port = 4222 }] },
        ]
      }
    }
    # PostgreSQL (managed, outside the cluster): only the pods that hold a database role reach it.
    "NetworkPolicy/keel-database-egress" = {
      apiVersion = "networking.k8s.io/v1", kind = "NetworkPolicy"
      metadata   = { name = "keel-database-egress", namespace = local.ns, labels = local.common_labels }
      spec = {
        podSelector = { matchLabels = local.database_client }
        policyTypes = ["Egress"]
        egress = [{
          to    = [for cidr in var.database_cidrs : { ipBlock = { cidr = cidr } }]
          ports = [{ protocol = "TCP", port = var.database_port }]
        }]
      }
    }
    # The HTTP API: reached from pods labelled keel.dev/api-client (a TLS proxy, a dashboard) and from
    # var.api_client_cidrs; it reaches DNS (and the database, by the policy above), and NATS only when it acts
    # (operator tokens, chat-ops).
    "NetworkPolicy/keel-api" = {
      apiVersion = "networking.k8s.io/v1", kind = "NetworkPolicy"
      metadata   = { name = "keel-api", namespace = local.ns, labels = local.common_labels }
      spec = {
        podSelector = { matchLabels = { "app.kubernetes.io/name" = "keel-api" } }
        policyTypes = ["Ingress", "Egress"]
        ingress = [{
          from = concat([{ podSelector = { matchLabels = local.api_client } }],
          [for cidr in var.api_client_cidrs : { ipBlock = { cidr = cidr } }])
          ports = [{ protocol = "TCP", port = local.api_port }]
        }]
        egress = concat(
          [local.dns_egress],
          local.api_acts ? [{ to = [{ podSelector = { matchLabels = local.nats_labels } }], ports = [{ protocol = "TCP", port = 4222 }] }] : [],
        )
      }
    }
    # The Kubernetes API: the actuator only.
    "NetworkPolicy/keel-kube-api-egress" = {
      apiVersion = "networking.k8s.io/v1", kind = "NetworkPolicy"
      metadata   = { name = "keel-kube-api-egress", namespace = local.ns, labels = local.common_labels }
      spec = {
        podSelector = { matchLabels = local.kube_api_client }
        policyTypes = ["Egress"]
        egress = [{
          to    = [for cidr in var.kube_api_cidrs : { ipBlock = { cidr = cidr } }]
          ports = [{ protocol = "TCP", port = 443 }, { protocol = "TCP", port = 6443 }]
        }]
      }
    }
  }
}
