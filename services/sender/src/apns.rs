//! APNs over HTTP/2: long-lived connections per environment, many streams on each, another
//! connection only when the open ones are saturated, PING keep-alive, reconnection with backoff;
//! ES256 provider tokens cached for 50 minutes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::payload::ApnsRequest;
use crate::verdict::{RetryClass, Verdict, parse_retry_after};

/// Provider tokens are refreshed this often (Apple accepts 20 to 60 minutes).
pub const TOKEN_REFRESH: Duration = Duration::from_secs(50 * 60);
/// Streams one connection carries before another is opened (APNs allows up to 1,000).
pub const DEFAULT_STREAMS_PER_CONNECTION: usize = 1000;
/// Connections per environment at most.
pub const MAX_CONNECTIONS: usize = 8;
/// One deadline for TCP connect, TLS handshake and HTTP/2 handshake together: a peer that stalls
/// any of them cannot hold the pool's connect lock longer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// One deadline for a whole send: waiting for a connection (and the connect lock), the request and
/// reading the answer.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
const PING_INTERVAL: Duration = Duration::from_secs(60);
const PING_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum ApnsError {
    #[error("APNs key: {0}")]
    Key(String),
    #[error("APNs URL: {0}")]
    Url(String),
}

/// The .p8 key and identifiers, and the token signed with them.
pub struct ProviderToken {
    key: jsonwebtoken::EncodingKey,
    key_id: String,
    team_id: String,
    cached: std::sync::Mutex<Option<Signed>>,
    signatures: std::sync::atomic::AtomicU64,
}

struct Signed {
    token: String,
    at: Instant,
    generation: u64,
}

/// A provider token and its generation (which signing made it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bearer {
    pub token: String,
    pub generation: u64,
}

#[derive(serde::Serialize)]
struct ProviderClaims<'a> {
    iss: &'a str,
    iat: u64,
}

/// Whether `p8_pem` can sign an APNs provider token (ES256 needs an EC P-256 PKCS#8 key). Checked
/// with the rest of the configuration, so a key of another curve, which reads as an EC key, stops
/// start-up instead of failing every APNs send.
pub fn check_key(p8_pem: &str) -> Result<(), String> {
    let key = jsonwebtoken::EncodingKey::from_ec_pem(p8_pem.as_bytes())
        .map_err(|_| "is not an EC (P-256) PKCS#8 PEM key".to_owned())?;
    let header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
    let claims = ProviderClaims {
        iss: "check",
        iat: 0,
    };
    jsonwebtoken::encode(&header, &claims, &key)
        .map(drop)
        .map_err(|_| "cannot sign an ES256 token: the .p8 key must be EC P-256".to_owned())
}

