terraform {
  required_version = ">= 1.5.0"

  required_providers {
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.31"
    }
    # Pinned below 3.0: the `kubernetes { ... }` block in the helm provider below is the 2.x syntax.
    helm = {
      source  = "hashicorp/helm"
      version = "~> 2.14"
    }
    # The database roles' generated passwords (main.tf: random_password.database).
    random = {
      source  = "hashicorp/random"
      version = "~> 3.6"
    }
  }
}

# Both providers talk to the same cluster through a kubeconfig. For a managed cluster you may prefer
# `host` / `cluster_ca_certificate` / `exec` credentials instead; only these blocks change.
provider "kubernetes" {
  config_path    = var.kubeconfig_path
  config_context = var.kube_context
}

provider "helm" {
  kubernetes {
    config_path    = var.kubeconfig_path
    config_context = var.kube_context
  }
}
