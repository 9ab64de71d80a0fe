//! The gateway API client: challenge -> proof -> session, one cached session, re-proof on 401.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_api::{
    DeviceList, ErrorBody, ErrorCode, Health, RegisterReply, RegisterRequest, SendReply,
    SendRequest,
};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::error::{GatewayError, parse_retry_after};
use crate::key::HostKey;
use crate::proof::{ChallengeEnvelope, answer_challenge};
use crate::session::{SessionFile, SessionInfo};

/// A session is renewed this long before it expires, so a request never races the expiry.
const RENEW_MARGIN_MS: u64 = 60_000;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ChallengeReply {
    challenge_id: String,
    gateway_ephemeral_public_key_b64: String,
    nonce_b64: String,
    ciphertext_b64: String,
    expires_at: u64,
}

/// A host's client of one gateway: one session (cached per gateway origin, in memory and, with
/// [`GatewayClient::with_session_file`], on disk), typed calls for every route, a re-proof on 401.
pub struct GatewayClient {
    http: reqwest::Client,
    base: String,
    origin: String,
    key: HostKey,
    session: tokio::sync::Mutex<Option<SessionInfo>>,
    session_file: Option<SessionFile>,
    headers: reqwest::header::HeaderMap,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn fresh(session: &SessionInfo) -> bool {
    session.expires_at > now_ms() + RENEW_MARGIN_MS
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

/// Percent-encodes one path segment (everything but RFC 3986's unreserved characters).
fn path_segment(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The process's HTTP client, built once and shared by every [`GatewayClient`] (a reqwest client is
/// a handle to one connection pool). Building one reads the operating system's certificate store,
/// milliseconds of work that a client per host would repeat.
fn shared_http() -> Result<reqwest::Client, GatewayError> {
    static SHARED: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    if let Some(http) = SHARED.get() {
        return Ok(http.clone());
    }
    // reqwest's rustls trusts the bundled roots and, with `rustls-tls-native-roots`, the operating
    // system's store: a desktop behind TLS inspection trusts the inspecting CA.
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(20))
        .user_agent(concat!("orca-push-host/", env!("CARGO_PKG_VERSION")))
        .build()?;
    Ok(SHARED.get_or_init(|| http).clone())
}

impl GatewayClient {
    pub fn new(base_url: &str, key: HostKey) -> Result<Self, GatewayError> {
        let origin = crate::origin_of(base_url)?;
        Ok(Self {
            http: shared_http()?,
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

    /// Keeps sessions in `path` (mode 0600), one per gateway origin, shared by every process of
    /// this host: the CLI and a running desktop use one session instead of revoking each other's.
    pub fn with_session_file(mut self, path: PathBuf) -> Self {
        let file = SessionFile::new(path);
        let cached = file.load(&self.origin, &self.key.fingerprint());
        self.session = tokio::sync::Mutex::new(cached);
        self.session_file = Some(file);
        self
    }

    pub fn key(&self) -> &HostKey {
        &self.key
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Runs challenge -> proof -> session now, replacing any cached session (and revoking the
    /// gateway's earlier session of this host). [`GatewayClient::session`] is what callers want.
    pub async fn login(&self) -> Result<SessionInfo, GatewayError> {
        let mut guard = self.session.lock().await;
        let session = self.handshake().await?;
        *guard = Some(session.clone());
        self.store_session(&session);
        Ok(session)
    }

    /// The cached session (from memory, then from the session file), or a new one when there is
    /// none or it is about to expire.
    pub async fn session(&self) -> Result<SessionInfo, GatewayError> {
        let mut guard = self.session.lock().await;
        if let Some(session) = guard.as_ref().filter(|s| fresh(s)) {
            return Ok(session.clone());
        }
        if let Some(session) = self.file_session().filter(fresh) {
            *guard = Some(session.clone());
            return Ok(session);
        }
        let session = self.handshake().await?;
        *guard = Some(session.clone());
        self.store_session(&session);
        Ok(session)
    }

    /// A session other than `refused`, which the gateway just answered 401 for. Proves the key
    /// again only if `refused` is still the newest session this host knows: when another task (or
    /// another process, through the session file) already replaced it, that replacement is used,
    /// so two concurrent 401s cost one login, and neither revokes the other's new session.
    async fn renew_after_refusal(&self, refused: &str) -> Result<SessionInfo, GatewayError> {
        let mut guard = self.session.lock().await;
        let other = |s: &SessionInfo| s.session_token != refused && fresh(s);
        if let Some(session) = guard.as_ref().filter(|s| other(s)) {
            return Ok(session.clone());
        }
        if let Some(session) = self.file_session().filter(other) {
            *guard = Some(session.clone());
            return Ok(session);
        }
        let session = self.handshake().await?;
        *guard = Some(session.clone());
        self.store_session(&session);
        Ok(session)
    }

    fn file_session(&self) -> Option<SessionInfo> {
        self.session_file
            .as_ref()?
            .load(&self.origin, &self.key.fingerprint())
    }

    /// An authenticated call with a raw JSON body. On 401 the session is renewed once (see
    /// [`GatewayClient::session`]) and the call repeated. The typed methods are built on this.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, GatewayError> {
        let session = self.session().await?;
        match self
            .request(method.clone(), path, body, Some(&session.session_token))
            .await
        {
            Err(GatewayError::Api { code, .. }) if code.needs_login() => {
                let session = self.renew_after_refusal(&session.session_token).await?;
                self.request(method, path, body, Some(&session.session_token))
                    .await
            }
            other => other,
        }
    }

    async fn call_typed<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<T, GatewayError> {
        let reply = self.call(method, path, body).await?;
        serde_json::from_value(reply).map_err(|_| GatewayError::Malformed("reply shape"))
    }

    /// `POST /v1/devices`: registers a phone, or replaces its token (an upsert keyed by deviceId).
    pub async fn register(&self, request: &RegisterRequest) -> Result<RegisterReply, GatewayError> {
        request.validate()?;
        let body = serde_json::to_value(request).map_err(|_| GatewayError::Malformed("body"))?;
        self.call_typed(Method::POST, "/v1/devices", Some(&body))
            .await
    }

    /// `GET /v1/devices`: this host's registrations (never their tokens).
    pub async fn devices(&self) -> Result<DeviceList, GatewayError> {
        self.call_typed(Method::GET, "/v1/devices", None).await
    }

    /// `DELETE /v1/devices/{registrationId}`. A registration that is already gone answers
    /// `not_found`: callers draining deletes treat that as done.
    pub async fn unregister(&self, registration_id: &str) -> Result<(), GatewayError> {
        if !orca_push_api::limits::is_opaque_id(registration_id) {
            return Err(orca_push_api::Invalid("registrationId: 1 to 128 characters").into());
        }
        let path = format!("/v1/devices/{}", path_segment(registration_id));
        self.call(Method::DELETE, &path, None).await.map(drop)
    }

    /// `POST /v1/send`: one notification to at most 20 registrations, one result per distinct id.
    pub async fn send(&self, request: &SendRequest) -> Result<SendReply, GatewayError> {
        request.validate()?;
        let body = serde_json::to_value(request).map_err(|_| GatewayError::Malformed("body"))?;
        self.call_typed(Method::POST, "/v1/send", Some(&body)).await
    }

    /// `GET /health`: the gateway's protocol versions. Unauthenticated.
    pub async fn health(&self) -> Result<Health, GatewayError> {
        let reply = self.request(Method::GET, "/health", None, None).await?;
        serde_json::from_value(reply).map_err(|_| GatewayError::Malformed("health reply"))
    }

    async fn handshake(&self) -> Result<SessionInfo, GatewayError> {
        let reply = self
            .request(
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
            .request(
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

    async fn request(
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
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let bytes = response.bytes().await?;
        if status.is_success() {
            if status == StatusCode::NO_CONTENT || bytes.is_empty() {
                return Ok(Value::Null);
            }
            return serde_json::from_slice(&bytes)
                .map_err(|_| GatewayError::Malformed("response is not JSON"));
        }
        let code = serde_json::from_slice::<ErrorBody>(&bytes)
            .map(|b| b.error)
            .unwrap_or(ErrorCode::Unknown);
        Err(GatewayError::Api {
            status: status.as_u16(),
            code,
            retry_after,
        })
    }

    /// Keeps a new session in the shared file. A failure is logged, not returned: the session is
    /// already minted (and has revoked the host's earlier one), so throwing it away would only
    /// make the next call prove the key again, and again, each time revoking another process's
    /// session and spending the IP's challenge bucket. Other processes merely miss the new one.
    fn store_session(&self, session: &SessionInfo) {
        let Some(file) = &self.session_file else {
            return;
        };
        if let Err(error) = file.store(&self.origin, session) {
            tracing::warn!(
                path = %file.path().display(),
                %error,
                "cannot write the session cache; this process keeps its session in memory"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(path_segment("abc-_.~9"), "abc-_.~9");
        assert_eq!(path_segment("a/b?c"), "a%2Fb%3Fc");
        assert_eq!(path_segment("é"), "%C3%A9");
    }
}