impl ProviderToken {
    pub fn new(p8_pem: &str, key_id: &str, team_id: &str) -> Result<Self, ApnsError> {
        let key = jsonwebtoken::EncodingKey::from_ec_pem(p8_pem.as_bytes()).map_err(|_| {
            ApnsError::Key("ORCA_PUSH_APNS_KEY is not an EC (P-256) PKCS#8 PEM key".into())
        })?;
        Ok(Self {
            key,
            key_id: key_id.to_owned(),
            team_id: team_id.to_owned(),
            cached: std::sync::Mutex::new(None),
            signatures: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The cached token, or a fresh one when it is 50 minutes old.
    pub fn bearer(&self) -> Result<Bearer, ApnsError> {
        self.bearer_replacing(None)
    }

    /// After APNs refused the token of `generation` as expired: a fresh token, signed once
    /// however many requests saw the refusal (APNs throttles re-signing with
    /// TooManyProviderTokenUpdates); a later generation is already fresh and is kept.
    pub fn refresh_after(&self, generation: u64) -> Result<Bearer, ApnsError> {
        self.bearer_replacing(Some(generation))
    }

    /// How many tokens were signed so far.
    pub fn signatures(&self) -> u64 {
        self.signatures.load(Ordering::Relaxed)
    }

    fn bearer_replacing(&self, stale: Option<u64>) -> Result<Bearer, ApnsError> {
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(signed) = cached.as_ref()
            && signed.at.elapsed() < TOKEN_REFRESH
            && stale.is_none_or(|g| g != signed.generation)
        {
            return Ok(Bearer {
                token: signed.token.clone(),
                generation: signed.generation,
            });
        }
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        header.kid = Some(self.key_id.clone());
        let iat = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let token = jsonwebtoken::encode(
            &header,
            &ProviderClaims {
                iss: &self.team_id,
                iat,
            },
            &self.key,
        )
        .map_err(|e| {
            // Every failed signing, first or refresh (after `ExpiredProviderToken`).
            metrics::counter!("orca_push_provider_token_failures_total", "provider" => "apns")
                .increment(1);
            ApnsError::Key(format!("cannot sign the provider token: {e}"))
        })?;
        let generation = self.signatures.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::counter!("orca_push_apns_tokens_signed_total").increment(1);
        *cached = Some(Signed {
            token: token.clone(),
            at: Instant::now(),
            generation,
        });
        Ok(Bearer { token, generation })
    }
}

struct Connection {
    sender: SendRequest<Full<Bytes>>,
    in_flight: AtomicUsize,
}

/// One stream counted on its connection for as long as it lives.
struct InFlight<'a>(&'a Connection);

impl<'a> InFlight<'a> {
    fn enter(connection: &'a Connection) -> Self {
        connection.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(connection)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Where one environment's connections go.
#[derive(Debug, Clone)]
struct Endpoint {
    tls: bool,
    host: String,
    port: u16,
    authority: String,
}

impl Endpoint {
    fn parse(base: &str) -> Result<Self, ApnsError> {
        let uri: http::Uri = base
            .parse()
            .map_err(|_| ApnsError::Url(format!("{base} is not a URL")))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(ApnsError::Url(format!(
                    "{base}: scheme must be https or http"
                )));
            }
        };
        let host = uri
            .host()
            .ok_or_else(|| ApnsError::Url(format!("{base} has no host")))?;
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        Ok(Self {
            tls,
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port,
            authority: uri.authority().map(|a| a.to_string()).unwrap_or_default(),
        })
    }
}

/// One environment's connection pool.
pub struct ApnsPool {
    endpoint: Endpoint,
    tls: Arc<rustls::ClientConfig>,
    connections: tokio::sync::RwLock<Vec<Arc<Connection>>>,
    connecting: tokio::sync::Mutex<ConnectState>,
    streams_per_connection: usize,
}

#[derive(Default)]
struct ConnectState {
    failures: u32,
    not_before: Option<Instant>,
}

/// Why a request got no answer from APNs.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("connection failed: {0}")]
    Request(String),
    #[error("timed out")]
    Timeout,
}

impl ApnsPool {
    pub fn new(
        base: &str,
        tls: Arc<rustls::ClientConfig>,
        streams_per_connection: usize,
    ) -> Result<Self, ApnsError> {
        Ok(Self {
            endpoint: Endpoint::parse(base)?,
            tls,
            connections: tokio::sync::RwLock::new(Vec::new()),
            connecting: tokio::sync::Mutex::new(ConnectState::default()),
            streams_per_connection: streams_per_connection.max(1),
        })
    }

    /// Open connections, for tests and metrics.
    pub async fn connection_count(&self) -> usize {
        self.connections
            .read()
            .await
            .iter()
            .filter(|c| !c.sender.is_closed())
            .count()
    }

    /// A connection with a free stream: an open one if any has room, else a new one.
    async fn connection(&self) -> Result<Arc<Connection>, TransportError> {
        if let Some(c) = self.least_loaded(true).await {
            return Ok(c);
        }
        let mut state = self.connecting.lock().await;
        // Another request may have connected while this one waited.
        if let Some(c) = self.least_loaded(true).await {
            return Ok(c);
        }
        let open = self.connection_count().await;
        if open >= MAX_CONNECTIONS {
            // Every connection is saturated: queue on the least loaded one.
            drop(state);
            return self
                .least_loaded(false)
                .await
                .ok_or(TransportError::Connect("no connection".into()));
        }
        if let Some(at) = state.not_before
            && Instant::now() < at
        {
            drop(state);
            return self.least_loaded(false).await.ok_or_else(|| {
                TransportError::Connect("reconnecting after failures (backoff)".into())
            });
        }
        let connected = tokio::time::timeout(CONNECT_TIMEOUT, self.connect())
            .await
            .unwrap_or(Err(TransportError::Timeout));
        match connected {
            Ok(connection) => {
                state.failures = 0;
                state.not_before = None;
                let connection = Arc::new(connection);
                let mut all = self.connections.write().await;
                all.retain(|c| !c.sender.is_closed());
                all.push(connection.clone());
                Ok(connection)
            }
            Err(error) => {
                state.failures += 1;
                let backoff = Duration::from_millis(100 * (1u64 << state.failures.min(8)))
                    .min(Duration::from_secs(30));
                state.not_before = Some(Instant::now() + backoff);
                tracing::warn!(%error, failures = state.failures, "APNs connect failed");
                Err(error)
            }
        }
    }

