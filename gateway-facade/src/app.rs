//! The router, its shared state, and the middleware stack in the order requests meet it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use orca_push_telemetry::set_parent_from_headers;
use tracing::Instrument as _;

use crate::backends::Backends;
use crate::config::Mode;
use crate::error::ApiError;
use crate::limits::Limits;
use crate::routes;
use crate::sessions::SessionCheck;

/// Every POST body is capped at 16 KiB, counted as it streams in.
pub const BODY_LIMIT_BYTES: usize = 16 * 1024;

/// What every handler and middleware shares. One `Arc`: axum clones the state for every request
/// (each `State` extractor and each middleware with state), and a clone of five `Arc`s was five
/// atomic increments and, on drop, five decrements, on counters both cores write (1-2% of the
/// request threads' samples at 1,000 delivery flows, `drop_in_place<AppState>` alone 1.9%).
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

pub struct Shared {
    pub mode: Mode,
    pub backends: Option<Arc<Backends>>,
    pub limits: Arc<Limits>,
    /// The session key and the verified-session cache.
    pub sessions: Arc<SessionCheck>,
    pub ready_cache: Arc<Mutex<Option<(Instant, bool)>>>,
    /// Cancelled at SIGTERM: new `/v1` work is refused with `shutting_down`.
    pub draining: tokio_util::sync::CancellationToken,
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl AppState {
    pub fn serving(backends: Backends, limits: Arc<Limits>) -> Self {
        Self(Arc::new(Shared {
            mode: Mode::Serve,
            backends: Some(Arc::new(backends)),
            limits,
            sessions: Arc::default(),
            ready_cache: Arc::default(),
            draining: Default::default(),
        }))
    }

    pub fn validation() -> Self {
        Self(Arc::new(Shared {
            mode: Mode::Validation,
            backends: None,
            limits: Limits::new(0),
            sessions: Arc::default(),
            ready_cache: Arc::default(),
            draining: Default::default(),
        }))
    }

    /// The same state, refusing new `/v1` work once `draining` is cancelled.
    pub fn draining_at(&self, draining: tokio_util::sync::CancellationToken) -> Self {
        Self(Arc::new(Shared {
            mode: self.mode,
            backends: self.backends.clone(),
            limits: self.limits.clone(),
            sessions: self.sessions.clone(),
            ready_cache: self.ready_cache.clone(),
            draining,
        }))
    }

    pub fn backends(&self) -> Result<&Backends, ApiError> {
        self.backends.as_deref().ok_or(ApiError::ValidationOnly)
    }

    pub fn backends_for_ready(&self) -> Option<&Backends> {
        self.backends.as_deref()
    }
}

/// The serve-mode routes and their OpenAPI document, from one source: each handler's
/// `#[utoipa::path]` gives both its route and its documentation. The rate-limit and draining
/// layers are the router's, and do not change the document.
pub fn documented_routes() -> (Router<AppState>, utoipa::openapi::OpenApi) {
    use utoipa::OpenApi as _;
    use utoipa_axum::router::OpenApiRouter;
    use utoipa_axum::routes;
    let health = OpenApiRouter::<AppState>::with_openapi(crate::openapi::ApiDoc::openapi())
        .routes(routes!(routes::health::health))
        .routes(routes!(routes::health::healthz))
        .routes(routes!(routes::health::ready));
    let unauthenticated = OpenApiRouter::new()
        .routes(routes!(routes::host::challenge))
        .routes(routes!(routes::host::session));
    let authenticated = OpenApiRouter::new()
        .routes(routes!(routes::devices::register, routes::devices::list))
        .routes(routes!(routes::devices::delete))
        .routes(routes!(routes::send::send));
    health
        .merge(unauthenticated)
        .merge(authenticated)
        .split_for_parts()
}

/// The public HTTP API: the documented routes, `/openapi.json`, and the layers.
pub fn router(state: AppState) -> Router {
    let (documented, _) = documented_routes();
    let routes = documented.route("/openapi.json", get(openapi_json));
    let routes = match state.mode {
        Mode::Serve => routes
            // Before the body is read: a refused client costs no parsing.
            .layer(middleware::from_fn_with_state(
                state.clone(),
                unauthenticated_bucket,
            ))
            // Outermost on /v1: a draining instance takes no new work at all.
            .layer(middleware::from_fn_with_state(
                state.clone(),
                refuse_when_draining,
            )),
        // Every /v1 route, known or not, answers `validation_only`.
        Mode::Validation => routes
            .route("/v1/{*rest}", axum::routing::any(validation_only))
            .layer(middleware::from_fn(validation_only_on_v1)),
    };
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        // Outermost first, as a request meets them: panics become a bare 500 `internal`; every
        // request gets an HTTP server span; bodies are cut off at the cap while streaming.
        .layer(
            tower::ServiceBuilder::new()
                .layer(tower_http::catch_panic::CatchPanicLayer::custom(on_panic))
                .layer(middleware::from_fn(trace_http))
                .layer(DefaultBodyLimit::max(BODY_LIMIT_BYTES)),
        )
}

fn is_v1(request: &Request) -> bool {
    request.uri().path().starts_with("/v1/")
}

/// The two routes a host calls before it has a session.
fn is_host_proof(request: &Request) -> bool {
    matches!(
        request.uri().path(),
        "/v1/host/challenge" | "/v1/host/session"
    )
}

async fn validation_only_on_v1(request: Request, next: Next) -> Response {
    if is_v1(&request) {
        return ApiError::ValidationOnly.into_response();
    }
    next.run(request).await
}

/// `GET /openapi.json`: the document of the public API (also committed as docs/openapi.json).
async fn openapi_json() -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )],
        crate::openapi::document_json(),
    )
        .into_response()
}

