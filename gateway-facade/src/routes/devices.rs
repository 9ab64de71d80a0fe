//! `POST /v1/devices`, `GET /v1/devices`, `DELETE /v1/devices/{registrationId}`.

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use orca_push_api::{Device, DeviceList, ErrorBody, RegisterReply};
use orca_push_proto::convert;
use orca_push_proto::registry::v1 as pb;

use crate::app::AppState;
use crate::auth::AuthenticatedHost;
use crate::error::ApiError;
use crate::json::{StrictJson, refuse_nul};

/// The body as the public API defines it.
pub type RegisterBody = orca_push_api::RegisterRequest;

/// The registry request for a register body; the registry judges every field's bounds (with the
/// same API crate rules), so internal callers get the same answers.
pub fn registration_request(
    body: RegisterBody,
    host_fingerprint: String,
) -> pb::RegisterDeviceRequest {
    convert::register_request(body, host_fingerprint)
}

/// Registers a phone's native push token, or replaces it: an upsert keyed by (host, deviceId).
#[utoipa::path(
    post,
    path = "/v1/devices",
    tag = "devices",
    request_body = RegisterBody,
    responses(
        (status = 200, description = "The registration's id", body = RegisterReply),
        (status = 400, description = "`invalid_request`: the body breaks the contract's schema or bounds", body = ErrorBody),
        (status = 401, description = "`invalid_token` or `session_expired`: prove the key again", body = ErrorBody),
        (status = 409, description = "`too_many_devices`: the host already holds 64 registrations", body = ErrorBody),
        (status = 413, description = "`request_too_large`: the body is over 16 KiB", body = ErrorBody),
        (status = 429, description = "`rate_limited`: a request bucket is empty (Retry-After says when to come back)", body = ErrorBody),
        (status = 500, description = "`internal`", body = ErrorBody),
        (status = 503, description = "`busy` (with Retry-After), `shutting_down`, `dependency_unavailable` or `validation_only`", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub async fn register(
    State(state): State<AppState>,
    host: AuthenticatedHost,
    StrictJson(body): StrictJson<RegisterBody>,
) -> Result<Json<RegisterReply>, ApiError> {
    let backends = state.backends()?;
    let request = registration_request(body, host.fingerprint.clone());
    let registered = backends.registry.clone().register_device(request).await;
    // Whatever the answer (a timeout may still have committed), before the host hears it.
    backends.changed(&host.fingerprint);
    let registered = registered?.into_inner();
    Ok(Json(RegisterReply {
        registration_id: registered.registration_id,
    }))
}

/// This host's registrations (at most 1024), never their tokens.
#[utoipa::path(
    get,
    path = "/v1/devices",
    tag = "devices",
    responses(
        (status = 200, description = "The host's registrations", body = DeviceList),
        (status = 401, description = "`invalid_token` or `session_expired`: prove the key again", body = ErrorBody),
        (status = 429, description = "`rate_limited`: a request bucket is empty (Retry-After says when to come back)", body = ErrorBody),
        (status = 500, description = "`internal`", body = ErrorBody),
        (status = 503, description = "`busy` (with Retry-After), `shutting_down`, `dependency_unavailable` or `validation_only`", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub async fn list(
    State(state): State<AppState>,
    host: AuthenticatedHost,
) -> Result<Json<DeviceList>, ApiError> {
    let listed = state
        .backends()?
        .registry
        .clone()
        .list_devices(pb::ListDevicesRequest {
            host_fingerprint: host.fingerprint,
        })
        .await?
        .into_inner();
    let devices = listed
        .devices
        .into_iter()
        .map(|d| {
            Ok(Device {
                platform: convert::platform_from_wire(d.platform)
                    .map_err(|_| ApiError::Internal)?,
                registration_id: d.registration_id,
                device_id: d.device_id,
                dead: d.dead,
                // A stored filter the API cannot express is left out rather than failing the list.
                filter: d.filter.and_then(|f| f.try_into().ok()),
            })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok(Json(DeviceList { devices }))
}

/// Deletes one of this host's registrations, freeing its slot.
#[utoipa::path(
    delete,
    path = "/v1/devices/{registrationId}",
    tag = "devices",
    params(("registrationId" = String, Path, description = "A registration id of this host")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, description = "`invalid_request`: the body breaks the contract's schema or bounds", body = ErrorBody),
        (status = 401, description = "`invalid_token` or `session_expired`: prove the key again", body = ErrorBody),
        (status = 404, description = "`not_found`: no such registration of this host", body = ErrorBody),
        (status = 429, description = "`rate_limited`: a request bucket is empty (Retry-After says when to come back)", body = ErrorBody),
        (status = 500, description = "`internal`", body = ErrorBody),
        (status = 503, description = "`busy` (with Retry-After), `shutting_down`, `dependency_unavailable` or `validation_only`", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub async fn delete(
    State(state): State<AppState>,
    host: AuthenticatedHost,
    registration_id: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    // A segment that does not decode to UTF-8 (`%FF`): axum's own rejection is plain text.
    let Ok(Path(registration_id)) = registration_id else {
        return Err(ApiError::InvalidRequest);
    };
    // `%00` decodes to NUL, which PostgreSQL cannot even compare: refused on every backend alike.
    refuse_nul(&registration_id)?;
    if registration_id.is_empty() || registration_id.encode_utf16().count() > 128 {
        return Err(ApiError::NotFound);
    }
    let backends = state.backends()?;
    let deleted = backends
        .registry
        .clone()
        .delete_device(pb::DeleteDeviceRequest {
            host_fingerprint: host.fingerprint.clone(),
            registration_id,
        })
        .await;
    // Whatever the answer (a timeout may still have committed), before the host hears it.
    backends.changed(&host.fingerprint);
    deleted?;
    Ok(StatusCode::NO_CONTENT)
}