    async fn least_loaded(&self, with_room: bool) -> Option<Arc<Connection>> {
        let all = self.connections.read().await;
        all.iter()
            .filter(|c| !c.sender.is_closed())
            .filter(|c| {
                !with_room || c.in_flight.load(Ordering::Acquire) < self.streams_per_connection
            })
            .min_by_key(|c| c.in_flight.load(Ordering::Acquire))
            .cloned()
    }

    async fn connect(&self) -> Result<Connection, TransportError> {
        let e = &self.endpoint;
        let tcp = tokio::net::TcpStream::connect((e.host.as_str(), e.port))
            .await
            .map_err(|err| TransportError::Connect(err.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .keep_alive_interval(PING_INTERVAL)
            .keep_alive_timeout(PING_TIMEOUT)
            .keep_alive_while_idle(true)
            .timer(hyper_util::rt::TokioTimer::new());
        let sender = if e.tls {
            let name = rustls::pki_types::ServerName::try_from(e.host.clone())
                .map_err(|err| TransportError::Connect(err.to_string()))?;
            let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
                .connect(name, tcp)
                .await
                .map_err(|err| TransportError::Connect(err.to_string()))?;
            if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(TransportError::Connect(
                    "the server did not negotiate h2".into(),
                ));
            }
            let (sender, driver) = builder
                .handshake(TokioIo::new(tls))
                .await
                .map_err(|err| TransportError::Connect(err.to_string()))?;
            tokio::spawn(async move {
                if let Err(error) = driver.await {
                    tracing::debug!(%error, "APNs connection closed");
                }
            });
            sender
        } else {
            // http:// means HTTP/2 cleartext with prior knowledge (tests).
            let (sender, driver) = builder
                .handshake(TokioIo::new(tcp))
                .await
                .map_err(|err| TransportError::Connect(err.to_string()))?;
            tokio::spawn(async move {
                if let Err(error) = driver.await {
                    tracing::debug!(%error, "APNs connection closed");
                }
            });
            sender
        };
        Ok(Connection {
            sender,
            in_flight: AtomicUsize::new(0),
        })
    }

    /// Sends one request and reads the whole answer, all within [`SEND_TIMEOUT`].
    pub async fn send(
        &self,
        request: &ApnsRequest,
        bearer: &str,
    ) -> Result<(u16, http::HeaderMap, Bytes), TransportError> {
        tokio::time::timeout(SEND_TIMEOUT, self.send_within(request, bearer))
            .await
            .unwrap_or(Err(TransportError::Timeout))
    }

    async fn send_within(
        &self,
        request: &ApnsRequest,
        bearer: &str,
    ) -> Result<(u16, http::HeaderMap, Bytes), TransportError> {
        let connection = self.connection().await?;
        let scheme = if self.endpoint.tls { "https" } else { "http" };
        let mut builder = http::Request::post(format!(
            "{scheme}://{}{}",
            self.endpoint.authority, request.path
        ))
        .header("authorization", format!("bearer {bearer}"));
        for (name, value) in &request.headers {
            builder = builder.header(*name, value);
        }
        let http_request = builder
            .body(Full::new(Bytes::from(request.body.clone())))
            .map_err(|err| TransportError::Request(err.to_string()))?;
        // Counted while in flight, also when the deadline drops this future.
        let _stream = InFlight::enter(&connection);
        let mut sender = connection.sender.clone();
        sender
            .ready()
            .await
            .map_err(|err| TransportError::Request(err.to_string()))?;
        let response = sender
            .send_request(http_request)
            .await
            .map_err(|err| TransportError::Request(err.to_string()))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|err| TransportError::Request(err.to_string()))?
            .to_bytes();
        Ok((parts.status.as_u16(), parts.headers, body))
    }

