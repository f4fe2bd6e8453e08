# Keel's control plane on Kubernetes, as it exists today:
#
#   namespace
#   NATS JetStream cluster (official nats Helm chart: file storage on PVCs, var.nats_replicas servers)
#   ConfigMap (KEEL_* settings) + one Secret per database role (KEEL_DATABASE_URL of that role on the
#   managed PostgreSQL; the recorder's and deciders' passwords generated here: random_password)
#   NATS over TLS only, with Keel's identities and permissions: the server's certificate and authorization,
#   and one credentials Secret per consumer, read from var.credentials_dir (`keel credentials init`, README)
#   migrate Job (`keel-migrate`), then one Deployment per control-plane service (one replica each):
#   recorder, controller, checkpoint-broker, analyzer, hot-update
#
# Not here yet: the node agent DaemonSet, and the notifier and api services (not written yet).

locals {
  common_labels = merge(
    {
      "app.kubernetes.io/part-of"    = "keel"
      "app.kubernetes.io/managed-by" = "terraform"
    },
    var.labels,
  )

  # TLS only: the server's certificate must name this host (README: "NATS identities and TLS").
  nats_host = "${var.nats_release_name}.${var.namespace}.svc.${var.cluster_domain}"
  nats_url  = "tls://${local.nats_host}:4222"

  # Where every Keel container finds its credentials (KEEL_CREDENTIALS_DIR): a private copy its init container
  # makes of its credentials Secret, in a memory-backed emptyDir (the pods' `credentials` init container).
  credentials_run_dir = "/var/lib/keel/run"
  credentials_dir     = "${local.credentials_run_dir}/credentials"
  credentials_source  = "/etc/keel/credentials"

  # Every KEEL_* setting except the database URL, which lives in the Secret. Values are strings; the
  # services validate them at start (durations and sizes need units) and exit on a bad one.
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

  # The long-running services. Each is ONE replica with the Recreate strategy, never two at once:
  # the recorder owns one durable JetStream consumer and records batches in commit order (a second
  # instance would interleave them); the controller hosts the one job clock and is one logical
  # instance per cluster by design, as is every decider (two would decide everything twice).
  services = {
    recorder = {
      command   = ["keel-recorder"]
      resources = var.recorder_resources
    }
    controller = {
      command   = ["keel-controller"]
      resources = var.controller_resources
    }
    # The other deciders are as small as the controller: they fold the same log and decide in memory.
    checkpoint-broker = {
      command   = ["keel-checkpoint-broker"]
      resources = var.controller_resources
    }
    analyzer = {
      command   = ["keel-analyzer"]
      resources = var.controller_resources
    }
    hot-update = {
      command   = ["keel-hot-update"]
      resources = var.controller_resources
    }
  }

  # The image runs as an unprivileged user (Dockerfile: uid 10001, gid 0).
  run_as_user  = 10001
  run_as_group = 0

  # Each consumer's credentials (keel.infra.provision.BUNDLES, the same layout): its NATS identity
  # (nats/<identity>.json), the NATS server's CA, the public keyring and, when it signs events, its signing key.
  # The migrate Job acts as NATS's admin (it brings the streams to these settings) and signs nothing.
  bundles = merge(
    { migrate = { nats = "admin", signing = null } },
    { for name in keys(local.services) : name => { nats = name, signing = name } },
  )
  master = pathexpand(var.credentials_dir)

  # Each bundle's Secret keys and where its pods' secret volume puts them: a credentials folder's layout
  # (keel.infra.provision.bundle_files).
  bundle_items = {
    for name, bundle in local.bundles : name => concat(
      [
        { key = "nats-identity", path = "nats/${bundle.nats}.json" },
        { key = "nats-ca", path = "nats/shard-ca/tls/ca.pem" },
        { key = "keyring", path = "signing/keyring.json" },
      ],
      bundle.signing == null ? [] : [{ key = "signing-key", path = "signing/${bundle.signing}.key" }],
    )
  }
}

# -- namespace ---------------------------------------------------------------------------------------

