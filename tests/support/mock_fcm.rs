//! A mock FCM: an OAuth token endpoint that verifies the service account's RS256 assertion with
//! its public key, and `messages:send`, recording each message and answering per device token.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Form, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

pub const PROJECT: &str = "onorca-cloud";
const SERVICE_ACCOUNT_KEY: &str = include_str!("../fixtures/service-account-key.pem");
const SERVICE_ACCOUNT_PUBLIC: &str = include_str!("../fixtures/service-account-public.pem");
pub const CLIENT_EMAIL: &str = "orca-cloud-push@onorca-cloud.iam.gserviceaccount.com";

/// An answer body of just this string is cut off after the status line and headers: the
/// connection fails before the client has the body.
pub const CUT_OFF_BODY: &str = "(cut off)";

#[derive(Debug, Clone)]
pub struct FcmCall {
    pub token: String,
    pub message: Value,
    pub validate_only: bool,
    pub at: Instant,
}

#[derive(Debug, Clone)]
pub struct FcmAnswer {
    pub status: u16,
    pub body: Value,
    pub retry_after: Option<u64>,
}

#[derive(Default)]
struct Inner {
    calls: Vec<FcmCall>,
    token_requests: usize,
    /// The OAuth token endpoint answers 500 (an outage at Google's token service).
    token_endpoint_down: bool,
    metadata_requests: usize,
    rejected_assertions: usize,
    issued: Vec<String>,
    scripts: HashMap<String, VecDeque<FcmAnswer>>,
    /// Where sends go instead of `calls` (the benchmark).
    sink: Option<crate::ArrivalSink>,
    latency: Duration,
}

#[derive(Clone)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    token_uri: Arc<str>,
}

pub struct MockFcm {
    pub url: String,
    pub credentials: tempfile::NamedTempFile,
    inner: Arc<Mutex<Inner>>,
}

/// Where a mock FCM listens and the host its URLs name.
#[derive(Debug, Clone)]
pub struct FcmOptions {
    /// The address to listen on; port 0 takes a free one.
    pub listen: std::net::SocketAddr,
    /// The host in `url` and in the service account's `token_uri`: how the gateway reaches it.
    pub public_host: String,
}

impl Default for FcmOptions {
    /// Loopback, a free port, `http://127.0.0.1:<port>`: what the tests use.
    fn default() -> Self {
        Self {
            listen: (std::net::Ipv4Addr::LOCALHOST, 0).into(),
            public_host: "127.0.0.1".into(),
        }
    }
}

impl MockFcm {
    /// On loopback, at a free port, as `http://127.0.0.1:<port>`.
    pub async fn start() -> Self {
        Self::start_with(FcmOptions::default()).await
    }

