# No provider: this module only computes manifests (Terraform's built-in functions read the credentials).
terraform {
  required_version = ">= 1.9.0" # validations that read another variable
}
