//! A mock APNs: HTTP/2 over TLS (its own CA), checking every provider token's ES256 signature with
//! the public key, recording each request, answering what the test scripts per device token.

use std::collections::{HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;

pub const TEAM_ID: &str = "TEAM123456";
pub const KEY_ID: &str = "KEYID12345";

/// One request as APNs received it.
#[derive(Debug, Clone)]
pub struct ApnsCall {
    pub path: String,
    pub token: String,
    pub headers: HashMap<String, String>,
    pub body: Value,
    pub jwt: String,
    pub at: Instant,
}

/// A scripted answer: status, optional Retry-After, reason.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub retry_after: Option<u64>,
    pub reason: Option<&'static str>,
}

impl Answer {
    pub fn status(status: u16, reason: Option<&'static str>) -> Self {
        Self {
            status,
            retry_after: None,
            reason,
        }
    }
}

#[derive(Default)]
struct State {
    calls: Vec<ApnsCall>,
    scripts: HashMap<String, VecDeque<Answer>>,
    always: HashMap<String, Answer>,
    rejected_jwts: usize,
    connections: usize,
    /// Tokens whose next request gets a GOAWAY instead of an answer.
    goaway: HashSet<String>,
    goaways_sent: usize,
    completed: usize,
    in_flight: usize,
    peak_in_flight: usize,
    /// The last provider token whose signature checked out: APNs tokens live for up to an hour, so
    /// a benchmark does not spend the load generator's CPU verifying the same one again.
    valid_jwt: Option<(String, u64)>,
    /// Where requests go instead of `calls` (the benchmark).
    sink: Option<crate::ArrivalSink>,
}

pub struct MockApns {
    pub url: String,
    /// PEM of the CA the gateway must trust (ORCA_PUSH_CA_FILE).
    pub ca_file: tempfile::NamedTempFile,
    /// The .p8-style PKCS#8 PEM the gateway signs with (ORCA_PUSH_APNS_KEY).
    pub key_pem: String,
    state: Arc<Mutex<State>>,
    latency: Arc<Mutex<Duration>>,
}

/// Where a mock APNs listens, the host its URL names and the names its certificate carries.
#[derive(Debug, Clone)]
pub struct ApnsOptions {
    /// The address to listen on; port 0 takes a free one.
    pub listen: std::net::SocketAddr,
    /// The host in `url`: how the gateway reaches the mock. The certificate names it too.
    pub public_host: String,
    /// More names (DNS names or IP addresses) for the certificate, besides `localhost`,
    /// `127.0.0.1` and `public_host`.
    pub tls_names: Vec<String>,
}

impl Default for ApnsOptions {
    /// Loopback, a free port, `https://localhost:<port>`: what the tests use.
    fn default() -> Self {
        Self {
            listen: (std::net::Ipv4Addr::LOCALHOST, 0).into(),
            public_host: "localhost".into(),
            tls_names: Vec::new(),
        }
    }
}

