//! Internal gRPC calls carry a short-lived HS256 token naming the caller (`sub`), the service
//! called (`aud`) and what it may call (`scope`). Every service refuses a call without one, with
//! another audience, expired, living longer than its scope allows, or naming no well-formed caller,
//! with UNAUTHENTICATED; a read-only token calling a method that is not a read
//! ([`orca_push_proto::access`]) is refused with PERMISSION_DENIED. Only gRPC health checks are
//! open, because probes need them.
//!
//! Services mint full-scope tokens for each other; `orca-push internal-token` mints read-only ones
//! unless told `--scope full`. A token without a scope claim (minted before scopes existed) is
//! read-only.
//!
//! The key is `ORCA_PUSH_INTERNAL_KEY` (required in split mode) or generated per process when all
//! in one. Never log a token or the key.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rand::RngCore as _;
use serde::{Deserialize, Serialize};

mod listener;
pub mod news;
mod transport;
pub use listener::serve_services;
use tonic::service::Routes;
pub use transport::{CALL_TIMEOUT, LocalCaller, LocalServer, Target, Transport};

/// Tokens services mint for each other live this long, and are re-minted a minute before.
pub const SERVICE_TOKEN_TTL: Duration = Duration::from_secs(300);
const REMINT_BEFORE: Duration = Duration::from_secs(60);
/// How often replica addresses are resolved again (and failed ones offered back to the balancer).
const RESOLVE_EVERY: Duration = Duration::from_secs(10);
/// Health checks are the one open method.
const OPEN_PREFIX: &str = "/grpc.health.v1.Health/";
/// The longest a read-only token may live (a working shift).
pub const MAX_READ_TTL: Duration = Duration::from_secs(8 * 3600);
/// The longest a full-scope token may live.
pub const MAX_FULL_TTL: Duration = Duration::from_secs(3600);
/// How far the minting machine's clock may run ahead of the checking one.
const CLOCK_SKEW: Duration = Duration::from_secs(300);
/// The longest caller name (`sub`).
const MAX_SUBJECT_LEN: usize = 64;

/// The shared signing key. Debug never shows it.
#[derive(Clone, Debug)]
pub struct InternalKey(Arc<secrecy::SecretSlice<u8>>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("must be at least 32 bytes of secret (e.g. `openssl rand -base64 48`)")]
    TooShort,
}

impl InternalKey {
    /// A random key for a process that talks only to itself (all in one).
    pub fn generate() -> Self {
        let mut bytes = vec![0u8; 48];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        Self(Arc::new(bytes.into()))
    }

    /// The configured secret, as text (base64 or not: its bytes are the key).
    pub fn from_secret(secret: &str) -> Result<Self, KeyError> {
        let secret = secret.trim();
        if secret.len() < 32 {
            return Err(KeyError::TooShort);
        }
        Ok(Self(Arc::new(secret.as_bytes().to_vec().into())))
    }
}

/// What a token may call.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// The read-only methods of [`orca_push_proto::access`] and reflection. Also what a token
    /// without a scope claim gets.
    #[default]
    Read,
    /// Every method: what services mint for each other.
    Full,
}

impl Scope {
    /// The longest a token of this scope may live.
    pub fn max_ttl(self) -> Duration {
        match self {
            Self::Read => MAX_READ_TTL,
            Self::Full => MAX_FULL_TTL,
        }
    }