resource "kubernetes_namespace_v1" "keel" {
  metadata {
    name   = var.namespace
    labels = local.common_labels
  }
}

# -- NATS identities and TLS (keel.infra.nats_auth, docs/security.md) -----------------------------------
#
# Read from var.credentials_dir, which `keel credentials init --tls-host ... --auth-file ...` filled on the
# operator's machine (README). Terraform keeps them, like every secret it handles, in its state.

# The server's certificate and key (clients and, between servers, routes) and the CA that signed it.
resource "kubernetes_secret_v1" "nats_tls" {
  metadata {
    name      = "keel-nats-tls"
    namespace = kubernetes_namespace_v1.keel.metadata[0].name
    labels    = local.common_labels
  }

  type = "Opaque"

  data = {
    "tls.crt" = file("${local.master}/nats/shard-ca/tls/nodes/nats-server/cert.pem")
    "tls.key" = file("${local.master}/nats/shard-ca/tls/nodes/nats-server/key.pem")
    "ca.crt"  = file("${local.master}/nats/shard-ca/tls/ca.pem")
  }
}

# Every identity's user, password and permissions: the server's `authorization` block, included by nats.conf.
resource "kubernetes_secret_v1" "nats_authorization" {
  metadata {
    name      = "keel-nats-authorization"
    namespace = kubernetes_namespace_v1.keel.metadata[0].name
    labels    = local.common_labels
  }

  type = "Opaque"

  data = {
    "authorization.conf" = file(var.nats_authorization_file != null ? pathexpand(var.nats_authorization_file) : "${local.master}/nats-authorization.conf")
  }
}

# One per consumer, holding only its own part; nothing else in the namespace mounts it. Keys are flat (a Secret's
# keys cannot hold '/'); the pods' secret volumes put them back at their paths (local.bundle_items).
resource "kubernetes_secret_v1" "credentials" {
  for_each = local.bundles

  metadata {
    name      = "keel-credentials-${each.key}"
    namespace = kubernetes_namespace_v1.keel.metadata[0].name
    labels    = local.common_labels
  }

  type = "Opaque"

  data = merge(
    {
      "nats-identity" = file("${local.master}/nats/${each.value.nats}.json")
      "nats-ca"       = file("${local.master}/nats/shard-ca/tls/ca.pem")
      "keyring"       = file("${local.master}/signing/keyring.json")
    },
    { for name in(each.value.signing == null ? [] : [each.value.signing]) : "signing-key" => file("${local.master}/signing/${name}.key") },
  )
}

# -- NATS JetStream ----------------------------------------------------------------------------------