    /// Where `options` say (see [`crate::mock_apns::MockApns::start_with`]).
    pub async fn start_with(options: FcmOptions) -> Self {
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .unwrap_or_else(|e| panic!("mock FCM cannot listen on {}: {e}", options.listen));
        let url = format!(
            "http://{}:{}",
            crate::mock_apns::url_host(&options.public_host),
            listener.local_addr().unwrap().port()
        );
        let token_uri = format!("{url}/token");
        let inner = Arc::new(Mutex::new(Inner::default()));
        let shared = Shared {
            inner: inner.clone(),
            token_uri: token_uri.clone().into(),
        };
        let app = axum::Router::new()
            .route("/token", post(token))
            .route(
                "/computeMetadata/v1/instance/service-accounts/default/token",
                axum::routing::get(metadata_token),
            )
            .route("/v1/projects/{project}/messages:send", post(send))
            .with_state(shared);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let mut credentials = tempfile::NamedTempFile::new().unwrap();
        let json = json!({
            "type": "service_account",
            "project_id": PROJECT,
            "private_key_id": "test-key",
            "private_key": SERVICE_ACCOUNT_KEY,
            "client_email": CLIENT_EMAIL,
            "client_id": "1",
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            "token_uri": token_uri,
        });
        std::io::Write::write_all(&mut credentials, json.to_string().as_bytes()).unwrap();
        Self {
            url,
            credentials,
            inner,
        }
    }

    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("ORCA_PUSH_FCM_URL".into(), self.url.clone()),
            (
                "GOOGLE_APPLICATION_CREDENTIALS".into(),
                self.credentials.path().display().to_string(),
            ),
        ]
    }

    /// Environment for a gateway that gets its token from this mock's metadata server instead.
    pub fn metadata_env(&self) -> Vec<(String, String)> {
        vec![
            ("ORCA_PUSH_FCM_URL".into(), self.url.clone()),
            (
                "GCE_METADATA_HOST".into(),
                self.url.trim_start_matches("http://").to_owned(),
            ),
        ]
    }

    /// Sends every message's arrival to `sink` instead of keeping it in `calls_for()`.
    pub fn stream_to(&self, sink: crate::ArrivalSink) {
        self.inner.lock().unwrap().sink = Some(sink);
    }

    /// How long `messages:send` takes to answer.
    pub fn set_latency(&self, latency: Duration) {
        self.inner.lock().unwrap().latency = latency;
    }

    pub fn metadata_requests(&self) -> usize {
        self.inner.lock().unwrap().metadata_requests
    }

    pub fn validate_only_calls(&self) -> Vec<FcmCall> {
        self.inner
            .lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| c.validate_only)
            .cloned()
            .collect()
    }

    pub fn script(&self, token: &str, answers: Vec<FcmAnswer>) {
        self.inner
            .lock()
            .unwrap()
            .scripts
            .insert(token.to_owned(), answers.into());
    }

    pub fn calls_for(&self, token: &str) -> Vec<FcmCall> {
        self.inner
            .lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| c.token == token)
            .cloned()
            .collect()
    }

    /// Makes the OAuth token endpoint answer 500 to every request (`true`), or work again.
    pub fn set_token_endpoint_down(&self, down: bool) {
        self.inner.lock().unwrap().token_endpoint_down = down;
    }

    pub fn token_requests(&self) -> usize {
        self.inner.lock().unwrap().token_requests
    }

    pub fn rejected_assertions(&self) -> usize {
        self.inner.lock().unwrap().rejected_assertions
    }

    pub async fn wait_for(&self, token: &str, n: usize, within: Duration) -> Vec<FcmCall> {
        let deadline = Instant::now() + within;
        loop {
            let calls = self.calls_for(token);
            if calls.len() >= n {
                return calls;
            }
            assert!(
                Instant::now() < deadline,
                "FCM got {} of {n} messages for the token",
                calls.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// An FCM error body with the given status and errorCode.
pub fn fcm_error(code: u16, status: &str, error_code: &str, message: &str) -> FcmAnswer {
    FcmAnswer {
        status: code,
        retry_after: None,
        body: json!({ "error": { "code": code, "message": message, "status": status,
            "details": [{ "@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError", "errorCode": error_code }] } }),
    }
}

#[derive(serde::Deserialize)]
struct TokenForm {
    grant_type: String,
    assertion: String,
}

#[derive(serde::Deserialize)]
struct Assertion {
    iss: String,
    aud: String,
    scope: String,
    exp: i64,
}

/// Verifies the RS256 assertion over its segments exactly as sent: Google accepts padded base64url
/// segments (yup-oauth2 sends them), which jsonwebtoken's `decode` refuses.
fn verify_assertion(assertion: &str, token_uri: &str) -> bool {
    use base64::Engine as _;
    let parts: Vec<&str> = assertion.split('.').collect();
    let [header, payload, signature] = parts[..] else {
        return false;
    };
    let key = jsonwebtoken::DecodingKey::from_rsa_pem(SERVICE_ACCOUNT_PUBLIC.as_bytes()).unwrap();
    let signing_input = format!("{header}.{payload}");
    let signed = jsonwebtoken::crypto::verify(
        signature.trim_end_matches('='),
        signing_input.as_bytes(),
        &key,
        jsonwebtoken::Algorithm::RS256,
    )
    .unwrap_or(false);
    let lenient = base64::engine::GeneralPurpose::new(
        &base64::alphabet::URL_SAFE,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let Some(claims) = lenient
        .decode(payload)
        .ok()
        .and_then(|b| serde_json::from_slice::<Assertion>(&b).ok())
    else {
        return false;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    signed
        && claims.iss == CLIENT_EMAIL
        && claims.aud == token_uri
        && claims.scope.contains("firebase.messaging")
        && claims.exp > now
}

async fn token(State(shared): State<Shared>, Form(form): Form<TokenForm>) -> Response {
    let ok = form.grant_type == "urn:ietf:params:oauth:grant-type:jwt-bearer"
        && verify_assertion(&form.assertion, &shared.token_uri);
    let mut inner = shared.inner.lock().unwrap();
    inner.token_requests += 1;
    if inner.token_endpoint_down {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({ "error": "internal_failure" })),
        )
            .into_response();
    }
    if !ok {
        inner.rejected_assertions += 1;
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({ "error": "invalid_grant" })),
        )
            .into_response();
    }
    let access = format!("mock-access-{}", inner.issued.len());
    inner.issued.push(access.clone());
    axum::Json(json!({ "access_token": access, "expires_in": 3600, "token_type": "Bearer" }))
        .into_response()
}

/// The GCE metadata server's token endpoint: only with `Metadata-Flavor: Google`.
async fn metadata_token(State(shared): State<Shared>, headers: HeaderMap) -> Response {
    if headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) != Some("Google") {
        return StatusCode::FORBIDDEN.into_response();
    }
    let mut inner = shared.inner.lock().unwrap();
    inner.metadata_requests += 1;
    let access = format!("mock-metadata-{}", inner.issued.len());
    inner.issued.push(access.clone());
    axum::Json(json!({ "access_token": access, "expires_in": 3599, "token_type": "Bearer" }))
        .into_response()
}