    /// Whether this scope may call the method at `path`.
    pub fn allows(self, path: &str) -> bool {
        use orca_push_proto::access::{self, Access};
        match self {
            Self::Full => true,
            Self::Read => access::of(path) == Access::Read,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Full => "full",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claims {
    /// The caller: a service name or an internal team.
    pub sub: String,
    /// The service called.
    pub aud: String,
    pub iat: u64,
    pub exp: u64,
    /// Absent in tokens minted before scopes: read-only. An unknown value makes the token invalid.
    #[serde(default)]
    pub scope: Scope,
}

/// A caller name: 1 to 64 ASCII letters, digits, `.`, `_`, `-` or `@` (it is logged and traced).
pub fn valid_subject(subject: &str) -> bool {
    (1..=MAX_SUBJECT_LEN).contains(&subject.len())
        && subject
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("no internal token")]
    Missing,
    #[error("internal token expired")]
    Expired,
    #[error("internal token for another service")]
    WrongAudience,
    #[error("invalid internal token")]
    Invalid,
    #[error("internal token names no well-formed caller")]
    BadSubject,
    #[error("internal token lives longer than its scope allows")]
    TooLong,
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A token for `subject` to call `audience` within `scope`, valid from `iat` to `exp` (Unix
/// seconds). Mints whatever it is asked; [`verify`] enforces the subject's form and the lifetime.
pub fn mint_between(
    key: &InternalKey,
    subject: &str,
    audience: &str,
    scope: Scope,
    iat: u64,
    exp: u64,
) -> String {
    let claims = Claims {
        sub: subject.to_owned(),
        aud: audience.to_owned(),
        iat,
        exp,
        scope,
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secrecy::ExposeSecret::expose_secret(&*key.0)),
    )
    .unwrap_or_default()
}

/// A token for `subject` to call `audience` within `scope` for `ttl`.
pub fn mint(
    key: &InternalKey,
    subject: &str,
    audience: &str,
    scope: Scope,
    ttl: Duration,
) -> String {
    let now = now_s();
    mint_between(key, subject, audience, scope, now, now + ttl.as_secs())
}

/// Checks a token for `audience`: signature, audience, expiry, a well-formed caller, and a
/// remaining lifetime within its scope's maximum (plus clock skew). Which methods its scope may
/// call is the caller's check ([`Scope::allows`]).
pub fn verify(key: &InternalKey, token: &str, audience: &str) -> Result<Claims, Refusal> {
    verify_any(key, token, &[audience])
}

/// [`verify`], for a token of any of `audiences` (the all-in-one listener's reflection).
pub fn verify_any(key: &InternalKey, token: &str, audiences: &[&str]) -> Result<Claims, Refusal> {
    let mut validation = Validation::new(Algorithm::HS256);
    validation.set_audience(audiences);
    validation.leeway = 0;
    validation.set_required_spec_claims(&["exp", "aud", "sub"]);
    jsonwebtoken::decode::<Claims>(
        token,
        &DecodingKey::from_secret(secrecy::ExposeSecret::expose_secret(&*key.0)),
        &validation,
    )
    .map(|data| data.claims)
    .map_err(|error| match error.kind() {
        jsonwebtoken::errors::ErrorKind::ExpiredSignature => Refusal::Expired,
        jsonwebtoken::errors::ErrorKind::InvalidAudience => Refusal::WrongAudience,
        _ => Refusal::Invalid,
    })
    .and_then(|claims| {
        if !valid_subject(&claims.sub) {
            Err(Refusal::BadSubject)
        } else if claims.exp > now_s() + (claims.scope.max_ttl() + CLOCK_SKEW).as_secs() {
            Err(Refusal::TooLong)
        } else {
            Ok(claims)
        }
    })
}

/// Runs each call on its own task, so a caller that disconnects (an HTTP client gone, a sender
/// killed) cannot drop a handler halfway through a database transaction; the answer is discarded
/// instead. The call keeps the span it was made in.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunToCompletion;

/// Calls that end with their caller instead, run on the caller's task:
/// - A long-poll claim waits up to 30 s for work, and a lane that stops must not leave it running
///   to lease work to nobody. The queue runs the claim's transaction on a task of its own and
///   hands back what it leased if the caller is gone by then.
/// - Reads leave nothing half done when dropped.
/// - An admission is a hand-off: the queue's group-commit writer runs its transaction whatever
///   becomes of the caller, which only waits for the answer (on every backend; reports are not
///   listed, as on PostgreSQL their transaction runs in the call).
///
/// A task of its own costs every call a spawn and a second trip through the scheduler (the
/// handler's task wakes, then the caller's): on the two calls of every send, and the look-up of
/// every delivery batch (docs/benchmarks.md, round 15).
pub const ENDS_WITH_CALLER: &[&str] = &[
    "/orca.push.queue.v1.QueueService/Claim",
    "/orca.push.queue.v1.QueueService/Enqueue",
    "/orca.push.queue.v1.QueueService/GetEventOutcomes",
    "/orca.push.queue.v1.QueueService/GetQueueDepth",
    "/orca.push.registry.v1.RegistryService/ResolveRegistrations",
    "/orca.push.registry.v1.RegistryService/GetDevicesForDelivery",
    "/orca.push.registry.v1.RegistryService/ListDevices",
    "/orca.push.registry.v1.RegistryService/HostsWithDevices",
];

impl<S> tower::Layer<S> for RunToCompletion {
    type Service = RunToCompletionService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RunToCompletionService { inner }
    }
}

#[derive(Debug, Clone)]
pub struct RunToCompletionService<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for RunToCompletionService<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use tracing::Instrument as _;
        if ENDS_WITH_CALLER.contains(&request.uri().path()) {
            // Nothing is left half done if it stops with its caller (see the list).
            return Box::pin(self.inner.call(request));
        }
        let call = tokio::spawn(
            self.inner
                .call(request)
                .instrument(tracing::Span::current()),
        );
        Box::pin(async move {
            match call.await {
                Ok(result) => result,
                Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                // Cancelled only when the runtime shuts down: nobody waits for the answer.
                Err(_) => std::future::pending().await,
            }
        })
    }
}

