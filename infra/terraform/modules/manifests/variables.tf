# Inputs of the manifests module: what the root module passes through from its own variables (see
# ../../variables.tf for the descriptions a user reads), plus the generated database passwords.

variable "namespace" {
  type = string
}

variable "labels" {
  type = map(string)
}

variable "cluster_domain" {
  type = string
}

variable "images" {
  description = "control_plane (the repository's Dockerfile), agent (infra/images/agent.Dockerfile), nats: each pinned by digest."
  type = object({
    control_plane = string
    agent         = string
    nats          = string
  })

  validation {
    condition     = alltrue([for image in values(var.images) : can(regex("@sha256:[0-9a-f]{64}$", image))])
    error_message = "every image must be pinned by digest (registry/name@sha256:<64 hex>, or name:tag@sha256:...): a tag can move under a running job."
  }
}

variable "image_pull_policy" {
  type = string
}

variable "image_pull_secrets" {
  type = list(string)
}

variable "node_selector" {
  type = map(string)
}

variable "db_schema" {
  type = string
}

variable "database_url" {
  description = "keel_migrate's URL; sensitive."
  type        = string
}

variable "database_passwords" {
  description = "Generated passwords of keel_recorder, keel_decider and keel_auditor; sensitive."
  type        = map(string)
}

variable "database_cidrs" {
  type = list(string)
}

variable "database_port" {
  type = number
}

variable "kube_api_cidrs" {
  type = list(string)
}

variable "bus_max_age" {
  type = string
}

variable "bus_max_bytes" {
  type = string
}

variable "controller_observe_only" {
  type = bool
}

variable "extra_settings" {
  type = map(string)
}

variable "recorder_resources" {
  type = object({ requests = map(string), limits = map(string) })
}

variable "controller_resources" {
  type = object({ requests = map(string), limits = map(string) })
}

variable "checkpoint_volume_claim" {
  type = string
}

variable "nats_name" {
  type = string
}

variable "nats_replicas" {
  type = number
}

variable "nats_storage_class" {
  type = string
}

variable "nats_storage_size" {
  type = string
}

variable "nats_sync_always" {
  type = bool
}

variable "nats_resources" {
  type = object({ requests = map(string), limits = map(string) })
}

variable "nats_client_cidrs" {
  type = list(string)
}

variable "credentials_dir" {
  type = string
}

variable "nats_authorization_file" {
  type = string
}

variable "agent_bundles_dir" {
  type = string
}

variable "job" {
  description = "The training job whose node agents and standbys this deploys; null: the control plane only."
  type = object({
    id                 = string
    nodes              = list(string)
    node_selector      = map(string)
    standby_selector   = map(string)
    standby_nodes      = list(string)
    nproc_per_node     = number
    gpus_per_node      = number
    command            = list(string)
    rdzv_endpoint      = string
    store_port         = number
    shm_size           = string
    runtime_class_name = string
    run_as_root        = bool
    resources          = object({ requests = map(string), limits = map(string) })
    tolerations = list(object({
      key      = string
      operator = string
      value    = string
      effect   = string
    }))
  })
}

variable "api_tokens" {
  type = list(object({ name = string, scope = string, sha256 = string, identity = optional(string) }))
}

variable "api_chatops" {
  description = "Chat-ops settings of the API (see ../../variables.tf); the secret files are paths on the machine applying."
  type = object({
    slack_signing_secret_file = optional(string)
    slack_approvers           = optional(map(string), {})
    callbacks = optional(list(object({
      name        = string
      secret_file = string
      approvers   = optional(list(string), [])
    })), [])
    timestamp_tolerance = optional(string)
  })
  default = null
}

variable "api_replicas" {
  type = number
}

variable "api_resources" {
  type = object({ requests = map(string), limits = map(string) })
}

variable "api_client_cidrs" {
  type = list(string)
}