async fn send(
    State(shared): State<Shared>,
    Path(project): Path<String>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> Response {
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
        .to_owned();
    let (scripted, delay) = {
        let mut inner = shared.inner.lock().unwrap();
        if project != PROJECT || !inner.issued.contains(&bearer) {
            return (
                StatusCode::UNAUTHORIZED,
                axum::Json(json!({ "error": { "code": 401, "status": "UNAUTHENTICATED" } })),
            )
                .into_response();
        }
        let token = body["message"]["token"].as_str().unwrap_or("").to_owned();
        if let Some(sink) = &inner.sink {
            let _ = sink.send(crate::Arrival {
                provider: "fcm",
                notification_id: body["message"]["data"]["notificationId"]
                    .as_str()
                    .map(str::to_owned),
                token: token.clone(),
                collapse_id: body["message"]["android"]["notification"]["tag"]
                    .as_str()
                    .map(str::to_owned),
                at: Instant::now(),
            });
        } else {
            inner.calls.push(FcmCall {
                token: token.clone(),
                validate_only: body["validate_only"] == Value::Bool(true),
                message: body["message"].clone(),
                at: Instant::now(),
            });
        }
        let scripted = inner.scripts.get_mut(&token).and_then(VecDeque::pop_front);
        (scripted, inner.latency)
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    match scripted {
        Some(answer) => {
            let status = StatusCode::from_u16(answer.status).unwrap();
            let mut response = if answer.body == CUT_OFF_BODY {
                use futures::StreamExt as _;
                // The head and a first piece go out; the error a little later, so that it cuts
                // the body rather than the head.
                let first = futures::stream::once(async { Ok("{\"error\": {") });
                let cut = futures::stream::once(async {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Err(std::io::Error::other("cut off"))
                });
                (status, axum::body::Body::from_stream(first.chain(cut))).into_response()
            } else {
                (status, axum::Json(answer.body)).into_response()
            };
            if let Some(s) = answer.retry_after {
                response
                    .headers_mut()
                    .insert("retry-after", s.to_string().parse().unwrap());
            }
            // A redirect names the send URL itself, so a client that follows it asks again.
            if answer.status / 100 == 3 {
                let path = format!("/v1/projects/{PROJECT}/messages:send");
                response
                    .headers_mut()
                    .insert("location", path.parse().unwrap());
            }
            response
        }
        None => {
            axum::Json(json!({ "name": format!("projects/{PROJECT}/messages/1") })).into_response()
        }
    }
}