    /// Closes every connection (shutdown, last).
    pub async fn close(&self) {
        self.connections.write().await.clear();
    }
}

/// What an APNs answer means.
pub fn classify(status: u16, headers: &http::HeaderMap, body: &[u8]) -> Verdict {
    let reason = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("reason").and_then(|r| r.as_str()).map(str::to_owned))
        .unwrap_or_default();
    let retry_after = headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()))
        .unwrap_or(Duration::ZERO);
    let reason_or_status = |reason: String| {
        if reason.is_empty() {
            format!("http_{status}")
        } else {
            reason
        }
    };
    match (status, reason.as_str()) {
        (200, _) => Verdict::Sent,
        (410, _) | (400, "BadDeviceToken" | "Unregistered" | "DeviceTokenNotForTopic") => {
            Verdict::Dead(if reason.is_empty() {
                "Unregistered".into()
            } else {
                reason
            })
        }
        // A stale provider token: retried at once with a fresh one.
        (403, "ExpiredProviderToken") => {
            Verdict::answered_retry(reason, retry_after, RetryClass::Transient)
        }
        (429, _) | (500..=599, _) => {
            Verdict::answered_retry(reason_or_status(reason), retry_after, RetryClass::Transient)
        }
        // The request itself is wrong (payload, headers, size, method): it would fail the same way.
        (400 | 405 | 413, _) => Verdict::Failed(reason_or_status(reason)),
        // A credentials refusal (an operator may be rotating the key) or a status APNs does not
        // document: a few more tries, then give up.
        _ => Verdict::answered_retry(reason_or_status(reason), retry_after, RetryClass::Suspect),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(reason: &str) -> Vec<u8> {
        format!(r#"{{"reason":"{reason}"}}"#).into_bytes()
    }

    fn token() -> ProviderToken {
        let key = rcgen::KeyPair::generate().expect("P-256 key");
        ProviderToken::new(&key.serialize_pem(), "KEYID12345", "TEAMID1234").expect("a valid key")
    }

    #[test]
    fn an_expired_token_is_re_signed_once_per_generation() {
        let token = token();
        let first = token.bearer().unwrap();
        assert_eq!(token.signatures(), 1);
        // Fifty requests were refused with the same token: one new signature.
        let fresh: Vec<Bearer> = (0..50)
            .map(|_| token.refresh_after(first.generation).unwrap())
            .collect();
        assert_eq!(token.signatures(), 2);
        assert!(fresh.iter().all(|b| b.generation == 2));
        assert_eq!(token.bearer().unwrap().generation, 2);
        // The new one refused in turn: one more.
        token.refresh_after(2).unwrap();
        assert_eq!(token.signatures(), 3);
    }

    #[test]
    fn every_failed_signing_is_counted_as_an_apns_token_failure() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let _local = metrics::set_default_local_recorder(&recorder);
        let failures = || {
            recorder
                .handle()
                .render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("orca_push_provider_token_failures_total{provider=\"apns\"} ")?
                        .parse::<f64>()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        // An EC key of the wrong curve reads as one, but cannot sign ES256.
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).expect("P-384 key");
        assert!(
            check_key(&key.serialize_pem()).is_err(),
            "refused at start-up"
        );
        let token = ProviderToken::new(&key.serialize_pem(), "KEYID12345", "TEAMID1234")
            .expect("an EC PKCS#8 key");
        assert!(token.bearer().is_err());
        assert_eq!(failures(), 1.0);
        assert!(token.refresh_after(1).is_err());
        assert_eq!(failures(), 2.0);
        assert_eq!(token.signatures(), 0);
        // A good key signs, and counts nothing.
        self::token().bearer().unwrap();
        assert_eq!(failures(), 2.0);
    }

    #[test]
    fn dead_tokens_are_the_contract_four() {
        let h = http::HeaderMap::new();
        assert_eq!(
            classify(410, &h, &body("Unregistered")),
            Verdict::Dead("Unregistered".into())
        );
        for reason in ["BadDeviceToken", "Unregistered", "DeviceTokenNotForTopic"] {
            assert_eq!(
                classify(400, &h, &body(reason)),
                Verdict::Dead(reason.into())
            );
        }
        assert_eq!(
            classify(400, &h, &body("BadCollapseId")),
            Verdict::Failed("BadCollapseId".into())
        );
        assert_eq!(
            classify(413, &h, &body("PayloadTooLarge")),
            Verdict::Failed("PayloadTooLarge".into())
        );
    }

    #[test]
    fn throttling_and_server_errors_are_retried_with_retry_after() {
        let mut h = http::HeaderMap::new();
        h.insert("retry-after", http::HeaderValue::from_static("7"));
        assert_eq!(
            classify(429, &h, &body("TooManyRequests")),
            Verdict::answered_retry(
                "TooManyRequests",
                Duration::from_secs(7),
                RetryClass::Transient
            )
        );
        assert!(matches!(
            classify(503, &http::HeaderMap::new(), b""),
            Verdict::Retry { .. }
        ));
        assert!(matches!(
            classify(403, &h, &body("ExpiredProviderToken")),
            Verdict::Retry { .. }
        ));
        assert!(matches!(
            classify(403, &h, &body("InvalidProviderToken")),
            Verdict::Retry {
                class: RetryClass::Suspect,
                answered: true,
                ..
            }
        ));
        assert!(matches!(
            classify(503, &h, b""),
            Verdict::Retry {
                class: RetryClass::Transient,
                answered: true,
                ..
            }
        ));
    }
}
