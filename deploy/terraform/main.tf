# orca-cloud-push on Cloud Run: the all-in-one gateway (`orca-push serve`), every instance
# stateless, all state in its own database on the dedicated HA Cloud SQL PostgreSQL instance.

terraform {
  required_version = ">= 1.5"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.0"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.6"
    }
  }
}

provider "google" {
  project = var.project
  region  = var.region
}

# The runtime service account exists in production: declared here and imported.
resource "google_service_account" "push" {
  account_id   = "orca-cloud-push"
  display_name = "orca-cloud-push runtime"
}

import {
  to = google_service_account.push
  id = "projects/${var.project}/serviceAccounts/orca-cloud-push@${var.project}.iam.gserviceaccount.com"
}

# FCM admin and Service Usage consumer (exist in production; imported like the account).
resource "google_project_iam_member" "push_roles" {
  for_each = toset(["roles/firebasecloudmessaging.admin", "roles/serviceusage.serviceUsageConsumer", "roles/cloudsql.client"])
  project  = var.project
  role     = each.value
  member   = "serviceAccount:${google_service_account.push.email}"
}

# The three APNs secrets exist in Secret Manager: declared, imported, readable by the runtime.
locals {
  secrets = {
    ORCA_PUSH_APNS_KEY      = "orca-cloud-push-apns-key"
    ORCA_PUSH_APNS_KEY_ID   = "orca-cloud-push-apns-key-id"
    ORCA_PUSH_APPLE_TEAM_ID = "orca-cloud-push-apple-team-id"
  }
}

resource "google_secret_manager_secret" "push" {
  for_each  = local.secrets
  secret_id = each.value
  replication {
    auto {}
  }
}

import {
  for_each = local.secrets
  to       = google_secret_manager_secret.push[each.key]
  id       = "projects/${var.project}/secrets/${each.value}"
}

resource "google_secret_manager_secret_iam_member" "push" {
  for_each  = local.secrets
  secret_id = google_secret_manager_secret.push[each.key].id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.push.email}"
}

# The database URL (with the generated password) and the internal token key, as secrets too.
resource "random_password" "db" {
  length  = 32
  special = false
}

resource "random_password" "internal_key" {
  length  = 48
  special = false
}

resource "google_sql_database_instance" "push" {
  name             = "orca-cloud-push"
  database_version = "POSTGRES_16"
  region           = var.region
  settings {
    tier              = var.db_tier
    availability_type = "REGIONAL" # HA
    backup_configuration {
      enabled                        = true
      point_in_time_recovery_enabled = true
    }
    ip_configuration {
      ipv4_enabled = true
    }
  }
  deletion_protection = true
}

resource "google_sql_database" "push" {
  name     = "orca_push"
  instance = google_sql_database_instance.push.name
}

resource "google_sql_user" "push" {
  name     = "orca_push"
  instance = google_sql_database_instance.push.name
  password = random_password.db.result
}

resource "google_secret_manager_secret" "runtime" {
  for_each  = toset(["orca-cloud-push-database-url", "orca-cloud-push-internal-key"])
  secret_id = each.value
  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "database_url" {
  secret      = google_secret_manager_secret.runtime["orca-cloud-push-database-url"].id
  secret_data = "postgres://orca_push:${random_password.db.result}@localhost/orca_push?host=/cloudsql/${google_sql_database_instance.push.connection_name}"
}

resource "google_secret_manager_secret_version" "internal_key" {
  secret      = google_secret_manager_secret.runtime["orca-cloud-push-internal-key"].id
  secret_data = random_password.internal_key.result
}

resource "google_secret_manager_secret_iam_member" "runtime" {
  for_each  = google_secret_manager_secret.runtime
  secret_id = each.value.id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.push.email}"
}

