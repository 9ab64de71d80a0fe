variable "project" {
  description = "GCP project (onorca-cloud in production), from the environment's tfvars."
  type        = string
}

variable "region" {
  type    = string
  default = "us-central1"
}

variable "image" {
  description = "The orca-push image the service and jobs are created with. Afterwards the deploy workflow sets their image (ignore_changes), so changing this does not redeploy."
  type        = string
}

variable "hostname" {
  type    = string
  default = "push.onorca.dev"
}

variable "min_instances" {
  type    = number
  default = 1
}

variable "max_instances" {
  description = "2 in production."
  type        = number
  default     = 2
}

variable "db_tier" {
  type    = string
  default = "db-custom-1-3840"
}