/// The connections a service's gRPC server accepts on `listener`, with TCP_NODELAY set. A gRPC
/// answer is several small writes (headers, message, trailers): without it Nagle's algorithm holds
/// the last of them until the caller's delayed ACK, 40 ms on Linux, on every call. The benchmark
/// found this (docs/benchmarks.md).
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// A service's routes: gRPC health (open) and reflection (behind the caller check); the caller
/// adds its own service.
pub fn service_routes<H>(health: tonic_health::pb::health_server::HealthServer<H>) -> Routes
where
    H: tonic_health::pb::health_server::Health,
{
    let routes = Routes::new(health);
    match orca_push_proto::reflection_service() {
        Ok(reflection) => routes.add_service(reflection),
        Err(error) => {
            tracing::error!(%error, "gRPC reflection unavailable");
            routes
        }
    }
}

/// Serves `routes` on `listener` until `shutdown`, under the stack every service runs: traced
/// (outermost), caller-checked for `audience`, then each call run to completion even if its
/// caller goes away (but those of [`ENDS_WITH_CALLER`]). [`LocalServer`] runs the same stack in
/// process.
pub async fn serve_routes(
    listener: tokio::net::TcpListener,
    key: InternalKey,
    audience: &'static str,
    routes: Routes,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .layer(orca_push_telemetry::GrpcServerLayer::new(
            orca_push_proto::is_known_method,
        ))
        .layer(RequireToken::new(key, audience))
        .layer(RunToCompletion)
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming(listener), shutdown.cancelled_owned())
        .await
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Server side: refuse any call but health without a valid token for this service
/// (UNAUTHENTICATED), and any call its token's scope does not allow (PERMISSION_DENIED).
#[derive(Debug, Clone)]
pub struct RequireToken {
    key: InternalKey,
    audiences: Arc<[&'static str]>,
    verified: Arc<VerifiedTokens>,
}

impl RequireToken {
    pub fn new(key: InternalKey, audience: &'static str) -> Self {
        Self::any_of(key, &[audience])
    }

