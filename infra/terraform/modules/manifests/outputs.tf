output "namespace" {
  description = "The Namespace object: applied first."
  value       = local.namespace_manifest
}

output "secrets" {
  description = "Every Secret, by \"Kind/name\" (sensitive: credentials and database URLs)."
  value       = local.secret_manifests
  sensitive   = true
}

output "secret_keys" {
  description = "The keys of `secrets`, which are no secret (for_each needs them known and not sensitive)."
  value       = nonsensitive(toset(keys(local.secret_manifests)))
}

output "base" {
  description = "Settings, NATS, RBAC and NetworkPolicies, by \"Kind/name\": applied before the migrate Job."
  value       = merge(local.settings_manifests, local.nats_manifests, local.rbac_manifests, local.network_manifests)
}

output "migrate" {
  description = "The migrate Job, by \"Kind/name\": the services start only after it completed."
  value       = local.migrate_manifests
}

output "workloads" {
  description = "The control-plane Deployments, the HTTP API and its Service, and the job's node agents and standbys, by \"Kind/name\"."
  value       = merge(local.service_manifests, local.api_manifests, local.agent_manifests)
}

output "nats_url" {
  description = "The in-cluster NATS URL every Keel container uses (KEEL_NATS_URL)."
  value       = local.nats_url
}

output "database_role_urls" {
  description = "Each database role's URL (sensitive)."
  value       = local.database_urls
  sensitive   = true
}
