//! `POST /v1/devices`, `GET /v1/devices`, `DELETE /v1/devices/{registrationId}`.

use serde::{Deserialize, Serialize};

use crate::limits;
use crate::{AgentState, ApnsEnvironment, Invalid, Platform, Source, V1};

/// A phone's delivery filter. The gateway stores it so a restarted host can re-read it; the host
/// enforces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DeviceFilter {
    pub sources: Vec<Source>,
    pub agent_states: Vec<AgentState>,
}

impl DeviceFilter {
    /// Every source and every state: what a phone without a filter receives.
    pub fn everything() -> Self {
        Self {
            sources: Source::ALL.to_vec(),
            agent_states: AgentState::ALL.to_vec(),
        }
    }

    /// Sets: no value twice.
    pub fn validate(&self) -> Result<(), Invalid> {
        if has_repeats(&self.sources) || has_repeats(&self.agent_states) {
            return Err(Invalid("filter values must not repeat"));
        }
        Ok(())
    }
}

fn has_repeats<T: PartialEq>(values: &[T]) -> bool {
    values
        .iter()
        .enumerate()
        .any(|(i, v)| values[..i].contains(v))
}

/// The body of `POST /v1/devices`: an upsert keyed by (host, deviceId).
// Debug and Display never show the token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RegisterRequest {
    pub v: V1,
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 128))]
    pub device_id: String,
    pub platform: Platform,
    /// The native push token: for ios, hex pairs; for android, an FCM registration string (32 or
    /// more of `[A-Za-z0-9_:.-]`). Never logged, never returned.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 4096))]
    pub token: String,
    /// Required for iOS, refused for Android.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apns_environment: Option<ApnsEnvironment>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<DeviceFilter>,
}

/// The contract's rule for a platform's token and environment, shared by every layer.
pub fn validate_token(
    platform: Platform,
    environment: Option<ApnsEnvironment>,
    token: &str,
) -> Result<(), Invalid> {
    match platform {
        Platform::Ios if environment.is_none() => Err(Invalid("ios needs apnsEnvironment")),
        Platform::Ios if !limits::is_apns_token(token) => {
            Err(Invalid("ios token must be hex pairs"))
        }
        Platform::Android if environment.is_some() => {
            Err(Invalid("android refuses apnsEnvironment"))
        }
        Platform::Android if !limits::is_fcm_token(token) => {
            Err(Invalid("android token must be an FCM registration string"))
        }
        _ => Ok(()),
    }
}

impl RegisterRequest {
    pub fn validate(&self) -> Result<(), Invalid> {
        if !limits::is_opaque_id(&self.device_id) {
            return Err(Invalid("deviceId must be 1 to 128 characters, no NUL"));
        }
        validate_token(self.platform, self.apns_environment, &self.token)?;
        match &self.filter {
            Some(filter) => filter.validate(),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for RegisterRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisterRequest")
            .field("device_id", &self.device_id)
            .field("platform", &self.platform)
            .field("apns_environment", &self.apns_environment)
            .field("filter", &self.filter)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Display for RegisterRequest {
    /// Never shows the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} device {}", self.platform, self.device_id)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RegisterReply {
    pub registration_id: String,
}

/// One row of `GET /v1/devices`. Never carries the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub registration_id: String,
    pub device_id: String,
    pub platform: Platform,
    pub dead: bool,
    /// Only for registrations stored with a filter, so older hosts see the contract's exact shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<DeviceFilter>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeviceList {
    pub devices: Vec<Device>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ios(token: &str) -> RegisterRequest {
        RegisterRequest {
            v: V1,
            device_id: "phone".into(),
            platform: Platform::Ios,
            token: token.into(),
            apns_environment: Some(ApnsEnvironment::Sandbox),
            filter: None,
        }
    }

    #[test]
    fn platforms_have_their_own_token_rules() {
        assert!(ios("ab01").validate().is_ok());
        assert!(ios("ab0").validate().is_err());
        let mut r = ios("ab01");
        r.apns_environment = None;
        assert!(r.validate().is_err());
        r.platform = Platform::Android;
        r.token = "f".repeat(40);
        assert!(r.validate().is_ok());
        r.apns_environment = Some(ApnsEnvironment::Production);
        assert!(r.validate().is_err());
    }

    #[test]
    fn filters_are_sets_of_contract_values() {
        let body = |filter| {
            json!({"v": 1, "deviceId": "d", "platform": "ios", "token": "ab",
                   "apnsEnvironment": "sandbox", "filter": filter})
        };
        let parse = |v| {
            serde_json::from_value::<RegisterRequest>(v)
                .ok()
                .filter(|r| r.validate().is_ok())
        };
        assert!(parse(body(json!({"sources": ["plugin"], "agentStates": []}))).is_some());
        assert!(parse(body(json!({"sources": ["email"], "agentStates": []}))).is_none());
        assert!(
            parse(body(
                json!({"sources": ["plugin", "plugin"], "agentStates": []})
            ))
            .is_none()
        );
        assert!(parse(body(json!({"sources": []}))).is_none());
    }

    #[test]
    fn display_never_shows_the_token() {
        let shown = ios("deadbeef").to_string();
        assert!(!shown.contains("deadbeef"), "{shown}");
        let debugged = format!("{:?}", ios("deadbeef"));
        assert!(!debugged.contains("deadbeef"), "{debugged}");
    }
}
