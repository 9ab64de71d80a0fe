//! The gateway API client: challenge -> proof -> session, one cached session, re-proof on 401.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::key::{HostKey, KeyError};
use crate::proof::{ChallengeEnvelope, ChallengeRefusal, answer_challenge};

/// A session is renewed this long before it expires, so a request never races the expiry.
const RENEW_MARGIN_MS: u64 = 60_000;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("the gateway URL must be an http(s) URL")]
    BadUrl,
    #[error("cannot reach the gateway: {0}")]
    Http(#[from] reqwest::Error),
    #[error("the gateway answered {status}: {code}")]
    Api { status: u16, code: String },
    #[error("refused the gateway's challenge: {0}")]
    Refused(#[from] ChallengeRefusal),
    #[error("the gateway's answer is malformed: {0}")]
    Malformed(&'static str),
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("cannot write the session cache {path}: {source}")]
    SessionCache {
        path: String,
        source: std::io::Error,
    },
}

impl GatewayError {
    /// The contract's error code, when the gateway answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Api { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// A session as the gateway minted it. Debug never shows the token.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SessionInfo {
    pub session_token: String,
    pub expires_at: u64,
    pub host_fingerprint: String,
}

impl std::fmt::Debug for SessionInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionInfo")
            .field("expires_at", &self.expires_at)
            .field("host_fingerprint", &self.host_fingerprint)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ChallengeReply {
    challenge_id: String,
    gateway_ephemeral_public_key_b64: String,
    nonce_b64: String,
    ciphertext_b64: String,
    expires_at: u64,
}

pub struct GatewayClient {
    http: reqwest::Client,
    base: String,
    origin: String,
    key: HostKey,
    session: tokio::sync::Mutex<Option<SessionInfo>>,
    session_file: Option<PathBuf>,
    headers: reqwest::header::HeaderMap,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn decode_fixed<const N: usize>(text: &str) -> Result<[u8; N], GatewayError> {
    STANDARD
        .decode(text)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or(GatewayError::Malformed(
            "challenge field is not base64 of the right length",
        ))
}

impl ChallengeEnvelope {
    /// Reads the JSON of a `POST /v1/host/challenge` answer, decoding its base64 fields.
    pub fn from_reply(reply: Value) -> Result<Self, GatewayError> {
        let reply: ChallengeReply = serde_json::from_value(reply)
            .map_err(|_| GatewayError::Malformed("challenge reply"))?;
        Ok(Self {
            challenge_id: reply.challenge_id,
            gateway_ephemeral_public_key: decode_fixed(&reply.gateway_ephemeral_public_key_b64)?,
            nonce: decode_fixed(&reply.nonce_b64)?,
            ciphertext: STANDARD
                .decode(&reply.ciphertext_b64)
                .map_err(|_| GatewayError::Malformed("ciphertext is not base64"))?,
            expires_at_ms: reply.expires_at,
        })
    }
}

impl GatewayClient {
    pub fn new(base_url: &str, key: HostKey) -> Result<Self, GatewayError> {
        let origin = crate::origin_of(base_url)?;
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(20))
            .user_agent(concat!("orca-push-host/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self {
            http,
            base: base_url.trim_end_matches('/').to_owned(),
            origin,
            key,
            session: tokio::sync::Mutex::new(None),
            session_file: None,
            headers: reqwest::header::HeaderMap::new(),
        })
    }

    /// Shares `http` (its connection pool) instead of a client of its own: many hosts in one
    /// process, as the load generator runs them.
    pub fn with_http_client(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// Headers sent on every request, e.g. what a proxy in front of the gateway expects.
    pub fn with_headers(mut self, headers: reqwest::header::HeaderMap) -> Self {
        self.headers = headers;
        self
    }

    /// Keeps the session in `path` (mode 0600) across runs, as the CLI does.
    pub fn with_session_file(mut self, path: PathBuf) -> Self {
        let cached = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<SessionInfo>(&b).ok())
            .filter(|s| s.host_fingerprint == self.key.fingerprint());
        self.session = tokio::sync::Mutex::new(cached);
        self.session_file = Some(path);
        self
    }

    pub fn key(&self) -> &HostKey {
        &self.key
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Runs challenge -> proof -> session now, replacing any cached session.
    pub async fn login(&self) -> Result<SessionInfo, GatewayError> {
        let mut guard = self.session.lock().await;
        let session = self.handshake().await?;
        self.store_session(&session)?;
        *guard = Some(session.clone());
        Ok(session)
    }

    /// The cached session, or a new one when there is none or it is about to expire.
    pub async fn session(&self) -> Result<SessionInfo, GatewayError> {
        let mut guard = self.session.lock().await;
        if let Some(session) = guard.as_ref()
            && session.expires_at > now_ms() + RENEW_MARGIN_MS
        {
            return Ok(session.clone());
        }
        let session = self.handshake().await?;
        self.store_session(&session)?;
        *guard = Some(session.clone());
        Ok(session)
    }

    /// An authenticated call. On 401 the session is re-proved once and the call repeated.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, GatewayError> {
        let session = self.session().await?;
        match self
            .send(method.clone(), path, body, Some(&session.session_token))
            .await
        {
            Err(GatewayError::Api { status: 401, .. }) => {
                let session = self.login().await?;
                self.send(method, path, body, Some(&session.session_token))
                    .await
            }
            other => other,
        }
    }

    async fn handshake(&self) -> Result<SessionInfo, GatewayError> {
        let reply = self
            .send(
                Method::POST,
                "/v1/host/challenge",
                Some(
                    &json!({ "v": 1, "hostPublicKeyB64": STANDARD.encode(self.key.public_key()) }),
                ),
                None,
            )
            .await?;
        let envelope = ChallengeEnvelope::from_reply(reply)?;
        let proof = answer_challenge(&self.key, &self.origin, &envelope, now_ms())?;
        let reply = self
            .send(
                Method::POST,
                "/v1/host/session",
                Some(&json!({
                    "v": 1,
                    "challengeId": envelope.challenge_id,
                    "proofB64": STANDARD.encode(proof),
                })),
                None,
            )
            .await?;
        let session: SessionInfo =
            serde_json::from_value(reply).map_err(|_| GatewayError::Malformed("session reply"))?;
        if session.host_fingerprint != self.key.fingerprint() {
            return Err(GatewayError::Malformed("session is for another host"));
        }
        Ok(session)
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        bearer: Option<&str>,
    ) -> Result<Value, GatewayError> {
        let mut request = self
            .http
            .request(method, format!("{}{}", self.base, path))
            .headers(self.headers.clone());
        if let Some(token) = bearer {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await?;
        let status = response.status();
        let bytes = response.bytes().await?;
        if status.is_success() {
            if status == StatusCode::NO_CONTENT || bytes.is_empty() {
                return Ok(Value::Null);
            }
            return serde_json::from_slice(&bytes)
                .map_err(|_| GatewayError::Malformed("response is not JSON"));
        }
        let code = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_owned))
            .unwrap_or_else(|| "unknown".to_owned());
        Err(GatewayError::Api {
            status: status.as_u16(),
            code,
        })
    }

    fn store_session(&self, session: &SessionInfo) -> Result<(), GatewayError> {
        let Some(path) = &self.session_file else {
            return Ok(());
        };
        let io = |source| GatewayError::SessionCache {
            path: path.display().to_string(),
            source,
        };
        let body = serde_json::to_vec(session).map_err(|e| io(std::io::Error::other(e)))?;
        let tmp = path.with_extension("tmp");
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        use std::io::Write as _;
        let mut file = options.open(&tmp).map_err(io)?;
        file.write_all(&body).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}
