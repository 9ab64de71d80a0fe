//! `POST /v1/devices`, `GET /v1/devices`, `DELETE /v1/devices/{registrationId}`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use orca_push_proto::registry::v1 as pb;
use serde::{Deserialize, Serialize};

use crate::app::AppState;
use crate::auth::AuthenticatedHost;
use crate::error::ApiError;
use crate::json::{StrictJson, V1, refuse_nul};

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum PlatformJson {
    Ios,
    Android,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum EnvironmentJson {
    Sandbox,
    Production,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FilterJson {
    sources: Vec<String>,
    agent_states: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RegisterBody {
    #[allow(dead_code)]
    v: V1,
    device_id: String,
    platform: PlatformJson,
    token: String,
    #[serde(default)]
    apns_environment: Option<EnvironmentJson>,
    #[serde(default)]
    filter: Option<FilterJson>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Registered {
    registration_id: String,
}

/// The registry request for a register body; the registry judges every field's bounds.
pub fn registration_request(
    body: RegisterBody,
    host_fingerprint: String,
) -> pb::RegisterDeviceRequest {
    pb::RegisterDeviceRequest {
        host_fingerprint,
        device_id: body.device_id,
        platform: match body.platform {
            PlatformJson::Ios => pb::Platform::Ios,
            PlatformJson::Android => pb::Platform::Android,
        } as i32,
        token: body.token,
        apns_environment: match body.apns_environment {
            None => pb::ApnsEnvironment::Unspecified,
            Some(EnvironmentJson::Sandbox) => pb::ApnsEnvironment::Sandbox,
            Some(EnvironmentJson::Production) => pb::ApnsEnvironment::Production,
        } as i32,
        filter: body.filter.map(|f| pb::DeviceFilter {
            sources: f.sources,
            agent_states: f.agent_states,
        }),
    }
}

pub async fn register(
    State(state): State<AppState>,
    host: AuthenticatedHost,
    StrictJson(body): StrictJson<RegisterBody>,
) -> Result<Json<Registered>, ApiError> {
    let request = registration_request(body, host.fingerprint);
    let registered = state
        .backends()?
        .registry
        .clone()
        .register_device(request)
        .await?
        .into_inner();
    Ok(Json(Registered {
        registration_id: registered.registration_id,
    }))
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceJson {
    registration_id: String,
    device_id: String,
    platform: &'static str,
    dead: bool,
    /// Only for registrations stored with a filter, so older hosts see the contract's exact shape.
    #[serde(skip_serializing_if = "Option::is_none")]
    filter: Option<FilterJson>,
}

#[derive(Serialize)]
pub struct DeviceList {
    devices: Vec<DeviceJson>,
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
        .map(|d| DeviceJson {
            platform: if d.platform == pb::Platform::Android as i32 {
                "android"
            } else {
                "ios"
            },
            registration_id: d.registration_id,
            device_id: d.device_id,
            dead: d.dead,
            filter: d.filter.map(|f| FilterJson {
                sources: f.sources,
                agent_states: f.agent_states,
            }),
        })
        .collect();
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