    /// A check that takes a token for any of `audiences`.
    pub fn any_of(key: InternalKey, audiences: &[&'static str]) -> Self {
        Self {
            key,
            audiences: Arc::from(audiences),
            verified: Arc::default(),
        }
    }
}

/// Tokens verified at most, kept with their claims.
const MAX_VERIFIED_TOKENS: usize = 256;

/// The tokens one check has verified, by their sha256, with their claims. A caller presents the
/// same token for minutes (services re-mint theirs a minute before its five end), and verifying it
/// again on every call (base64, two JSON parses, an HMAC and their allocations) was some 9% of a
/// split registry's CPU (docs/benchmarks.md, round 29). Only a token that verified enters, so
/// everything kept was minted with the key; the expiry is checked again on every use, and the rest
/// of a verdict cannot change with time but to allow more. Keyed by a digest, so no comparison
/// with a kept token runs on what a caller sent.
#[derive(Debug, Default)]
struct VerifiedTokens(Mutex<std::collections::HashMap<[u8; 32], Claims>>);

impl VerifiedTokens {
    /// [`verify_any`], remembered.
    fn check(
        &self,
        key: &InternalKey,
        token: &str,
        audiences: &[&str],
        now_s: u64,
    ) -> Result<Claims, Refusal> {
        use sha2::Digest as _;
        let digest: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        if let Some(claims) = self.kept().get(&digest) {
            // As `verify_any`: valid through the second of `exp`.
            return if now_s <= claims.exp {
                Ok(claims.clone())
            } else {
                Err(Refusal::Expired)
            };
        }
        let claims = verify_any(key, token, audiences)?;
        let mut kept = self.kept();
        if kept.len() >= MAX_VERIFIED_TOKENS {
            kept.retain(|_, claims| now_s <= claims.exp);
            if kept.len() >= MAX_VERIFIED_TOKENS {
                kept.clear();
            }
        }
        kept.insert(digest, claims.clone());
        Ok(claims)
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<[u8; 32], Claims>> {
        // Nothing that can panic runs under the lock: keep using it.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<S> tower::Layer<S> for RequireToken {
    type Service = RequireTokenService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireTokenService {
            inner,
            check: self.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RequireTokenService<S> {
    inner: S,
    check: RequireToken,
}

/// Who called, for handlers that care (set when the token was valid).
#[derive(Debug, Clone)]
pub struct Caller(pub String);

impl<S, B, R> tower::Service<http::Request<B>> for RequireTokenService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if request.uri().path().starts_with(OPEN_PREFIX) {
            return Box::pin(self.inner.call(request));
        }
        // A call from this process: full scope, no token to check.
        if let Some(local) = request.extensions_mut().remove::<LocalCaller>() {
            tracing::Span::current().record("enduser.id", &*local.subject);
            request
                .extensions_mut()
                .insert(Caller(local.subject.to_string()));
            return Box::pin(self.inner.call(request));
        }
        let token = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let verdict = match token {
            None => Err(Refusal::Missing),
            Some(token) => {
                self.check
                    .verified
                    .check(&self.check.key, token, &self.check.audiences, now_s())
            }
        };
        match verdict {
            Ok(claims) if claims.scope.allows(request.uri().path()) => {
                tracing::Span::current().record("enduser.id", claims.sub.as_str());
                request.extensions_mut().insert(Caller(claims.sub));
                Box::pin(self.inner.call(request))
            }
            Ok(claims) => {
                tracing::warn!(
                    caller = %claims.sub,
                    scope = claims.scope.as_str(),
                    method = request.uri().path(),
                    "internal call refused: the token's scope does not allow this method"
                );
                let status = tonic::Status::permission_denied(format!(
                    "a {}-scope internal token cannot call this method",
                    claims.scope.as_str()
                ));
                Box::pin(async move { Ok(status.into_http::<R>()) })
            }
            Err(refusal) => {
                let status = tonic::Status::unauthenticated(refusal.to_string());
                Box::pin(async move { Ok(status.into_http::<R>()) })
            }
        }
    }
}

/// Client side: every call carries a full-scope token for `audience`, re-minted before it expires;
/// a call to a server in this process carries a [`LocalCaller`] instead.
#[derive(Clone)]
pub struct AttachToken<S> {
    inner: S,
    minter: Arc<Minter>,
    local: Option<LocalCaller>,
}

struct Minter {
    key: InternalKey,
    subject: String,
    audience: String,
    cached: Mutex<Option<(http::HeaderValue, SystemTime)>>,
}

impl Minter {
    fn header(&self) -> http::HeaderValue {
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((value, expires)) = cached.as_ref()
            && SystemTime::now() + REMINT_BEFORE < *expires
        {
            return value.clone();
        }
        let token = mint(
            &self.key,
            &self.subject,
            &self.audience,
            Scope::Full,
            SERVICE_TOKEN_TTL,
        );
        let mut value = http::HeaderValue::from_str(&format!("Bearer {token}"))
            .unwrap_or_else(|_| http::HeaderValue::from_static(""));
        value.set_sensitive(true);
        *cached = Some((value.clone(), SystemTime::now() + SERVICE_TOKEN_TTL));
        value
    }
}

impl<S, B> tower::Service<http::Request<B>> for AttachToken<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        match &self.local {
            Some(local) => {
                request.extensions_mut().insert(local.clone());
            }
            None => {
                request
                    .headers_mut()
                    .insert(http::header::AUTHORIZATION, self.minter.header());
            }
        }
        self.inner.call(request)
    }
}

/// A traced transport whose calls carry `subject`'s identity to `audience`.
pub type InternalChannel = AttachToken<orca_push_telemetry::GrpcClientService<Transport>>;

/// A traced channel to `target` carrying `subject`'s identity: a token over the network, a
/// [`LocalCaller`] to a server in this process.
pub fn channel_to(
    target: &Target,
    key: &InternalKey,
    subject: &str,
    audience: &str,
) -> Result<InternalChannel, tonic::transport::Error> {
    match target {
        Target::Url(url) => channel(url, key, subject, audience),
        Target::Local(server) => Ok(AttachToken {
            inner: orca_push_telemetry::traced_in_process(Transport::Local(server.clone())),
            minter: minter(key, subject, audience),
            local: Some(LocalCaller {
                subject: Arc::from(subject),
            }),
        }),
    }
}

fn minter(key: &InternalKey, subject: &str, audience: &str) -> Arc<Minter> {
    Arc::new(Minter {
        key: key.clone(),
        subject: subject.to_owned(),
        audience: audience.to_owned(),
        cached: Mutex::new(None),
    })
}

/// A lazily connecting, traced, token-carrying channel to `url`.
///
/// `url` may name several replicas, comma-separated, and a host name may resolve to several
/// addresses (a headless Kubernetes Service): calls are then balanced client-side across every
/// address (power of two choices), an address that fails to connect is skipped until it answers
/// again, and the names are resolved again every 10 s so replicas come and go.
pub fn channel(
    url: &str,
    key: &InternalKey,
    subject: &str,
    audience: &str,
) -> Result<InternalChannel, tonic::transport::Error> {
    let targets: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    let single_address =
        targets.len() == 1 && target_address(targets[0]).is_some_and(|(_, literal)| literal);
    let channel = if single_address || targets.is_empty() {
        endpoint(targets.first().copied().unwrap_or(url))?.connect_lazy()
    } else {
        // Validate every target now, so a bad URL stops start-up rather than a background task.
        for target in &targets {
            endpoint(target)?;
        }
        let (channel, changes) =
            tonic::transport::Channel::balance_channel::<std::net::SocketAddr>(64);
        let targets: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
        tokio::spawn(follow_replicas(targets, changes));
        channel
    };
    Ok(AttachToken {
        inner: orca_push_telemetry::traced(Transport::Remote(channel)),
        minter: minter(key, subject, audience),
        local: None,
    })
}

fn endpoint(url: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(3))
        .timeout(CALL_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true))
}

