//! The two providers behind one call: pick by platform, build the payload, send, classify.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use orca_push_proto::registry::v1 as registry_pb;

use crate::apns::{ApnsPool, DEFAULT_STREAMS_PER_CONNECTION, ProviderToken};
use crate::fcm::{Fcm, TokenSource};
use crate::lane::Counters;
use crate::payload::{Job, apns_request, fcm_message};
use crate::verdict::Verdict;

pub const APNS_PRODUCTION: &str = "https://api.push.apple.com";
pub const APNS_SANDBOX: &str = "https://api.sandbox.push.apple.com";
pub const FCM_BASE: &str = "https://fcm.googleapis.com";

/// APNs token-auth credentials. Debug never shows the key.
#[derive(Clone, Debug)]
pub struct ApnsCredentials {
    pub key_pem: secrecy::SecretString,
    pub key_id: String,
    pub team_id: String,
}

/// Everything the sender needs to reach the providers.
#[derive(Debug, Clone)]
pub struct ProviderConfig {
    pub apns: Option<ApnsCredentials>,
    pub apns_topic: String,
    /// Replaces both APNs hosts; `http://` means HTTP/2 cleartext with prior knowledge.
    pub apns_url: Option<String>,
    pub fcm_project_id: String,
    pub fcm_url: Option<String>,
    pub fcm_token_source: TokenSource,
    pub ca_file: Option<PathBuf>,
    /// Streams per APNs connection before another connection is opened.
    pub apns_streams_per_connection: usize,
}

impl ProviderConfig {
    pub fn new(fcm_token_source: TokenSource) -> Self {
        Self {
            apns: None,
            apns_topic: "com.stably.orca.mobile".into(),
            apns_url: None,
            fcm_project_id: "onorca-cloud".into(),
            fcm_url: None,
            fcm_token_source,
            ca_file: None,
            apns_streams_per_connection: DEFAULT_STREAMS_PER_CONNECTION,
        }
    }
}

struct Apns {
    token: ProviderToken,
    production: ApnsPool,
    sandbox: ApnsPool,
    topic: String,
}

pub struct Providers {
    apns: Option<Apns>,
    fcm: Option<Arc<Fcm>>,
}

/// Where one delivery goes, as the registry knows it now.
#[derive(Debug, Clone)]
pub struct Target {
    pub platform: i32,
    pub token: String,
    pub apns_environment: i32,
}

impl Target {
    pub fn from_device(device: registry_pb::DeliveryDevice) -> Self {
        Self {
            platform: device.platform,
            token: device.token,
            apns_environment: device.apns_environment,
        }
    }

