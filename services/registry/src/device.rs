//! What a registration is, and the contract's bounds on each of its fields.

use crate::error::RegistryError;

/// A host may hold at most this many registrations (distinct device ids).
pub const MAX_DEVICES_PER_HOST: i64 = orca_push_api::limits::MAX_DEVICES_PER_HOST as i64;
/// `GET /v1/devices` answers at most this many rows.
pub const LIST_LIMIT: i64 = orca_push_api::limits::LIST_LIMIT as i64;
/// Internal calls may ask about at most this many ids at once.
pub const MAX_IDS_PER_CALL: usize = 1024;

pub const SOURCES: [&str; 3] = ["agent-task-complete", "terminal-bell", "plugin"];
pub const AGENT_STATES: [&str; 2] = ["needs-input", "finished"];

/// The contract's enums, from the API crate that every layer shares.
pub use orca_push_api::{ApnsEnvironment, Platform};

/// The host's delivery filter: stored so a restarted host can re-read it, enforced by the host.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceFilter {
    pub sources: Vec<String>,
    pub agent_states: Vec<String>,
}

impl DeviceFilter {
    fn validate(&self) -> Result<(), RegistryError> {
        is_set_of(&self.sources, |s| orca_push_api::Source::parse(s).is_some())?;
        is_set_of(&self.agent_states, |s| {
            orca_push_api::AgentState::parse(s).is_some()
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_owned())
    }

    pub fn from_json(json: &str) -> Option<Self> {
        serde_json::from_str(json).ok()
    }
}

fn is_set_of(values: &[String], known: impl Fn(&str) -> bool) -> Result<(), RegistryError> {
    for (i, value) in values.iter().enumerate() {
        if !known(value) {
            return Err(RegistryError::InvalidRequest(
                "filter value outside the contract's enums",
            ));
        }
        if values[..i].contains(value) {
            return Err(RegistryError::InvalidRequest(
                "filter values must not repeat",
            ));
        }
    }
    Ok(())
}

/// One registration as a host asks for it.
#[derive(Debug, Clone)]
pub struct Registration {
    pub host_fingerprint: String,
    pub device_id: String,
    pub platform: Platform,
    pub token: String,
    pub apns_environment: Option<ApnsEnvironment>,
    pub filter: Option<DeviceFilter>,
}

pub use orca_push_api::limits::{has_nul, is_opaque_id, utf16_len as js_len};

/// A host fingerprint as the auth service derives it: 1 to 64 bytes, no NUL.
pub fn is_host_fingerprint(value: &str) -> bool {
    (1..=64).contains(&value.len()) && !has_nul(value)
}

impl Registration {
    pub fn validate(&self) -> Result<(), RegistryError> {
        if !is_host_fingerprint(&self.host_fingerprint) {
            return Err(RegistryError::InvalidRequest("host fingerprint"));
        }
        if !is_opaque_id(&self.device_id) {
            return Err(RegistryError::InvalidRequest(
                "deviceId must be 1 to 128 characters, no NUL",
            ));
        }
        orca_push_api::devices::validate_token(self.platform, self.apns_environment, &self.token)
            .map_err(|invalid| RegistryError::InvalidRequest(invalid.0))?;
        if let Some(filter) = &self.filter {
            filter.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ios(token: &str) -> Registration {
        Registration {
            host_fingerprint: "D20lU_8MD0R64gLt".into(),
            device_id: "phone-1".into(),
            platform: Platform::Ios,
            token: token.into(),
            apns_environment: Some(ApnsEnvironment::Sandbox),
            filter: None,
        }
    }

    #[test]
    fn ios_tokens_are_even_runs_of_hex() {
        assert!(ios("ab").validate().is_ok());
        assert!(ios(&"aB09".repeat(1024)).validate().is_ok());
        for bad in ["", "a", "abc", "zz", &"ab".repeat(2049)] {
            assert!(ios(bad).validate().is_err(), "{bad}");
        }
        let mut no_env = ios("ab");
        no_env.apns_environment = None;
        assert!(no_env.validate().is_err());
    }

    #[test]
    fn android_tokens_are_fcm_strings_without_an_environment() {
        let mut r = ios("ab");
        r.platform = Platform::Android;
        r.apns_environment = None;
        r.token = "a".repeat(31);
        assert!(r.validate().is_err());
        r.token = "fcm-Token_1:abc.def".repeat(2);
        assert!(r.validate().is_ok());
        r.token.push('/');
        assert!(r.validate().is_err());
        r.token = "a".repeat(32);
        r.apns_environment = Some(ApnsEnvironment::Production);
        assert!(r.validate().is_err());
    }

    #[test]
    fn device_ids_are_1_to_128_utf16_units() {
        let mut r = ios("ab");
        r.device_id = "x".repeat(128);
        assert!(r.validate().is_ok());
        r.device_id = "x".repeat(129);
        assert!(r.validate().is_err());
        r.device_id = "😀".repeat(65); // 130 UTF-16 units
        assert!(r.validate().is_err());
        r.device_id = String::new();
        assert!(r.validate().is_err());
    }

    #[test]
    fn nul_is_refused_in_every_string() {
        let mut r = ios("ab");
        r.device_id = "phone\0".into();
        assert!(r.validate().is_err());
        let mut r = ios("ab\0");
        assert!(r.validate().is_err());
        r = ios("ab");
        r.host_fingerprint = "D20lU_8MD0R64g\0t".into();
        assert!(r.validate().is_err());
        r = ios("ab");
        r.platform = Platform::Android;
        r.apns_environment = None;
        r.token = format!("{}\0", "a".repeat(40));
        assert!(r.validate().is_err());
        assert!(!is_opaque_id("reg\0"));
        assert!(is_opaque_id("reg"));
    }

    #[test]
    fn filters_are_sets_of_contract_values() {
        let mut r = ios("ab");
        r.filter = Some(DeviceFilter {
            sources: vec!["plugin".into(), "terminal-bell".into()],
            agent_states: vec!["needs-input".into()],
        });
        assert!(r.validate().is_ok());
        r.filter = Some(DeviceFilter {
            sources: vec!["plugin".into(), "plugin".into()],
            agent_states: vec![],
        });
        assert!(r.validate().is_err());
        r.filter = Some(DeviceFilter {
            sources: vec!["email".into()],
            agent_states: vec![],
        });
        assert!(r.validate().is_err());
        r.filter = Some(DeviceFilter {
            sources: vec![],
            agent_states: vec!["working".into()],
        });
        assert!(r.validate().is_err());
    }
}
