//! `POST /v1/devices`, `GET /v1/devices`, `DELETE /v1/devices/{registrationId}`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use orca_push_api::{Device, DeviceList, RegisterReply};
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

pub async fn register(
    State(state): State<AppState>,
    host: AuthenticatedHost,
    StrictJson(body): StrictJson<RegisterBody>,
) -> Result<Json<RegisterReply>, ApiError> {
    let request = registration_request(body, host.fingerprint);
    let registered = state
        .backends()?
        .registry
        .clone()
        .register_device(request)
        .await?
        .into_inner();
    Ok(Json(RegisterReply {
        registration_id: registered.registration_id,
    }))
}

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

pub async fn delete(
    State(state): State<AppState>,
    host: AuthenticatedHost,
    Path(registration_id): Path<String>,
) -> Result<StatusCode, ApiError> {
    // `%00` decodes to NUL, which PostgreSQL cannot even compare: refused on every backend alike.
    refuse_nul(&registration_id)?;
    if registration_id.is_empty() || registration_id.encode_utf16().count() > 128 {
        return Err(ApiError::NotFound);
    }
    state
        .backends()?
        .registry
        .clone()
        .delete_device(pb::DeleteDeviceRequest {
            host_fingerprint: host.fingerprint,
            registration_id,
        })
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
