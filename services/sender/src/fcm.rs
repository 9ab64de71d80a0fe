//! FCM HTTP v1: `projects/<id>/messages:send` with an OAuth bearer from a service-account JSON (its
//! `token_uri` honoured) or the GCE metadata server, via yup-oauth2, which caches the token until a
//! minute before it expires.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::Value;

use crate::verdict::{RetryClass, Verdict, parse_retry_after};

pub const SCOPE: &str = "https://www.googleapis.com/auth/firebase.messaging";
/// Google asks for at least a minute before retrying a quota refusal.
pub const QUOTA_MIN_DELAY: Duration = Duration::from_secs(60);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one OAuth token fetch (and the wait for another lane's fetch) may take.
pub const TOKEN_TIMEOUT: Duration = Duration::from_secs(10);
/// A cached token is replaced this long before Google says it expires.
const TOKEN_MARGIN: Duration = Duration::from_secs(60);

type Authenticator = yup_oauth2::authenticator::Authenticator<HttpsConnector<HttpConnector>>;

#[derive(Debug, thiserror::Error)]
pub enum FcmError {
    #[error("GOOGLE_APPLICATION_CREDENTIALS: {0}")]
    Credentials(String),
    #[error("FCM client: {0}")]
    Client(String),
}

/// Where the OAuth token comes from.
#[derive(Debug, Clone)]
pub enum TokenSource {
    ServiceAccountFile(std::path::PathBuf),
    /// The GCE metadata server at this host (`GCE_METADATA_HOST`, default metadata.google.internal).
    Metadata {
        host: String,
    },
}

pub struct Fcm {
    http: reqwest::Client,
    send_url: String,
    auth: Authenticator,
    refresh: AtomicBool,
    /// The current bearer, read without a lock on every send.
    cached: arc_swap::ArcSwapOption<CachedToken>,
    /// The token endpoint's own breaker: while it fails for everyone, a miss fails at once instead
    /// of asking it again, one probe per hold.
    token_endpoint: crate::breaker::Breaker,
    /// yup-oauth2 does not single-flight concurrent misses: one fetch at a time (only on a miss),
    /// the rest then find the token cached.
    fetching: tokio::sync::Mutex<()>,
}

struct CachedToken {
    bearer: String,
    /// Unix seconds after which it is fetched again.
    refresh_at: u64,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Fcm {
    /// `base` is `https://fcm.googleapis.com` unless redirected; `tls` carries the extra roots.
    pub async fn new(
        base: &str,
        project_id: &str,
        source: &TokenSource,
        tls: &rustls::ClientConfig,
    ) -> Result<Self, FcmError> {
        let mut api_tls = tls.clone();
        api_tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(api_tls)
            .timeout(REQUEST_TIMEOUT)
            // A 3xx is an answer to classify, as for APNs: followed, a 301 or 302 turns the send
            // into a GET, a redirect to another host drops the bearer, and whatever answered
            // there (a 200 included) would be taken for FCM's word.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| FcmError::Client(e.to_string()))?;
        // yup-oauth2 wants a hyper client; it must not pin ALPN itself.
        let mut token_tls = tls.clone();
        token_tls.alpn_protocols.clear();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(token_tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .build();
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(connector);
        let builder = yup_oauth2::CustomHyperClientBuilder::from(client);
        let auth = match source {
            TokenSource::ServiceAccountFile(path) => {
                let key = read_key(path).await?;
                yup_oauth2::ServiceAccountAuthenticator::with_client(key, builder)
                    .build()
                    .await
                    .map_err(|e| FcmError::Credentials(e.to_string()))?
            }
            TokenSource::Metadata { host } => {
                let opts = yup_oauth2::ApplicationDefaultCredentialsFlowOpts {
                    metadata_url: Some(format!(
                        "http://{host}/computeMetadata/v1/instance/service-accounts/default/token"
                    )),
                };
                match yup_oauth2::ApplicationDefaultCredentialsAuthenticator::with_client(opts, builder).await {
                    yup_oauth2::authenticator::ApplicationDefaultCredentialsTypes::InstanceMetadata(b) => b
                        .build()
                        .await
                        .map_err(|e| FcmError::Client(e.to_string()))?,
                    yup_oauth2::authenticator::ApplicationDefaultCredentialsTypes::ServiceAccount(b) => b
                        .build()
                        .await
                        .map_err(|e| FcmError::Credentials(e.to_string()))?,
                }
            }
        };
        Ok(Self {
            http,
            send_url: format!(
                "{}/v1/projects/{project_id}/messages:send",
                base.trim_end_matches('/')
            ),
            auth,
            refresh: AtomicBool::new(false),
            cached: arc_swap::ArcSwapOption::empty(),
            token_endpoint: crate::breaker::Breaker::new("fcm_token_endpoint"),
            fetching: tokio::sync::Mutex::new(()),
        })
    }

    fn cached_bearer(&self) -> Option<String> {
        let cached = self.cached.load();
        let token = cached.as_ref()?;
        (unix_now() < token.refresh_at).then(|| token.bearer.clone())
    }

    /// The cached bearer (no lock, no await), or one fetch within [`TOKEN_TIMEOUT`]: a stalled
    /// token endpoint costs a lane that long at most, and never blocks the cached path.
    async fn bearer(&self) -> Result<String, String> {
        if let Some(bearer) = self.cached_bearer() {
            return Ok(bearer);
        }
        // Closed, or this miss is the probe (released if the caller's own deadline drops it).
        let probe = match self.token_endpoint.gate(std::time::Instant::now()) {
            crate::breaker::Gate::Hold(_) => return Err("token endpoint held".to_owned()),
            crate::breaker::Gate::Probe => {
                Some(crate::breaker::ProbeGuard::new(&self.token_endpoint))
            }
            crate::breaker::Gate::Pass => None,
        };
        let fetched = tokio::time::timeout(TOKEN_TIMEOUT, self.fetch_bearer())
            .await
            .unwrap_or_else(|_| Err("token endpoint timed out".to_owned()));
        match &fetched {
            Ok(_) => {
                self.token_endpoint.success();
            }
            Err(_) => {
                metrics::counter!("orca_push_provider_token_failures_total", "provider" => "fcm")
                    .increment(1);
                self.token_endpoint.failure(std::time::Instant::now());
            }
        }
        if let Some(probe) = probe {
            probe.recorded();
        }
        fetched
    }

    async fn fetch_bearer(&self) -> Result<String, String> {
        let _one_at_a_time = self.fetching.lock().await;
        if let Some(bearer) = self.cached_bearer() {
            return Ok(bearer);
        }
        // Cleared only once a forced token is cached: a forced fetch that fails, or is dropped
        // (its caller's timeout, the batch's deadline), leaves the next one forced too, where
        // the OAuth client would otherwise hand back the token FCM refused from its own cache.
        let forced = self.refresh.load(Ordering::Acquire);
        let token = if forced {
            self.auth.force_refreshed_token(&[SCOPE]).await
        } else {
            self.auth.token(&[SCOPE]).await
        }
        .map_err(|e| e.to_string())?;
        let bearer = token
            .token()
            .map(str::to_owned)
            .ok_or_else(|| "no access token".to_owned())?;
        let expires = token
            .expiration_time()
            .and_then(|at| u64::try_from(at.unix_timestamp()).ok())
            .unwrap_or_else(|| unix_now() + 300);
        // Before the cache holds the new token: a refusal of that token (which sets the flag
        // again) can only come once it is cached.
        if forced {
            self.refresh.store(false, Ordering::Release);
        }
        self.cached.store(Some(Arc::new(CachedToken {
            bearer: bearer.clone(),
            refresh_at: expires.saturating_sub(TOKEN_MARGIN.as_secs()),
        })));
        Ok(bearer)
    }

    /// FCM refused `bearer`, ours: if it is still the one cached, the next send fetches a fresh
    /// one. A refusal of a bearer already replaced (a request in flight when it went stale) changes
    /// nothing, so one stale token costs one refresh however many requests carried it.
    fn token_went_stale(&self, bearer: &str) {
        let cached = self.cached.load_full();
        if cached.as_ref().is_some_and(|token| token.bearer == bearer) {
            // Before the cache empties: a fetch that finds it empty must force a new token.
            self.refresh.store(true, Ordering::Release);
            self.cached.compare_and_swap(&cached, None);
        }
    }

    /// Sends one message; `validate_only` asks FCM to check it without delivering.
    pub async fn send(&self, mut message: Value, validate_only: bool) -> Verdict {
        let bearer = match self.bearer().await {
            Ok(b) => b,
            Err(error) => {
                tracing::warn!(%error, "FCM OAuth token unavailable");
                return Verdict::unanswered("oauth_token");
            }
        };
        if validate_only {
            message["validate_only"] = Value::Bool(true);
        }
        let started = std::time::Instant::now();
        let response = match self
            .http
            .post(&self.send_url)
            .bearer_auth(&bearer)
            .json(&message)
            .send()
            .await
        {
            Ok(r) => r,
            Err(error) => {
                crate::providers::record_latency("fcm", started);
                tracing::warn!(error = %error.without_url(), "FCM request failed");
                return Verdict::unanswered("connection");
            }
        };
        let status = response.status().as_u16();
        tracing::Span::current().record("http.response.status_code", status);
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()));
        let body = match response.bytes().await {
            Ok(body) => body,
            // Cut off before the error body said what was wrong: a 400 or 404 (a dead token, a
            // bad field) classified blind would fail the batch for good. Tried again instead.
            Err(error) if matches!(status, 400 | 404) => {
                crate::providers::record_latency("fcm", started);
                tracing::warn!(error = %error.without_url(), status, "FCM's answer was cut off");
                return Verdict::unanswered("connection");
            }
            // The status says enough: FCM accepted it, or a 429 or 5xx is retried no sooner than
            // the Retry-After in its head (a 429 not within its minute either).
            Err(_) => Default::default(),
        };
        crate::providers::record_latency("fcm", started);
        let verdict = classify(status, retry_after, &body);
        if refuses_our_token(status, &body) {
            self.token_went_stale(&bearer);
        }
        verdict
    }
}

async fn read_key(path: &Path) -> Result<yup_oauth2::ServiceAccountKey, FcmError> {
    yup_oauth2::read_service_account_key(path)
        .await
        .map_err(|e| FcmError::Credentials(format!("{}: {e}", path.display())))
}

/// The parts of an FCM error body an answer is classified by: its gRPC status, message and
/// `errorCode` (empty where absent).
fn error_parts(body: &[u8]) -> (String, String, String) {
    let error = serde_json::from_slice::<Value>(body).ok();
    let error = error.as_ref().and_then(|v| v.get("error"));
    let text = |key: &str| {
        error
            .and_then(|e| e.get(key))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let error_code = error
        .and_then(|e| e.get("details"))
        .and_then(Value::as_array)
        .and_then(|details| {
            details
                .iter()
                .find_map(|d| d.get("errorCode").and_then(Value::as_str))
        })
        .unwrap_or("")
        .to_owned();
    (text("status"), text("message"), error_code)
}

/// Whether a 401 refuses our OAuth token, not the registration's credentials
/// (`THIRD_PARTY_AUTH_ERROR`: the APNs certificate or web push key behind an FCM token).
fn our_token_refused(status: u16, grpc_status: &str, error_code: &str) -> bool {
    status == 401
        && (error_code.is_empty()
            || grpc_status == "UNAUTHENTICATED" && error_code != "THIRD_PARTY_AUTH_ERROR")
}

/// [`our_token_refused`] of a whole answer.
fn refuses_our_token(status: u16, body: &[u8]) -> bool {
    if status != 401 {
        return false;
    }
    let (grpc_status, _, error_code) = error_parts(body);
    our_token_refused(status, &grpc_status, &error_code)
}

/// What an FCM answer means.
pub fn classify(status: u16, retry_after: Option<Duration>, body: &[u8]) -> Verdict {
    if status == 200 {
        return Verdict::Sent;
    }
    let (grpc_status, message, error_code) = error_parts(body);
    let (grpc_status, message, error_code) =
        (grpc_status.as_str(), message.as_str(), error_code.as_str());
    let reason = if !error_code.is_empty() {
        error_code.to_owned()
    } else if !grpc_status.is_empty() {
        grpc_status.to_owned()
    } else {
        format!("http_{status}")
    };
    let names_the_token = message.to_ascii_lowercase().contains("registration token");
    match status {
        _ if error_code == "UNREGISTERED" => Verdict::Dead(reason),
        400 if (error_code == "INVALID_ARGUMENT" || grpc_status == "INVALID_ARGUMENT")
            && names_the_token =>
        {
            Verdict::Dead("INVALID_ARGUMENT".into())
        }
        429 => Verdict::answered_retry(
            reason,
            retry_after.unwrap_or(QUOTA_MIN_DELAY).max(QUOTA_MIN_DELAY),
            RetryClass::Transient,
        ),
        // Our OAuth token went stale: refreshed for the next attempt.
        401 if our_token_refused(status, grpc_status, error_code) => {
            Verdict::answered_retry(reason, Duration::ZERO, RetryClass::Transient)
        }
        500..=599 => Verdict::answered_retry(
            reason,
            retry_after.unwrap_or(Duration::ZERO),
            RetryClass::Transient,
        ),
        // The message itself is wrong, or the token belongs to another sender: it would fail the
        // same way.
        400 | 404 | 413 => Verdict::Failed(reason),
        403 if error_code == "SENDER_ID_MISMATCH" => Verdict::Failed(reason),
        // Credentials refused (THIRD_PARTY_AUTH_ERROR, PERMISSION_DENIED: an operator may be
        // fixing them) or a status FCM does not document: a few more tries, then give up.
        _ => Verdict::answered_retry(
            reason,
            retry_after.unwrap_or(Duration::ZERO),
            RetryClass::Suspect,
        ),
    }
}

/// A shared handle.
pub type SharedFcm = Arc<Fcm>;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(status: &str, code: &str, message: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({ "error": { "code": 0, "message": message, "status": status,
            "details": [{ "@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError", "errorCode": code }] } }))
        .unwrap()
    }

    /// Only a refusal of our OAuth token empties the token cache: a third party's credentials
    /// (the APNs key behind an FCM token) say nothing of it, and every request that carried one
    /// would otherwise force a refresh.
    #[test]
    fn only_a_refusal_of_our_token_refreshes_it() {
        let bare = br#"{"error":{"code":401,"status":"UNAUTHENTICATED"}}"#;
        assert!(refuses_our_token(401, bare));
        assert!(refuses_our_token(401, b"not json"));
        assert!(!refuses_our_token(
            401,
            &body(
                "UNAUTHENTICATED",
                "THIRD_PARTY_AUTH_ERROR",
                "APNs certificate"
            )
        ));
        assert!(!refuses_our_token(403, bare));
        assert!(!refuses_our_token(200, b""));
    }

    #[test]
    fn dead_tokens() {
        assert_eq!(
            classify(
                404,
                None,
                &body(
                    "NOT_FOUND",
                    "UNREGISTERED",
                    "Requested entity was not found."
                )
            ),
            Verdict::Dead("UNREGISTERED".into())
        );
        assert_eq!(
            classify(
                400,
                None,
                &body(
                    "INVALID_ARGUMENT",
                    "INVALID_ARGUMENT",
                    "The registration token is not a valid FCM registration token"
                )
            ),
            Verdict::Dead("INVALID_ARGUMENT".into())
        );
        // A payload error is not a dead token.
        assert_eq!(
            classify(
                400,
                None,
                &body(
                    "INVALID_ARGUMENT",
                    "INVALID_ARGUMENT",
                    "Invalid value at 'message.android.ttl'"
                )
            ),
            Verdict::Failed("INVALID_ARGUMENT".into())
        );
    }

    #[test]
    fn quota_and_server_errors_are_retried() {
        let v = classify(
            429,
            Some(Duration::from_secs(5)),
            &body("RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED", "quota"),
        );
        assert_eq!(
            v,
            Verdict::answered_retry("QUOTA_EXCEEDED", QUOTA_MIN_DELAY, RetryClass::Transient)
        );
        let v = classify(429, Some(Duration::from_secs(90)), b"");
        assert_eq!(
            v,
            Verdict::answered_retry("http_429", Duration::from_secs(90), RetryClass::Transient)
        );
        assert!(
            matches!(classify(503, Some(Duration::from_secs(3)), b""), Verdict::Retry { not_before, .. } if not_before == Duration::from_secs(3))
        );
        assert!(matches!(
            classify(500, None, &body("INTERNAL", "INTERNAL", "x")),
            Verdict::Retry { .. }
        ));
        assert!(matches!(
            classify(
                403,
                None,
                &body("PERMISSION_DENIED", "SENDER_ID_MISMATCH", "x")
            ),
            Verdict::Failed(_)
        ));
        assert!(matches!(
            classify(403, None, &body("PERMISSION_DENIED", "", "denied")),
            Verdict::Retry {
                class: RetryClass::Suspect,
                answered: true,
                ..
            }
        ));
    }
}
