//! Liveness (`/health`, `/healthz`: the process) and readiness (`/ready`: the services behind it).

use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use orca_push_api::{ErrorBody, Health, Ready};

use crate::app::AppState;
use crate::error::ApiError;

/// Readiness is cached this long: probes poll it, and each check is a round trip to every service.
const READY_CACHE: Duration = Duration::from_secs(1);

/// Liveness: the process answers. `deliveryProtocol` says which notification fields it takes.
#[utoipa::path(
    get,
    path = "/health",
    tag = "health",
    responses((status = 200, description = "The process answers", body = Health)),
)]
pub async fn health(State(state): State<AppState>) -> Json<Health> {
    Json(Health {
        ok: true,
        push_protocol: 1,
        delivery_protocol: orca_push_api::DELIVERY_PROTOCOL_WITH_KIND,
        mode: Some(state.mode.as_str().to_owned()),
    })
}

/// `/health` under the name Kubernetes probes use.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "health",
    responses((status = 200, description = "The process answers", body = Health)),
)]
pub async fn healthz(state: State<AppState>) -> Json<Health> {
    health(state).await
}

/// Readiness: every service behind the facade answers (cached for a second).
#[utoipa::path(
    get,
    path = "/ready",
    tag = "health",
    responses(
        (status = 200, description = "Ready", body = Ready),
        (status = 503, description = "`dependency_unavailable` or `shutting_down`", body = ErrorBody),
    ),
)]
pub async fn ready(State(state): State<AppState>) -> Result<Json<Ready>, ApiError> {
    if state.draining.is_cancelled() {
        return Err(ApiError::ShuttingDown);
    }
    let Some(backends) = state.backends_for_ready() else {
        // Validation mode runs no services: the process itself is all there is to be ready.
        return Ok(Json(Ready { ok: true }));
    };
    {
        let cached = state.ready_cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, ok)) = *cached
            && at.elapsed() < READY_CACHE
        {
            return if ok {
                Ok(Json(Ready { ok: true }))
            } else {
                Err(ApiError::DependencyUnavailable)
            };
        }
    }
    let checks = backends.endpoints.iter().map(|e| e.is_serving());
    let ok = futures::future::join_all(checks)
        .await
        .into_iter()
        .all(|serving| serving);
    *state.ready_cache.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), ok));
    if ok {
        Ok(Json(Ready { ok: true }))
    } else {
        Err(ApiError::DependencyUnavailable)
    }
}
