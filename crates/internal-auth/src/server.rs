//! Server side: each call runs to completion on its own task, and carries a valid token or is
//! refused.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tonic::service::Routes;

use crate::OPEN_PREFIX;
use crate::token::{Claims, InternalKey, Refusal, now_s, verify_any};
use crate::transport::LocalCaller;

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
    "/orca.push.queue.v1.QueueService/EnqueueMany",
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
///
/// And TCP keepalive: a caller that vanished without a word (its node lost, a partition) left a
/// connection with no stream open that nothing would ever close, a descriptor and a task each.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(TCP_KEEPALIVE))
}

/// Idle time before a service's accepted connection is probed at the TCP level.
const TCP_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(60);

/// Between HTTP/2 pings on a service's accepted connections (answered within tonic's 20 s, or
/// the connection is closed), as the callers' channels ping theirs.
pub const HTTP2_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(30);

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
        .http2_keepalive_interval(Some(HTTP2_KEEPALIVE))
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
pub(crate) const MAX_VERIFIED_TOKENS: usize = 256;

/// The tokens one check has verified, by their sha256, with their claims. A caller presents the
/// same token for minutes (services re-mint theirs a minute before its five end), and verifying it
/// again on every call (base64, two JSON parses, an HMAC and their allocations) was some 9% of a
/// split registry's CPU (docs/benchmarks.md, round 29). Only a token that verified enters, so
/// everything kept was minted with the key; the expiry is checked again on every use, and the rest
/// of a verdict cannot change with time but to allow more. Keyed by a digest, so no comparison
/// with a kept token runs on what a caller sent.
#[derive(Debug, Default)]
pub(crate) struct VerifiedTokens(Mutex<std::collections::HashMap<[u8; 32], Claims>>);

impl VerifiedTokens {
    /// [`verify_any`], remembered.
    pub(crate) fn check(
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

    pub(crate) fn kept(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<[u8; 32], Claims>> {
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