/// `host:port` of an `http://host:port` target, and whether the host is an IP literal.
fn target_address(target: &str) -> Option<(String, bool)> {
    let uri: http::Uri = target.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(80);
    let literal = host.parse::<std::net::IpAddr>().is_ok();
    Some((format!("{host}:{port}"), literal))
}

/// Keeps the balanced channel's set of addresses in step with what the targets resolve to.
async fn follow_replicas(
    targets: Vec<String>,
    changes: tokio::sync::mpsc::Sender<
        tonic::transport::channel::Change<std::net::SocketAddr, tonic::transport::Endpoint>,
    >,
) {
    use tonic::transport::channel::Change;
    let mut known = std::collections::HashSet::new();
    loop {
        let mut now = std::collections::HashSet::new();
        for target in &targets {
            let Some((host_port, _)) = target_address(target) else {
                continue;
            };
            match tokio::net::lookup_host(host_port.as_str()).await {
                Ok(addrs) => now.extend(addrs),
                // Keep what we had for a name that does not resolve right now.
                Err(_) => now.extend(known.iter().copied()),
            }
        }
        // Every address is (re)inserted each round: the balancer drops a replica whose connection
        // failed, and this is how it comes back once it answers again.
        for addr in &now {
            let Ok(endpoint) = endpoint(&format!("http://{addr}")) else {
                continue;
            };
            if changes.send(Change::Insert(*addr, endpoint)).await.is_err() {
                return; // the channel is gone
            }
        }
        for addr in known.difference(&now) {
            if changes.send(Change::Remove(*addr)).await.is_err() {
                return;
            }
        }
        known = now;
        tokio::time::sleep(RESOLVE_EVERY).await;
    }
}