resource "google_cloud_run_v2_service" "push" {
  name     = "orca-cloud-push"
  location = var.region
  ingress  = "INGRESS_TRAFFIC_ALL"

  template {
    service_account                  = google_service_account.push.email
    max_instance_request_concurrency = 80
    timeout                          = "30s"
    scaling {
      min_instance_count = var.min_instances
      max_instance_count = var.max_instances
    }
    volumes {
      name = "cloudsql"
      cloud_sql_instance {
        instances = [google_sql_database_instance.push.connection_name]
      }
    }
    containers {
      image = var.image
      args  = ["serve"]
      ports {
        container_port = 8080
      }
      env {
        name  = "ORCA_PUSH_PUBLIC_URL"
        value = "https://${var.hostname}"
      }
      env {
        name  = "ORCA_PUSH_TRUSTED_PROXY_HOPS"
        value = "0"
      }
      env {
        name  = "ORCA_PUSH_FCM_PROJECT_ID"
        value = var.project
      }
      dynamic "env" {
        for_each = local.secrets
        content {
          name = env.key
          value_source {
            secret_key_ref {
              secret  = google_secret_manager_secret.push[env.key].secret_id
              version = "latest"
            }
          }
        }
      }
      env {
        name = "ORCA_PUSH_DATABASE_URL"
        value_source {
          secret_key_ref {
            secret  = google_secret_manager_secret.runtime["orca-cloud-push-database-url"].secret_id
            version = "latest"
          }
        }
      }
      env {
        name = "ORCA_PUSH_INTERNAL_KEY"
        value_source {
          secret_key_ref {
            secret  = google_secret_manager_secret.runtime["orca-cloud-push-internal-key"].secret_id
            version = "latest"
          }
        }
      }
      volume_mounts {
        name       = "cloudsql"
        mount_path = "/cloudsql"
      }
      startup_probe {
        http_get {
          path = "/ready"
        }
        period_seconds    = 2
        failure_threshold = 30
      }
      liveness_probe {
        http_get {
          path = "/healthz"
        }
      }
      resources {
        limits = {
          cpu    = "1"
          memory = "512Mi"
        }
      }
    }
  }

  depends_on = [google_secret_manager_secret_iam_member.push, google_secret_manager_secret_iam_member.runtime]

  # The deploy workflow owns the running image (`gcloud run deploy --image`, then a traffic shift):
  # var.image is only the image the service is created with, and a later apply must not roll a
  # deploy back. gcloud also records itself as the service's client.
  lifecycle {
    ignore_changes = [
      template[0].containers[0].image,
      client,
      client_version,
    ]
  }
}

# Hosts call without Google credentials: the gateway authenticates them itself.
resource "google_cloud_run_v2_service_iam_member" "public" {
  name     = google_cloud_run_v2_service.push.name
  location = var.region
  role     = "roles/run.invoker"
  member   = "allUsers"
}

# TODO(stablyai/orca-cloud): the DNS zone lives in the apps root there. Add the record this
# mapping asks for: `push.onorca.dev. CNAME ghs.googlehosted.com.` (see the mapping's
# status.resource_records once applied).
resource "google_cloud_run_domain_mapping" "push" {
  name     = var.hostname
  location = var.region
  metadata {
    namespace = var.project
  }
  spec {
    route_name = google_cloud_run_v2_service.push.name
  }
}

# The deploy workflow runs these with the new image: the schema step (under the rollout lease)
# and the validate-only FCM probe. It sets their image itself, as it does the service's.
resource "google_cloud_run_v2_job" "task" {
  for_each = {
    "orca-cloud-push-migrate" = ["migrate"]
    "orca-cloud-push-probe"   = ["probe-fcm", "--token", "probe"]
  }
  name     = each.key
  location = var.region
  template {
    template {
      service_account = google_service_account.push.email
      max_retries     = 1
      volumes {
        name = "cloudsql"
        cloud_sql_instance {
          instances = [google_sql_database_instance.push.connection_name]
        }
      }
      containers {
        image = var.image
        args  = each.value
        env {
          name  = "ORCA_PUSH_FCM_PROJECT_ID"
          value = var.project
        }
        env {
          name = "ORCA_PUSH_DATABASE_URL"
          value_source {
            secret_key_ref {
              secret  = google_secret_manager_secret.runtime["orca-cloud-push-database-url"].secret_id
              version = "latest"
            }
          }
        }
        volume_mounts {
          name       = "cloudsql"
          mount_path = "/cloudsql"
        }
      }
    }
  }

  # The deploy workflow points both jobs at the image it built (`gcloud run jobs update --image`)
  # before running them; a later apply must not put the creation image back.
  lifecycle {
    ignore_changes = [
      template[0].template[0].containers[0].image,
      client,
      client_version,
    ]
  }
}
