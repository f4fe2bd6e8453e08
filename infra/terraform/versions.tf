terraform {
  required_version = ">= 1.9.0" # validations that read another variable

  required_providers {
    # kubernetes_manifest (server-side apply of the manifests module's objects) needs 2.x.
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.31"
    }
    # The database roles' generated passwords (main.tf: random_password.database).
    random = {
      source  = "hashicorp/random"
      version = "~> 3.6"
    }
  }
}

# The cluster through a kubeconfig. For a managed cluster you may prefer `host` / `cluster_ca_certificate` /
# `exec` credentials instead; only this block changes. kubernetes_manifest reads the API's schema at plan
# time, so `terraform plan` needs the cluster reachable.
provider "kubernetes" {
  config_path    = var.kubeconfig_path
  config_context = var.kube_context
}