async fn refuse_when_draining(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if is_v1(&request) && state.draining.is_cancelled() {
        return ApiError::ShuttingDown.into_response();
    }
    next.run(request).await
}

/// Challenge and session share one token bucket per client IP.
async fn unauthenticated_bucket(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if !is_host_proof(&request) {
        return next.run(request).await;
    }
    let client = state.limits.client(request.headers());
    match state.limits.admit_unauthenticated(&client) {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}

/// A known path with another method: `not_found`, as an unknown route is, except that validation
/// mode answers every `/v1` request `validation_only`.
async fn method_not_allowed(State(state): State<AppState>, uri: axum::http::Uri) -> ApiError {
    if state.mode == Mode::Validation && uri.path().starts_with("/v1/") {
        ApiError::ValidationOnly
    } else {
        ApiError::NotFound
    }
}

async fn validation_only() -> ApiError {
    ApiError::ValidationOnly
}

fn on_panic(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("a request handler panicked");
    ApiError::Internal.into_response()
}

/// One server span per request, continuing an incoming `traceparent`, with the OpenTelemetry HTTP
/// semantic-convention fields. The route template is recorded, never the raw path (it can carry
/// registration ids).
async fn trace_http(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = request.method().as_str().to_owned();
    let span = tracing::info_span!(
        "http.server",
        otel.name = format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        // A send's resolve: `memory` or `registry` (`resolves::ResolvedHosts::resolve`), so that
        // a trace without the registry's hop says why.
        orca.resolve.source = tracing::field::Empty,
    );
    set_parent_from_headers(&span, request.headers());
    let started = std::time::Instant::now();
    async move {
        let response = next.run(request).await;
        let status = response.status();
        let span = tracing::Span::current();
        span.record("http.response.status_code", status.as_u16());
        if status.is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
        let status = status.as_u16().to_string();
        metrics::counter!("orca_push_http_requests_total", "route" => route.clone(), "status" => status.clone())
            .increment(1);
        metrics::histogram!("orca_push_http_request_duration_seconds", "route" => route, "status" => status)
            .record(started.elapsed().as_secs_f64());
        response
    }
    .instrument(span)
    .await
}
