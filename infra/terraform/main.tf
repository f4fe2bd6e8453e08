# Keel's control plane on Kubernetes, as it exists today:
#
#   namespace
#   NATS JetStream cluster (official nats Helm chart: file storage on PVCs, var.nats_replicas servers)
#   ConfigMap (KEEL_* settings) + one Secret per database role (KEEL_DATABASE_URL of that role on the
#   managed PostgreSQL; the recorder's and deciders' passwords generated here: random_password)
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

  nats_url = "nats://${var.nats_release_name}.${var.namespace}.svc.${var.cluster_domain}:4222"

  # Every KEEL_* setting except the database URL, which lives in the Secret. Values are strings; the
  # services validate them at start (durations and sizes need units) and exit on a bad one.
  keel_settings = merge(
    {
      KEEL_NATS_URL                 = local.nats_url
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
}

# -- namespace ---------------------------------------------------------------------------------------

resource "kubernetes_namespace_v1" "keel" {
  metadata {
    name   = var.namespace
    labels = local.common_labels
  }
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
    }
    config = {
      cluster = {
        enabled  = var.nats_replicas > 1
        replicas = var.nats_replicas
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
      # 1 MiB, the NATS default, stated because Keel depends on it: the stream's max_msg_size is
      # 1 MiB so an oversized event reaches the recorder and is dead-lettered with a reason.
      merge = {
        max_payload = 1048576
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
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }

  wait_for_completion = true

  timeouts {
    create = "10m"
    update = "10m"
  }
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
          # container start.
          "checksum/keel-settings"       = sha256(jsonencode(local.keel_settings))
          "keel/database-secret-version" = kubernetes_secret_v1.database[each.key == "recorder" ? "recorder" : "decider"].metadata[0].resource_version
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