resource "helm_release" "nats" {
  name       = var.nats_release_name
  namespace  = kubernetes_namespace_v1.keel.metadata[0].name
  repository = "https://nats-io.github.io/k8s/helm/charts/"
  chart      = "nats"
  version    = var.nats_chart_version

  wait    = true
  atomic  = true
  timeout = 600

  values = [yamlencode({
    global = {
      labels = local.common_labels
    }
    container = {
      image = {
        repository = "nats"
        tag        = var.nats_image_tag
      }
      # Keel's authorization, from its Secret; config.merge below includes it. Under /etc/, so the chart's
      # config reloader watches it too: a changed Secret (a new identity) reloads the servers.
      patch = [{
        op    = "add"
        path  = "/volumeMounts/-"
        value = { name = "keel-authorization", mountPath = "/etc/keel-nats-auth", readOnly = true }
      }]
    }
    # The CA that signed the server's certificate: each tls block's ca_file (routes verify each other with it).
    tlsCA = {
      enabled    = true
      secretName = kubernetes_secret_v1.nats_tls.metadata[0].name
      key        = "ca.crt"
    }
    config = {
      # Clients over TLS only: a client that does not start TLS is refused.
      nats = {
        tls = {
          enabled    = true
          secretName = kubernetes_secret_v1.nats_tls.metadata[0].name
          cert       = "tls.crt"
          key        = "tls.key"
        }
      }
      cluster = {
        enabled  = var.nats_replicas > 1
        replicas = var.nats_replicas
        # Routes between the servers over TLS too (the server forces mutual verification on routes): the same
        # certificate, which names *.<release>-headless (README).
        tls = {
          enabled    = true
          secretName = kubernetes_secret_v1.nats_tls.metadata[0].name
          cert       = "tls.crt"
          key        = "tls.key"
        }
      }
      jetstream = {
        enabled = true
        fileStore = {
          enabled = true
          dir     = "/data"
          pvc = {
            enabled          = true
            size             = var.nats_storage_size
            storageClassName = var.nats_storage_class
          }
        }
        memoryStore = {
          enabled = false
        }
        # fsync before every ack; see var.nats_sync_always and the README.
        merge = { for k, v in { sync_interval = "always" } : k => v if var.nats_sync_always }
      }
      merge = {
        # 1 MiB, the NATS default, stated because Keel depends on it: the stream's max_msg_size is
        # 1 MiB so an oversized event reaches the recorder and is dead-lettered with a reason.
        max_payload = 1048576
        # Only Keel's identities connect, each with its own permissions: `include` of the authorization Secret
        # (the chart turns a key ending in $include into an include, relative to /etc/nats-config).
        "00$include" = "../keel-nats-auth/authorization.conf"
      }
    }
    # One server per Kubernetes node: three replicas on one node would make R3 a formality.
    podTemplate = {
      topologySpreadConstraints = {
        "kubernetes.io/hostname" = {
          maxSkew           = 1
          whenUnsatisfiable = "DoNotSchedule"
        }
      }
      patch = [{
        op   = "add"
        path = "/spec/volumes/-"
        value = {
          name   = "keel-authorization"
          secret = { secretName = kubernetes_secret_v1.nats_authorization.metadata[0].name, defaultMode = 256 } # 0400
        }
      }]
    }
    # nats-box would be one more client without an identity; the CLI (`keel ...`) is the way in.
    natsBox = {
      enabled = false
    }
  })]
}

# -- settings ----------------------------------------------------------------------------------------

resource "kubernetes_config_map_v1" "settings" {
  metadata {
    name      = "keel-settings"
    namespace = kubernetes_namespace_v1.keel.metadata[0].name
    labels    = local.common_labels
  }

  data = local.keel_settings
}

# -- database roles (keel.infra.dbroles) -----------------------------------------------------------------
#
# var.database_url is keel_migrate's (the tables' owner, the only role with DDL): only the migrate Job gets it.
# The recorder and the deciders connect as their own least-privilege roles, with passwords generated here; the
# auditor's (read-only, for people running the CLI) too. Create the roles once with the SQL of the
# `database_roles_sql` output (README: "Database roles"); `keel-migrate` then grants them their privileges.

resource "random_password" "database" {
  for_each = toset(["recorder", "decider", "auditor"])

  length  = 40
  special = false # goes into a URL unescaped
}

locals {
  # database_url with its user and password replaced by the role's.
  database_role_urls = merge(
    { migrate = var.database_url },
    {
      for role, password in random_password.database :
      role => replace(var.database_url, "/^(postgres(ql)?://)[^@/]*@/", "$${1}keel_${role}:${password.result}@")
    },
  )
}

resource "kubernetes_secret_v1" "database" {
  for_each = toset(["migrate", "recorder", "decider"])

  metadata {
    name      = "keel-database-${each.key}"
    namespace = kubernetes_namespace_v1.keel.metadata[0].name
    labels    = local.common_labels
  }

  type = "Opaque"

  data = {
    KEEL_DATABASE_URL = local.database_role_urls[each.key]
  }
}

# -- migrate Job -------------------------------------------------------------------------------------