/// `host` as it goes into a URL: an IPv6 address in brackets.
pub(crate) fn url_host(host: &str) -> String {
    if host.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

impl MockApns {
    /// On loopback, at a free port, as `https://localhost:<port>`.
    pub async fn start() -> Self {
        Self::start_with(ApnsOptions::default()).await
    }

    /// Where `options` say: another container or machine can reach it when it listens on a
    /// public address and `public_host` is a name that resolves to it there.
    pub async fn start_with(options: ApnsOptions) -> Self {
        let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into()];
        for name in std::iter::once(&options.public_host).chain(&options.tls_names) {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        let certified = rcgen::generate_simple_self_signed(names).expect("self-signed certificate");
        let mut ca_file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut ca_file, certified.cert.pem().as_bytes()).unwrap();
        let signing = rcgen::KeyPair::generate().expect("P-256 key");
        let key_pem = signing.serialize_pem();
        let verify_key =
            jsonwebtoken::DecodingKey::from_ec_pem(signing.public_key_pem().as_bytes()).unwrap();

        let cert_der = certified.cert.der().clone();
        let key_der: rustls::pki_types::PrivateKeyDer<'static> = certified.signing_key.into();
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert_der], key_der)
        .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .unwrap_or_else(|e| panic!("mock APNs cannot listen on {}: {e}", options.listen));
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State::default()));
        let latency = Arc::new(Mutex::new(Duration::ZERO));
        let verify_key = Arc::new(verify_key);
        {
            let state = state.clone();
            let latency = latency.clone();
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let acceptor = acceptor.clone();
                    let state = state.clone();
                    let latency = latency.clone();
                    let verify_key = verify_key.clone();
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        state.lock().unwrap().connections += 1;
                        let goaway = Arc::new(tokio::sync::Notify::new());
                        let service = {
                            let state = state.clone();
                            let goaway = goaway.clone();
                            service_fn(move |request| {
                                let state = state.clone();
                                let latency = latency.clone();
                                let verify_key = verify_key.clone();
                                let goaway = goaway.clone();
                                async move {
                                    Ok::<_, Infallible>(
                                        handle(request, &state, &latency, &verify_key, &goaway)
                                            .await,
                                    )
                                }
                            })
                        };
                        let mut builder =
                            hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                        builder.max_concurrent_streams(1000);
                        let connection = builder.serve_connection(TokioIo::new(tls), service);
                        tokio::pin!(connection);
                        tokio::select! {
                            _ = connection.as_mut() => {}
                            () = goaway.notified() => {
                                // A server going away: GOAWAY, then the connection closes with
                                // the request in flight unanswered.
                                connection.as_mut().graceful_shutdown();
                                let flush = Duration::from_millis(300);
                                let _ = tokio::time::timeout(flush, connection.as_mut()).await;
                                state.lock().unwrap().goaways_sent += 1;
                            }
                        }
                    });
                }
            });
        }
        Self {
            url: format!("https://{}:{port}", url_host(&options.public_host)),
            ca_file,
            key_pem,
            state,
            latency,
        }
    }

    /// Environment for a gateway that delivers here.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("ORCA_PUSH_APNS_URL".into(), self.url.clone()),
            (
                "ORCA_PUSH_CA_FILE".into(),
                self.ca_file.path().display().to_string(),
            ),
            ("ORCA_PUSH_APNS_KEY".into(), self.key_pem.clone()),
            ("ORCA_PUSH_APNS_KEY_ID".into(), KEY_ID.into()),
            ("ORCA_PUSH_APPLE_TEAM_ID".into(), TEAM_ID.into()),
        ]
    }

    /// The next answers for `token`, in order; then 200.
    pub fn script(&self, token: &str, answers: Vec<Answer>) {
        self.state
            .lock()
            .unwrap()
            .scripts
            .insert(token.to_owned(), answers.into());
    }

    /// The answer for `token`, every time.
    pub fn always(&self, token: &str, answer: Answer) {
        self.state
            .lock()
            .unwrap()
            .always
            .insert(token.to_owned(), answer);
    }

    /// The next request for `token` is never answered: its connection gets an HTTP/2 GOAWAY and
    /// closes while the request is in flight.
    pub fn goaway_on_next(&self, token: &str) {
        self.state.lock().unwrap().goaway.insert(token.to_owned());
    }

    /// Connections closed with a GOAWAY so far.
    pub fn goaways_sent(&self) -> usize {
        self.state.lock().unwrap().goaways_sent
    }

    /// The port the mock listens on.
    pub fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("the mock's port")
    }

    /// Ends every `always` answer: the provider recovers.
    pub fn heal(&self) {
        self.state.lock().unwrap().always.clear();
    }

    /// Sends every request's arrival to `sink` instead of keeping it in `calls()`.
    pub fn stream_to(&self, sink: crate::ArrivalSink) {
        self.state.lock().unwrap().sink = Some(sink);
    }

    /// The most requests ever open at once (streams in flight across all connections).
    pub fn peak_in_flight(&self) -> usize {
        self.state.lock().unwrap().peak_in_flight
    }

    /// Forgets the peak so far, so the next phase of a benchmark measures its own.
    pub fn reset_peak_in_flight(&self) {
        let mut state = self.state.lock().unwrap();
        state.peak_in_flight = state.in_flight;
    }

    pub fn set_latency(&self, latency: Duration) {
        *self.latency.lock().unwrap() = latency;
    }

    pub fn calls(&self) -> Vec<ApnsCall> {
        self.state.lock().unwrap().calls.clone()
    }

    pub fn calls_for(&self, token: &str) -> Vec<ApnsCall> {
        self.calls()
            .into_iter()
            .filter(|c| c.token == token)
            .collect()
    }

    pub fn rejected_jwts(&self) -> usize {
        self.state.lock().unwrap().rejected_jwts
    }

    pub fn connections(&self) -> usize {
        self.state.lock().unwrap().connections
    }

    /// Requests answered (their response sent) so far.
    pub fn completed(&self) -> usize {
        self.state.lock().unwrap().completed
    }

    /// Waits until `n` requests for `token` arrived, or panics after `within`.
    pub async fn wait_for(&self, token: &str, n: usize, within: Duration) -> Vec<ApnsCall> {
        let deadline = Instant::now() + within;
        loop {
            let calls = self.calls_for(token);
            if calls.len() >= n {
                return calls;
            }
            assert!(
                Instant::now() < deadline,
                "APNs got {} of {n} requests for the token",
                calls.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[derive(serde::Deserialize)]
struct Claims {
    #[allow(dead_code)]
    iss: String,
    iat: u64,
}

fn reply(status: u16, retry_after: Option<u64>, reason: Option<&str>) -> Response<Full<Bytes>> {
    let mut builder = Response::builder()
        .status(status)
        .header("apns-id", "00000000-0000-0000-0000-000000000001");
    if let Some(seconds) = retry_after {
        builder = builder.header("retry-after", seconds.to_string());
    }
    let body = reason
        .map(|r| format!(r#"{{"reason":"{r}"}}"#))
        .unwrap_or_default();
    builder.body(Full::new(Bytes::from(body))).unwrap()
}

async fn handle(
    request: Request<Incoming>,
    state: &Mutex<State>,
    latency: &Mutex<Duration>,
    verify_key: &jsonwebtoken::DecodingKey,
    goaway: &tokio::sync::Notify,
) -> Response<Full<Bytes>> {
    let (parts, body) = request.into_parts();
    // A body cut short (the sender killed mid-request) is no request: APNs delivers nothing of
    // it, so it is not recorded as a call (it once was, with no payload, and read as a delivery).
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return reply(400, None, Some("BadRequest"));
    };
    let jwt = parts
        .headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bearer "))
        .unwrap_or("")
        .to_owned();
    let cached = state
        .lock()
        .unwrap()
        .valid_jwt
        .as_ref()
        .filter(|(known, _)| *known == jwt)
        .map(|(_, iat)| *iat);
    let Some(iat) = cached
        .filter(|iat| recent(*iat))
        .or_else(|| valid_provider_token(&jwt, verify_key))
    else {
        state.lock().unwrap().rejected_jwts += 1;
        return reply(403, None, Some("InvalidProviderToken"));
    };
    let known = cached.is_some();
    let token = parts
        .uri
        .path()
        .strip_prefix("/3/device/")
        .unwrap_or("")
        .to_owned();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (answer, going_away) = {
        let mut s = state.lock().unwrap();
        if !known {
            s.valid_jwt = Some((jwt.clone(), iat));
        }
        let going_away = s.goaway.remove(&token);
        s.in_flight += 1;
        s.peak_in_flight = s.peak_in_flight.max(s.in_flight);
        if let Some(sink) = &s.sink {
            let _ = sink.send(crate::Arrival {
                provider: "apns",
                notification_id: body["orca"]["notificationId"].as_str().map(str::to_owned),
                token: token.clone(),
                collapse_id: parts
                    .headers
                    .get("apns-collapse-id")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                at: Instant::now(),
            });
        } else {
            let headers = parts
                .headers
                .iter()
                .filter(|(k, _)| k.as_str().starts_with("apns-"))
                .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
                .collect();
            s.calls.push(ApnsCall {
                path: parts.uri.path().to_owned(),
                token: token.clone(),
                headers,
                body,
                jwt,
                at: Instant::now(),
            });
        }
        let answer = s
            .scripts
            .get_mut(&token)
            .and_then(VecDeque::pop_front)
            .or_else(|| s.always.get(&token).cloned());
        (answer, going_away)
    };
    if going_away {
        goaway.notify_one();
        // Never answered: the connection is gone before this wakes.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let mut s = state.lock().unwrap();
        s.in_flight -= 1;
        return reply(503, None, None);
    }
    let delay = *latency.lock().unwrap();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    {
        let mut s = state.lock().unwrap();
        s.completed += 1;
        s.in_flight -= 1;
    }
    match answer {
        Some(a) => reply(a.status, a.retry_after, a.reason),
        None => reply(200, None, None),
    }
}

/// Issued within the last hour (and not from the future).
fn recent(iat: u64) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    iat <= now + 60 && now.saturating_sub(iat) < 3600
}

/// The provider token: ES256, kid and team id as configured, iat recent. Its iat when valid.
fn valid_provider_token(jwt: &str, verify_key: &jsonwebtoken::DecodingKey) -> Option<u64> {
    let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::ES256);
    validation.required_spec_claims.clear();
    validation.validate_exp = false;
    validation.set_issuer(&[TEAM_ID]);
    let header_ok =
        jsonwebtoken::decode_header(jwt).is_ok_and(|h| h.kid.as_deref() == Some(KEY_ID));
    let iat = jsonwebtoken::decode::<Claims>(jwt, verify_key, &validation)
        .ok()?
        .claims
        .iat;
    (header_ok && recent(iat)).then_some(iat)
}
