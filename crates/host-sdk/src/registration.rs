//! What the host keeps about each paired phone's push registration. Shared by the registration
//! store (which persists it) and the dispatcher (which sends by it).

use orca_push_api::{AgentState, ApnsEnvironment, DeviceFilter, Platform, Source};
use serde::{Deserialize, Serialize};

/// A phone's filter as the host holds it: the gateway's part (sources, agent states) plus the two
/// host-local flags the gateway never sees.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostFilter {
    pub sources: Vec<Source>,
    pub agent_states: Vec<AgentState>,
    /// Absent: the desktop's own notification settings gate this phone too (legacy behaviour).
    /// `false`: the phone chooses independently of the desktop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow_desktop: Option<bool>,
    /// `Some(false)`: this phone's alerts are sent silent, in requests of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sound: Option<bool>,
}

impl HostFilter {
    /// Every source and state, following the desktop, audible.
    pub fn everything() -> Self {
        Self::from(DeviceFilter::everything())
    }

    /// The part the gateway stores.
    pub fn gateway_part(&self) -> DeviceFilter {
        DeviceFilter {
            sources: self.sources.clone(),
            agent_states: self.agent_states.clone(),
        }
    }
}

impl From<DeviceFilter> for HostFilter {
    fn from(filter: DeviceFilter) -> Self {
        Self {
            sources: filter.sources,
            agent_states: filter.agent_states,
            follow_desktop: None,
            sound: None,
        }
    }
}

/// One phone's registration, as the host stores it. The token stays on this machine (in a file
/// only its user can read) so a dead-token report is matched against exactly what was registered.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Registration {
    /// The desktop's id for the paired phone.
    pub device_id: String,
    /// The gateway's id for (host, deviceId).
    pub registration_id: String,
    pub platform: Platform,
    pub token: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apns_environment: Option<ApnsEnvironment>,
    pub filter: HostFilter,
    /// Unix ms of the last successful registration.
    pub registered_at: u64,
}

impl Registration {
    /// Whether `other` names the same registration with the same token, platform and environment:
    /// the only case in which a `dead` answer about `other` may drop this record.
    pub fn same_target(&self, other: &Registration) -> bool {
        self.registration_id == other.registration_id
            && self.token == other.token
            && self.platform == other.platform
            && self.apns_environment == other.apns_environment
    }
}

impl std::fmt::Debug for Registration {
    /// Never shows the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("device_id", &self.device_id)
            .field("registration_id", &self.registration_id)
            .field("platform", &self.platform)
            .field("apns_environment", &self.apns_environment)
            .field("filter", &self.filter)
            .field("registered_at", &self.registered_at)
            .finish_non_exhaustive()
    }
}

/// A registration is used for this long after its last successful registration; only the phone
/// registering again (in the foreground) renews it.
pub const REGISTRATION_LIFETIME_MS: u64 = 7 * 24 * 60 * 60 * 1000;

impl Registration {
    /// Past its seven days without a renewal: excluded from delivery.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.registered_at.saturating_add(REGISTRATION_LIFETIME_MS)
    }
}

/// Where the dispatcher reads the registrations to send to, and reports dead ones.
/// [`crate::RegistrationStore`] is the durable one.
pub trait RegistrationSource: Send + Sync + 'static {
    /// Every registration that is not expired at `now_ms`.
    fn active(&self, now_ms: u64) -> Vec<Registration>;

    /// The gateway answered `dead` for `sent`: drop the stored record only if it still has the
    /// same registration id, token, platform and environment (a phone that re-registered a new
    /// token meanwhile keeps its new registration). Returns whether a record was dropped.
    fn drop_dead(&self, sent: &Registration) -> bool;
}