# `keel migrate` against the managed PostgreSQL (as keel_migrate), before the services start. The services
# do not migrate (they have no DDL rights; on an older schema they stop with "run `keel migrate`"); a failing
# migration fails `terraform apply`. Kubernetes does not allow changing a Job's pod template, so a new image makes
# Terraform replace the Job, and the migration runs again.
resource "kubernetes_job_v1" "migrate" {
  metadata {
    name      = "keel-migrate"
    namespace = kubernetes_namespace_v1.keel.metadata[0].name
    labels    = merge(local.common_labels, { "app.kubernetes.io/name" = "keel-migrate" })
  }

  spec {
    backoff_limit = 4

    template {
      metadata {
        labels = merge(local.common_labels, { "app.kubernetes.io/name" = "keel-migrate" })
      }

      spec {
        restart_policy                  = "Never"
        automount_service_account_token = false
        enable_service_links            = false
        node_selector                   = var.node_selector

        dynamic "image_pull_secrets" {
          for_each = var.image_pull_secrets
          content {
            name = image_pull_secrets.value
          }
        }

        security_context {
          run_as_non_root = true
          run_as_user     = local.run_as_user
          run_as_group    = local.run_as_group
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        # Keel reads a secret only from a private file of its own user (0600 in 0700 folders,
        # keel.infra.secrets); a Secret volume's files belong to root. This copies the Secret into a private
        # folder of uid 10001 (memory-backed) that the container uses as KEEL_CREDENTIALS_DIR.
        init_container {
          name              = "credentials"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          command           = ["keel-credentials", "install", "--from", local.credentials_source, "--to", local.credentials_dir]

          resources {
            requests = { cpu = "10m", memory = "64Mi" }
            limits   = { memory = "128Mi" }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "credentials-source"
            mount_path = local.credentials_source
            read_only  = true
          }
          volume_mount {
            name       = "credentials"
            mount_path = local.credentials_run_dir
          }
        }

        container {
          name              = "migrate"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          command           = ["keel-migrate"]

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }
          env_from {
            secret_ref {
              name = kubernetes_secret_v1.database["migrate"].metadata[0].name
            }
          }

          resources {
            requests = { cpu = "100m", memory = "256Mi" }
            limits   = { memory = "512Mi" }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
          volume_mount {
            name       = "credentials"
            mount_path = local.credentials_run_dir
          }
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
        # This consumer's credentials Secret, laid out as a credentials folder (keel.infra.provision.bundle_files),
        # readable by the pod's group (gid 0) for the init container's copy.
        volume {
          name = "credentials-source"
          secret {
            secret_name  = kubernetes_secret_v1.credentials["migrate"].metadata[0].name
            default_mode = "0440"
            dynamic "items" {
              for_each = local.bundle_items["migrate"]
              content {
                key  = items.value.key
                path = items.value.path
              }
            }
          }
        }
        volume {
          name = "credentials"
          empty_dir {
            medium     = "Memory"
            size_limit = "1Mi"
          }
        }
      }
    }
  }

  wait_for_completion = true

  timeouts {
    create = "10m"
    update = "10m"
  }

  # keel-migrate also brings the streams to these settings, as NATS's admin identity.
  depends_on = [helm_release.nats]
}

# -- recorder and controller -------------------------------------------------------------------------

resource "kubernetes_deployment_v1" "service" {
  for_each = local.services

  metadata {
    name      = "keel-${each.key}"
    namespace = kubernetes_namespace_v1.keel.metadata[0].name
    labels    = merge(local.common_labels, { "app.kubernetes.io/name" = "keel-${each.key}" })
  }

  spec {
    # Exactly one: see local.services. Do not scale, and do not switch to RollingUpdate (it would run
    # the old and the new pod side by side for a moment).
    replicas               = 1
    revision_history_limit = 5

    strategy {
      type = "Recreate"
    }

    selector {
      match_labels = {
        "app.kubernetes.io/name" = "keel-${each.key}"
      }
    }

    template {
      metadata {
        labels = merge(local.common_labels, { "app.kubernetes.io/name" = "keel-${each.key}" })
        annotations = {
          # Roll the pod when a setting or the database Secret changes: env_from is read only at
          # container start ...
          "checksum/keel-settings"       = sha256(jsonencode(local.keel_settings))
          "keel/database-secret-version" = kubernetes_secret_v1.database[each.key == "recorder" ? "recorder" : "decider"].metadata[0].resource_version
          # ... or its credentials Secret (the init container copies it only at start).
          "keel/credentials-secret-version" = kubernetes_secret_v1.credentials[each.key].metadata[0].resource_version
        }
      }

      spec {
        automount_service_account_token  = false
        enable_service_links             = false
        termination_grace_period_seconds = 30
        node_selector                    = var.node_selector

        dynamic "image_pull_secrets" {
          for_each = var.image_pull_secrets
          content {
            name = image_pull_secrets.value
          }
        }

        security_context {
          run_as_non_root = true
          run_as_user     = local.run_as_user
          run_as_group    = local.run_as_group
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        # Keel reads a secret only from a private file of its own user (0600 in 0700 folders,
        # keel.infra.secrets); a Secret volume's files belong to root. This copies the Secret into a private
        # folder of uid 10001 (memory-backed) that the container uses as KEEL_CREDENTIALS_DIR.
        init_container {
          name              = "credentials"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          command           = ["keel-credentials", "install", "--from", local.credentials_source, "--to", local.credentials_dir]

          resources {
            requests = { cpu = "10m", memory = "64Mi" }
            limits   = { memory = "128Mi" }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "credentials-source"
            mount_path = local.credentials_source
            read_only  = true
          }
          volume_mount {
            name       = "credentials"
            mount_path = local.credentials_run_dir
          }
        }

        container {
          name              = each.key
          image             = var.image
          image_pull_policy = var.image_pull_policy
          command           = each.value.command

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }
          env_from {
            secret_ref {
              # Its own role's URL: the recorder appends, the deciders read and write snapshots.
              name = kubernetes_secret_v1.database[each.key == "recorder" ? "recorder" : "decider"].metadata[0].name
            }
          }

          resources {
            requests = each.value.resources.requests
            limits   = each.value.resources.limits
          }

          # No liveness or readiness probes yet: the services expose no HTTP endpoint today (health
          # and /metrics come with the api service). While NATS or PostgreSQL is away, the services
          # keep reconnecting and retrying rather than exiting.

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
          volume_mount {
            name       = "credentials"
            mount_path = local.credentials_run_dir
          }

          # The checkpoint broker writes the persistent tier's manifests beside the shards the nodes
          # write: the same shared filesystem, mounted at the persist root.
          dynamic "volume_mount" {
            for_each = each.key == "checkpoint-broker" && var.checkpoint_volume_claim != null ? [1] : []
            content {
              name       = "checkpoints"
              mount_path = "/var/lib/keel/checkpoints"
            }
          }
          dynamic "env" {
            for_each = each.key == "checkpoint-broker" && var.checkpoint_volume_claim != null ? [1] : []
            content {
              name  = "KEEL_CHECKPOINT__PERSIST_ROOT"
              value = "/var/lib/keel/checkpoints"
            }
          }
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
        # This consumer's credentials Secret, laid out as a credentials folder (keel.infra.provision.bundle_files),
        # readable by the pod's group (gid 0) for the init container's copy.
        volume {
          name = "credentials-source"
          secret {
            secret_name  = kubernetes_secret_v1.credentials[each.key].metadata[0].name
            default_mode = "0440"
            dynamic "items" {
              for_each = local.bundle_items[each.key]
              content {
                key  = items.value.key
                path = items.value.path
              }
            }
          }
        }
        volume {
          name = "credentials"
          empty_dir {
            medium     = "Memory"
            size_limit = "1Mi"
          }
        }
        dynamic "volume" {
          for_each = each.key == "checkpoint-broker" && var.checkpoint_volume_claim != null ? [1] : []
          content {
            name = "checkpoints"
            persistent_volume_claim {
              claim_name = var.checkpoint_volume_claim
            }
          }
        }
      }
    }
  }

  wait_for_rollout = true

  depends_on = [
    helm_release.nats,
    kubernetes_job_v1.migrate,
  ]
}

# The node agent DaemonSet (one agent per training node: launcher, health probes, stack capture,
# checkpoint shard store) is not defined here. It arrives with the node agent; until then there is
# nothing to run on the training nodes.