    /// The provider's name for metrics.
    pub fn provider(&self) -> &'static str {
        if self.platform == registry_pb::Platform::Ios as i32 {
            "apns"
        } else {
            "fcm"
        }
    }

    /// Marks dead exactly what was sent: a token replaced meanwhile stays alive.
    pub fn mark_dead_request(&self, registration_id: &str) -> registry_pb::MarkDeadRequest {
        registry_pb::MarkDeadRequest {
            registration_id: registration_id.to_owned(),
            token: self.token.clone(),
            platform: self.platform,
            apns_environment: self.apns_environment,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Apns(#[from] crate::apns::ApnsError),
    #[error(transparent)]
    Fcm(#[from] crate::fcm::FcmError),
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Providers {
    pub async fn new(config: &ProviderConfig) -> Result<Self, ProviderError> {
        let roots = crate::tls::root_store(config.ca_file.as_deref())?;
        let tls = crate::tls::h2_client_config(roots)?;
        let apns = match &config.apns {
            None => {
                tracing::warn!("APNs is not configured: iOS deliveries will fail as such");
                None
            }
            Some(creds) => {
                let (production, sandbox) = match &config.apns_url {
                    Some(url) => (url.as_str(), url.as_str()),
                    None => (APNS_PRODUCTION, APNS_SANDBOX),
                };
                Some(Apns {
                    token: ProviderToken::new(
                        secrecy::ExposeSecret::expose_secret(&creds.key_pem),
                        &creds.key_id,
                        &creds.team_id,
                    )?,
                    production: ApnsPool::new(
                        production,
                        tls.clone(),
                        config.apns_streams_per_connection,
                    )?,
                    sandbox: ApnsPool::new(
                        sandbox,
                        tls.clone(),
                        config.apns_streams_per_connection,
                    )?,
                    topic: config.apns_topic.clone(),
                })
            }
        };
        let fcm_base = config.fcm_url.as_deref().unwrap_or(FCM_BASE);
        let fcm = match Fcm::new(
            fcm_base,
            &config.fcm_project_id,
            &config.fcm_token_source,
            &tls,
        )
        .await
        {
            Ok(fcm) => Some(Arc::new(fcm)),
            // A credentials file that was given but cannot be used is a misconfiguration.
            Err(error @ crate::fcm::FcmError::Credentials(_)) => return Err(error.into()),
            Err(error) => {
                tracing::warn!(%error, "FCM is not configured: Android deliveries will fail as such");
                None
            }
        };
        Ok(Self { apns, fcm })
    }

    pub async fn send(&self, job: &Job, target: &Target, now: i64, counters: &Counters) -> Verdict {
        use tracing::Instrument as _;
        let provider = target.provider();
        let span = tracing::info_span!(
            "provider",
            otel.name = if provider == "apns" {
                "POST apns"
            } else {
                "POST fcm"
            },
            otel.kind = "client",
            orca.provider = provider,
            http.response.status_code = tracing::field::Empty,
            orca.verdict = tracing::field::Empty,
            orca.reason = tracing::field::Empty,
        );
        let verdict = self
            .send_in_span(job, target, now, counters)
            .instrument(span.clone())
            .await;
        let (kind, reason) = match &verdict {
            Verdict::Sent => ("sent", ""),
            Verdict::Dead(r) => ("dead", r.as_str()),
            Verdict::Retry { reason, .. } => ("retry", reason.as_str()),
            Verdict::Failed(r) => ("failed", r.as_str()),
        };
        span.record("orca.verdict", kind);
        if !reason.is_empty() {
            span.record("orca.reason", reason);
        }
        verdict
    }

    async fn send_in_span(
        &self,
        job: &Job,
        target: &Target,
        now: i64,
        counters: &Counters,
    ) -> Verdict {
        if target.platform == registry_pb::Platform::Ios as i32 {
            self.send_apns(job, target, counters).await
        } else {
            let Some(fcm) = &self.fcm else {
                counters.not_configured.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("orca_push_provider_not_configured_total", "provider" => "fcm")
                    .increment(1);
                tracing::error!("FCM delivery failed: FCM is not configured");
                return Verdict::Failed("fcm_not_configured".into());
            };
            fcm.send(fcm_message(job, &target.token, now), false).await
        }
    }

    /// Registers every delivery family at zero, so a scrape shows them before the first event.
    pub fn register_metrics() {
        for provider in ["apns", "fcm"] {
            metrics::counter!("orca_push_delivery_retries_total", "provider" => provider)
                .increment(0);
            metrics::counter!("orca_push_dead_tokens_total", "provider" => provider).increment(0);
            metrics::counter!("orca_push_provider_not_configured_total", "provider" => provider)
                .increment(0);
            metrics::counter!("orca_push_deliveries_total", "provider" => provider, "outcome" => "sent").increment(0);
            metrics::counter!("orca_push_provider_token_failures_total", "provider" => provider)
                .increment(0);
        }
    }

    async fn send_apns(&self, job: &Job, target: &Target, counters: &Counters) -> Verdict {
        let Some(apns) = &self.apns else {
            counters.not_configured.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("orca_push_provider_not_configured_total", "provider" => "apns")
                .increment(1);
            tracing::error!("APNs delivery failed: APNs is not configured");
            return Verdict::Failed("apns_not_configured".into());
        };
        let pool = if target.apns_environment == registry_pb::ApnsEnvironment::Sandbox as i32 {
            &apns.sandbox
        } else {
            &apns.production
        };
        let request = apns_request(job, &target.token, &apns.topic);
        let bearer = match apns.token.bearer() {
            Ok(b) => b,
            Err(error) => {
                // Counted in `orca_push_provider_token_failures_total` where it failed.
                tracing::error!(%error, "APNs provider token");
                return Verdict::Failed("apns_provider_token".into());
            }
        };
        let started = std::time::Instant::now();
        let answer = pool.send(&request, &bearer.token).await;
        record_latency("apns", started);
        match answer {
            Ok((status, headers, body)) => {
                tracing::Span::current().record("http.response.status_code", status);
                let verdict = crate::apns::classify(status, &headers, &body);
                if matches!(&verdict, Verdict::Retry { reason, .. } if reason == "ExpiredProviderToken")
                {
                    // Once per token generation, however many requests saw the refusal.
                    if let Err(error) = apns.token.refresh_after(bearer.generation) {
                        tracing::error!(%error, "APNs provider token");
                    }
                }
                verdict
            }
            Err(error) => {
                tracing::warn!(%error, "APNs request failed");
                Verdict::unanswered(match error {
                    crate::apns::TransportError::Timeout => "timeout",
                    _ => "connection",
                })
            }
        }
    }

    /// Deployment check: FCM `validate_only` send to a syntactically valid token.
    pub async fn probe_fcm(&self, token: &str) -> Option<Verdict> {
        let fcm = self.fcm.as_ref()?;
        let job = probe_job();
        Some(fcm.send(fcm_message(&job, token, now_ms()), true).await)
    }

    pub async fn close(&self) {
        if let Some(apns) = &self.apns {
            apns.production.close().await;
            apns.sandbox.close().await;
        }
    }

    /// Open APNs connections (production + sandbox), for tests.
    pub async fn apns_connections(&self) -> usize {
        match &self.apns {
            Some(a) => a.production.connection_count().await + a.sandbox.connection_count().await,
            None => 0,
        }
    }
}

fn probe_job() -> Job {
    Job {
        batch_id: "probe".into(),
        lease_token: String::new(),
        registration_id: "probe".into(),
        host_fingerprint: "probe".into(),
        dismiss: false,
        attempt: 1,
        retries: 0,
        deadline_ms: now_ms() + 60_000,
        collapse_id: "probe".into(),
        silent: true,
        content: orca_push_proto::queue::v1::DeliveryContent {
            title: "orca-push probe".into(),
            body: String::new(),
            source: "plugin".into(),
            coalesced_count: 1,
            ..Default::default()
        },
        member_traceparents: Vec::new(),
    }
}

/// A provider request's time, from sending it to its answer (or its failure): nothing is recorded
/// for an attempt that never made one (a provider not configured, no provider or OAuth token).
pub(crate) fn record_latency(provider: &'static str, started: std::time::Instant) {
    metrics::histogram!("orca_push_provider_request_duration_seconds", "provider" => provider)
        .record(started.elapsed().as_secs_f64());
}
