# Every object of the deployment, computed by the manifests module from the variables (no provider: the tests
# run this file with the real `terraform` and validate every manifest against the Kubernetes API's schema).
# local.database_passwords is main.tf's (random_password.database).

module "manifests" {
  source = "./modules/manifests"

  namespace      = var.namespace
  labels         = var.labels
  cluster_domain = var.cluster_domain

  images = {
    control_plane = var.image
    agent         = var.agent_image
    nats          = var.nats_image
  }
  image_pull_policy  = var.image_pull_policy
  image_pull_secrets = var.image_pull_secrets
  node_selector      = var.node_selector

  db_schema          = var.db_schema
  database_url       = var.database_url
  database_passwords = local.database_passwords
  database_cidrs     = var.database_cidrs
  database_port      = var.database_port
  kube_api_cidrs     = var.kube_api_cidrs

  bus_max_age             = var.bus_max_age
  bus_max_bytes           = var.bus_max_bytes
  controller_observe_only = var.controller_observe_only
  extra_settings          = var.extra_settings
  recorder_resources      = var.recorder_resources
  controller_resources    = var.controller_resources
  checkpoint_volume_claim = var.checkpoint_volume_claim

  nats_name          = var.nats_name
  nats_replicas      = var.nats_replicas
  nats_storage_class = var.nats_storage_class
  nats_storage_size  = var.nats_storage_size
  nats_sync_always   = var.nats_sync_always
  nats_resources     = var.nats_resources
  nats_client_cidrs  = var.nats_client_cidrs

  credentials_dir         = var.credentials_dir
  nats_authorization_file = var.nats_authorization_file
  agent_bundles_dir       = coalesce(var.agent_bundles_dir, "${pathexpand(var.credentials_dir)}/agents")
  job                     = var.job

  api_tokens       = var.api_tokens
  api_chatops      = var.api_chatops
  api_replicas     = var.api_replicas
  api_resources    = var.api_resources
  api_client_cidrs = var.api_client_cidrs
}
