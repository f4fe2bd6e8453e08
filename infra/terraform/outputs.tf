output "namespace" {
  description = "Namespace of the Keel control plane."
  value       = kubernetes_namespace_v1.keel.metadata[0].name
}

output "nats_url" {
  description = "In-cluster NATS URL the services use (KEEL_NATS_URL)."
  value       = local.nats_url
}

output "nats_release" {
  description = "The NATS Helm release: chart version and status."
  value = {
    name    = helm_release.nats.name
    chart   = helm_release.nats.chart
    version = helm_release.nats.version
    status  = helm_release.nats.status
  }
}

output "deployments" {
  description = "Deployment name of each Keel service."
  value       = { for name, deployment in kubernetes_deployment_v1.service : name => deployment.metadata[0].name }
}

output "migrate_job" {
  description = "Name of the Job that ran `keel migrate`."
  value       = kubernetes_job_v1.migrate.metadata[0].name
}

output "settings_config_map" {
  description = "ConfigMap holding the KEEL_* settings (everything but the database URL)."
  value       = kubernetes_config_map_v1.settings.metadata[0].name
}

output "database_secrets" {
  description = "The Secret holding each role's KEEL_DATABASE_URL (migrate: the Job; recorder; decider: the other services)."
  value       = { for role, secret in kubernetes_secret_v1.database : role => secret.metadata[0].name }
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
  value       = local.database_role_urls["auditor"]
}

output "image" {
  description = "The Keel image the control plane runs."
  value       = var.image
}