/// Calls `call` again when an attempt found its replica unavailable, up to 4 attempts over about
/// 200 ms, so the balancer can route around a replica that just died. Only for idempotent calls
/// (admissions are: the event identity makes a repeat a no-op).
pub async fn retry_unavailable<T, F, Fut>(mut call: F) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let mut pause = Duration::from_millis(25);
    for _ in 0..3 {
        match call().await {
            // Unknown, Internal and Cancelled without a contract code are what a connection that
            // died mid-call (an HTTP/2 reset) turns into. A service's own refusal names a contract
            // code (e.g. its database is down) and is final.
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::Unknown
                        | tonic::Code::Internal
                        | tonic::Code::Cancelled
                ) && status.metadata().get("x-orca-error").is_none() =>
            {
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            other => return other,
        }
    }
    call().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verified_token_is_remembered_until_it_expires_and_a_refused_one_never() {
        let key = InternalKey::generate();
        let verified = VerifiedTokens::default();
        let now = now_s();
        let token = mint_between(&key, "facade", "queue", Scope::Full, now, now + 60);
        let claims = verified.check(&key, &token, &["queue"], now).unwrap();
        assert_eq!(claims.sub, "facade");
        // Remembered: another key cannot have made it, so only a kept verdict accepts it now.
        let other = InternalKey::generate();
        assert_eq!(verified.check(&other, &token, &["queue"], now), Ok(claims));
        assert_eq!(
            verified
                .check(&key, &token, &["queue"], now + 60)
                .map(|c| c.sub),
            Ok("facade".to_owned())
        );
        assert_eq!(
            verified.check(&key, &token, &["queue"], now + 61),
            Err(Refusal::Expired)
        );
        // Refused tokens are not kept: a forged one stays refused, and a token for another
        // audience too.
        let forged = mint_between(&other, "facade", "queue", Scope::Full, now, now + 60);
        let registry = mint_between(&key, "facade", "registry", Scope::Full, now, now + 60);
        for _ in 0..2 {
            assert_eq!(
                verified.check(&key, &forged, &["queue"], now),
                Err(Refusal::Invalid)
            );
            assert_eq!(
                verified.check(&key, &registry, &["queue"], now),
                Err(Refusal::WrongAudience)
            );
        }
        assert_eq!(verified.kept().len(), 1);
    }

    #[test]
    fn remembered_tokens_are_bounded() {
        let key = InternalKey::generate();
        let verified = VerifiedTokens::default();
        let now = now_s();
        for i in 0..MAX_VERIFIED_TOKENS as u64 + 10 {
            let token = mint_between(&key, "facade", "queue", Scope::Full, now, now + 60 + i);
            verified.check(&key, &token, &["queue"], now).unwrap();
            assert!(verified.kept().len() <= MAX_VERIFIED_TOKENS);
        }
    }

    /// A write runs to its end on a task of its own when its caller goes; a call of
    /// [`ENDS_WITH_CALLER`] (here a read) runs on the caller's task and stops with it.
    #[tokio::test]
    async fn only_calls_that_leave_nothing_half_done_end_with_their_caller() {
        use tower::{Layer as _, Service as _};
        let finished = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = finished.clone();
        let inner = tower::service_fn(move |request: http::Request<()>| {
            let seen = seen.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                seen.lock().unwrap().push(request.uri().path().to_owned());
                Ok::<_, std::convert::Infallible>(http::Response::new(()))
            }
        });
        let mut service = RunToCompletion.layer(inner);
        let write = "/orca.push.registry.v1.RegistryService/RegisterDevice";
        let read = "/orca.push.registry.v1.RegistryService/ResolveRegistrations";
        assert!(!ENDS_WITH_CALLER.contains(&write) && ENDS_WITH_CALLER.contains(&read));
        for path in [write, read] {
            let call = service.call(http::Request::get(path).body(()).unwrap());
            // The caller gives up before the handler is done.
            assert!(
                tokio::time::timeout(Duration::from_millis(5), call)
                    .await
                    .is_err()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(*finished.lock().unwrap(), [write]);
    }

    #[test]
    fn a_token_is_good_for_its_audience_only_until_it_expires() {
        let key = InternalKey::generate();
        let token = mint(
            &key,
            "support",
            "queue",
            Scope::Read,
            Duration::from_secs(60),
        );
        let claims = verify(&key, &token, "queue").unwrap();
        assert_eq!(
            (claims.sub.as_str(), claims.scope),
            ("support", Scope::Read)
        );
        assert_eq!(
            verify(&key, &token, "registry"),
            Err(Refusal::WrongAudience)
        );
        let now = now_s();
        let expired = mint_between(&key, "support", "queue", Scope::Read, now - 120, now - 60);
        assert_eq!(verify(&key, &expired, "queue"), Err(Refusal::Expired));
        assert_eq!(
            verify(&InternalKey::generate(), &token, "queue"),
            Err(Refusal::Invalid)
        );
        assert_eq!(verify(&key, "not-a-token", "queue"), Err(Refusal::Invalid));
        let mut tampered = token.clone();
        tampered.insert(tampered.len() - 5, 'x');
        assert!(verify(&key, &tampered, "queue").is_err());
    }

    /// Signs arbitrary claims, as a token minted by an older version or another tool would be.
    fn sign<T: Serialize>(key: &InternalKey, claims: &T) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(secrecy::ExposeSecret::expose_secret(&*key.0)),
        )
        .unwrap()
    }

    #[derive(Serialize)]
    struct OlderClaims<'a> {
        sub: &'a str,
        aud: &'a str,
        iat: u64,
        exp: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        scope: Option<&'a str>,
    }

    #[test]
    fn a_token_without_a_scope_is_read_only_and_an_unknown_scope_is_invalid() {
        let key = InternalKey::generate();
        let now = now_s();
        let older = OlderClaims {
            sub: "support",
            aud: "queue",
            iat: now,
            exp: now + 60,
            scope: None,
        };
        let claims = verify(&key, &sign(&key, &older), "queue").unwrap();
        assert_eq!(claims.scope, Scope::Read);
        let admin = OlderClaims {
            scope: Some("admin"),
            ..older
        };
        assert_eq!(
            verify(&key, &sign(&key, &admin), "queue"),
            Err(Refusal::Invalid)
        );
        let full = OlderClaims {
            scope: Some("full"),
            ..admin
        };
        assert_eq!(
            verify(&key, &sign(&key, &full), "queue").unwrap().scope,
            Scope::Full
        );
    }

    #[test]
    fn the_caller_must_be_named_plainly() {
        let key = InternalKey::generate();
        let ttl = Duration::from_secs(60);
        for good in [
            "facade",
            "sre-oncall",
            "team.support_2",
            "alice@example.com",
        ] {
            let token = mint(&key, good, "queue", Scope::Read, ttl);
            assert!(verify(&key, &token, "queue").is_ok(), "{good}");
        }
        let long = "x".repeat(65);
        for bad in [
            "",
            " ",
            "sre team",
            "evil\nINFO forged line",
            "é",
            long.as_str(),
        ] {
            let token = mint(&key, bad, "queue", Scope::Full, ttl);
            assert_eq!(
                verify(&key, &token, "queue"),
                Err(Refusal::BadSubject),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_token_may_not_outlive_its_scope() {
        let key = InternalKey::generate();
        let hours = |h: u64| Duration::from_secs(h * 3600);
        let read = mint(&key, "support", "queue", Scope::Read, hours(8));
        assert!(verify(&key, &read, "queue").is_ok());
        let read = mint(&key, "support", "queue", Scope::Read, hours(24));
        assert_eq!(verify(&key, &read, "queue"), Err(Refusal::TooLong));
        let full = mint(&key, "sre", "queue", Scope::Full, hours(1));
        assert!(verify(&key, &full, "queue").is_ok());
        let full = mint(&key, "sre", "queue", Scope::Full, hours(2));
        assert_eq!(verify(&key, &full, "queue"), Err(Refusal::TooLong));
        // Older tokens (no scope) are held to the read-only limit: a 24 h one is refused.
        let now = now_s();
        let older = OlderClaims {
            sub: "support",
            aud: "queue",
            iat: now,
            exp: now + 86_400,
            scope: None,
        };
        assert_eq!(
            verify(&key, &sign(&key, &older), "queue"),
            Err(Refusal::TooLong)
        );
    }

    /// Runs one call with `token` through the server layer in front of a service that answers OK:
    /// the gRPC code answered, and the caller the service saw (None: it was not reached, or saw no
    /// caller).
    async fn answer(key: &InternalKey, path: &str, token: Option<&str>) -> (tonic::Code, String) {
        use tower::{Layer as _, ServiceExt as _};
        let inner = tower::service_fn(|request: http::Request<()>| async move {
            let caller = request
                .extensions()
                .get::<Caller>()
                .map_or("nobody".to_owned(), |c| c.0.clone());
            let mut response = http::Response::new(());
            response
                .headers_mut()
                .insert("x-test-caller", caller.parse().unwrap());
            Ok::<_, std::convert::Infallible>(response)
        });
        let service = RequireToken::new(key.clone(), "registry").layer(inner);
        let mut request = http::Request::builder().uri(format!("http://registry{path}"));
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let response = service.oneshot(request.body(()).unwrap()).await.unwrap();
        let code = tonic::Status::from_header_map(response.headers())
            .map_or(tonic::Code::Ok, |status| status.code());
        let caller = response
            .headers()
            .get("x-test-caller")
            .map_or("not reached", |v| v.to_str().unwrap())
            .to_owned();
        (code, caller)
    }

    #[tokio::test]
    async fn a_read_only_token_calls_reads_only_and_a_full_one_everything() {
        let key = InternalKey::generate();
        let ttl = Duration::from_secs(60);
        let read = mint(&key, "support", "registry", Scope::Read, ttl);
        let full = mint(&key, "sender", "registry", Scope::Full, ttl);
        let ok = |caller: &str| (tonic::Code::Ok, caller.to_owned());
        let refused = |code| (code, "not reached".to_owned());
        let list = "/orca.push.registry.v1.RegistryService/ListDevices";
        let reflection = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
        for read_method in [list, reflection] {
            assert_eq!(answer(&key, read_method, Some(&read)).await, ok("support"));
            assert_eq!(answer(&key, read_method, Some(&full)).await, ok("sender"));
        }
        for write in [
            "/orca.push.registry.v1.RegistryService/GetDevicesForDelivery",
            "/orca.push.registry.v1.RegistryService/MarkDead",
            "/orca.push.registry.v1.RegistryService/DropEverything",
        ] {
            assert_eq!(
                answer(&key, write, Some(&read)).await,
                refused(tonic::Code::PermissionDenied),
                "{write}"
            );
            assert_eq!(answer(&key, write, Some(&full)).await, ok("sender"));
        }
        assert_eq!(
            answer(&key, list, None).await,
            refused(tonic::Code::Unauthenticated)
        );
        // Health stays open: reached with no token, and no caller.
        assert_eq!(
            answer(&key, "/grpc.health.v1.Health/Check", None).await,
            ok("nobody")
        );
    }

    #[tokio::test]
    async fn accepted_grpc_connections_send_small_writes_at_once() {
        use tokio_stream::StreamExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let server_side = accepted.next().await.unwrap().unwrap();
        assert!(
            server_side.nodelay().unwrap(),
            "without TCP_NODELAY every gRPC answer can wait 40 ms for a delayed ACK"
        );
    }

    #[test]
    fn configured_keys_must_be_long_enough() {
        assert_eq!(
            InternalKey::from_secret("short").unwrap_err(),
            KeyError::TooShort
        );
        assert!(InternalKey::from_secret(&"k".repeat(32)).is_ok());
        let key = InternalKey::from_secret(&"k".repeat(40)).unwrap();
        let shown = format!("{key:?}");
        assert!(
            shown.contains("REDACTED") && !shown.contains("kkkk"),
            "{shown}"
        );
    }
}
