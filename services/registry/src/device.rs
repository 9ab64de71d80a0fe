//! What a registration is, and the contract's bounds on each of its fields.

use crate::error::RegistryError;

/// A host may hold at most this many registrations (distinct device ids).
pub const MAX_DEVICES_PER_HOST: i64 = 64;
/// `GET /v1/devices` answers at most this many rows.
pub const LIST_LIMIT: i64 = 1024;
/// Internal calls may ask about at most this many ids at once.
pub const MAX_IDS_PER_CALL: usize = 1024;

pub const SOURCES: [&str; 3] = ["agent-task-complete", "terminal-bell", "plugin"];
pub const AGENT_STATES: [&str; 2] = ["needs-input", "finished"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    Ios,
    Android,
}

impl Platform {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ios => "ios",
            Self::Android => "android",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "ios" => Some(Self::Ios),
            "android" => Some(Self::Android),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApnsEnvironment {
    Sandbox,
    Production,
}

impl ApnsEnvironment {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sandbox => "sandbox",
            Self::Production => "production",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "sandbox" => Some(Self::Sandbox),
            "production" => Some(Self::Production),
            _ => None,
        }
    }
}

/// The host's delivery filter: stored so a restarted host can re-read it, enforced by the host.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceFilter {
    pub sources: Vec<String>,
    pub agent_states: Vec<String>,
}

impl DeviceFilter {
    fn validate(&self) -> Result<(), RegistryError> {
        is_set_of(&self.sources, &SOURCES)?;
        is_set_of(&self.agent_states, &AGENT_STATES)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_owned())
    }

    pub fn from_json(json: &str) -> Option<Self> {
        serde_json::from_str(json).ok()
    }
}

fn is_set_of(values: &[String], allowed: &[&str]) -> Result<(), RegistryError> {
    for (i, value) in values.iter().enumerate() {
        if !allowed.contains(&value.as_str()) {
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

/// Length as JavaScript counts it (UTF-16 code units), which is how the contract's bounds are meant.
pub fn js_len(value: &str) -> usize {
    value.encode_utf16().count()
}

/// An opaque id (deviceId, registrationId): 1 to 128 characters, none of them NUL.
pub fn is_opaque_id(value: &str) -> bool {
    (1..=128).contains(&js_len(value)) && !has_nul(value)
}

/// PostgreSQL refuses U+0000 in text (SQLite would store it): refused before any SQL, so both
/// backends answer `invalid_request` alike.
pub fn has_nul(value: &str) -> bool {
    value.contains('\0')
}

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
        match self.platform {
            Platform::Ios => {
                if self.apns_environment.is_none() {
                    return Err(RegistryError::InvalidRequest("ios needs apnsEnvironment"));
                }
                let t = self.token.as_bytes();
                if t.is_empty()
                    || t.len() > 4096
                    || !t.len().is_multiple_of(2)
                    || !t.iter().all(u8::is_ascii_hexdigit)
                {
                    return Err(RegistryError::InvalidRequest("ios token must be hex pairs"));
                }
            }
            Platform::Android => {
                if self.apns_environment.is_some() {
                    return Err(RegistryError::InvalidRequest(
                        "android refuses apnsEnvironment",
                    ));
                }
                let t = self.token.as_bytes();
                let allowed =
                    |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b':' | b'.' | b'-');
                if !(32..=4096).contains(&t.len()) || !t.iter().all(allowed) {
                    return Err(RegistryError::InvalidRequest(
                        "android token must be an FCM registration string",
                    ));
                }
            }
        }
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
