output "namespace" {
  description = "Namespace of the Keel control plane."
  value       = var.namespace
}

output "nats_url" {
  description = "In-cluster NATS URL the services use (KEEL_NATS_URL)."
  value       = module.manifests.nats_url
}

output "objects" {
  description = "Every Kubernetes object this configuration applies, as \"Kind/name\"."
  value = sort(concat(
    ["Namespace/${var.namespace}"],
    tolist(module.manifests.secret_keys),
    keys(module.manifests.base),
    keys(module.manifests.migrate),
    keys(module.manifests.workloads),
  ))
}

output "database_roles_sql" {
  description = "SQL that creates the recorder's, deciders' and auditor's login roles with their generated passwords; run it once as an administrator of the managed PostgreSQL (README: Database roles). Re-run after a password rotation (ALTER ROLE lines)."
  sensitive   = true
  value = join("\n", flatten([
    for role, password in random_password.database : [
      "SELECT 'CREATE ROLE keel_${role}' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'keel_${role}')\\gexec",
      "ALTER ROLE keel_${role} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '${password.result}';",
    ]
  ]))
}

output "database_auditor_url" {
  description = "The read-only role's URL, for people running `keel incidents` and the like against this database."
  sensitive   = true
  value       = module.manifests.database_role_urls["auditor"]
}

output "image" {
  description = "The control-plane image."
  value       = var.image
}
