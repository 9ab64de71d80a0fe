output "service_url" {
  value = google_cloud_run_v2_service.push.uri
}

output "dns_records" {
  description = "What the DNS zone in stablyai/orca-cloud must hold for the domain mapping."
  value       = google_cloud_run_domain_mapping.push.status
}
