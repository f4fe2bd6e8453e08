# Keel on Kubernetes: everything `keel up` runs, plus the node agents of a job. The objects themselves are
# computed by modules/manifests (manifests.tf); this file generates the database passwords and applies the
# objects in order with kubernetes_manifest (server-side apply):
#
#   1. the namespace, then every Secret (NATS TLS and authorization, each consumer's and each node agent's
#      credentials, the database URLs)
#   2. settings, NATS JetStream (StatefulSet of var.nats_replicas servers, waited for), the actuator's RBAC,
#      the NetworkPolicies
#   3. the migrate Job (`keel-migrate`), waited for: a failed migration fails the apply
#   4. one Deployment per control-plane service (recorder, controller, checkpoint-broker, analyzer,
#      hot-update, actuator, notifier; waited for), the job's node-agent DaemonSet and standby Deployment

# -- database roles (keel.infra.dbroles) -------------------------------------------------------------------
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
  database_passwords = { for role, password in random_password.database : role => password.result }
}

# -- 1. namespace and Secrets ------------------------------------------------------------------------------

resource "kubernetes_manifest" "namespace" {
  manifest = module.manifests.namespace
}

resource "kubernetes_manifest" "secret" {
  for_each = module.manifests.secret_keys

  manifest   = module.manifests.secrets[each.key]
  depends_on = [kubernetes_manifest.namespace]
}

# -- 2. settings, NATS, RBAC, NetworkPolicies --------------------------------------------------------------

resource "kubernetes_manifest" "base" {
  for_each = module.manifests.base

  manifest = each.value

  # NATS must serve before the migrate Job creates the streams.
  dynamic "wait" {
    for_each = each.value.kind == "StatefulSet" ? [1] : []
    content {
      rollout = true
    }
  }

  timeouts {
    create = "10m"
    update = "10m"
  }

  depends_on = [kubernetes_manifest.secret]
}

# -- 3. migrate Job ----------------------------------------------------------------------------------------

# `keel-migrate` against the managed PostgreSQL (as keel_migrate) before the services start. The services do
# not migrate (no DDL rights; on an older schema they stop with "run `keel migrate`"). A new image is a new
# Job (its name carries the image's digest), so the migration runs again.
resource "kubernetes_manifest" "migrate" {
  for_each = module.manifests.migrate

  manifest = each.value

  wait {
    condition {
      type   = "Complete"
      status = "True"
    }
  }

  timeouts {
    create = "10m"
  }

  depends_on = [kubernetes_manifest.base]
}

# -- 4. services, node agents, standbys --------------------------------------------------------------------

resource "kubernetes_manifest" "workload" {
  for_each = module.manifests.workloads

  manifest = each.value

  # The control plane is waited for (its readiness probe: consuming live). The node agents and standbys are
  # not: they start when the job's nodes are there, which may be long after this apply.
  dynamic "wait" {
    for_each = lookup(each.value.metadata.labels, "keel.dev/plane", "") == "control" ? [1] : []
    content {
      rollout = true
    }
  }

  timeouts {
    create = "15m"
    update = "15m"
  }

  depends_on = [kubernetes_manifest.migrate]
}
