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

output "database_secret" {
  description = "Secret holding KEEL_DATABASE_URL."
  value       = kubernetes_secret_v1.database.metadata[0].name
}

output "image" {
  description = "The Keel image the control plane runs."
  value       = var.image
}
