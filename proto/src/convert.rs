//! Conversions between the public API's types (`orca-push-api`) and the wire messages, written
//! once here so the facade and the services cannot disagree on them.

use orca_push_api as api;

use crate::queue::v1 as queue;
use crate::registry::v1 as registry;

/// A wire value outside what the contract allows (an unspecified enum, an unknown string).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfContract(pub &'static str);

impl From<api::Platform> for registry::Platform {
    fn from(platform: api::Platform) -> Self {
        match platform {
            api::Platform::Ios => Self::Ios,
            api::Platform::Android => Self::Android,
        }
    }
}

pub fn platform_from_wire(value: i32) -> Result<api::Platform, OutOfContract> {
    match registry::Platform::try_from(value) {
        Ok(registry::Platform::Ios) => Ok(api::Platform::Ios),
        Ok(registry::Platform::Android) => Ok(api::Platform::Android),
        _ => Err(OutOfContract("platform")),
    }
}

pub fn environment_to_wire(environment: Option<api::ApnsEnvironment>) -> i32 {
    let wire = match environment {
        None => registry::ApnsEnvironment::Unspecified,
        Some(api::ApnsEnvironment::Sandbox) => registry::ApnsEnvironment::Sandbox,
        Some(api::ApnsEnvironment::Production) => registry::ApnsEnvironment::Production,
    };
    wire as i32
}

pub fn environment_from_wire(value: i32) -> Result<Option<api::ApnsEnvironment>, OutOfContract> {
    match registry::ApnsEnvironment::try_from(value) {
        Ok(registry::ApnsEnvironment::Unspecified) => Ok(None),
        Ok(registry::ApnsEnvironment::Sandbox) => Ok(Some(api::ApnsEnvironment::Sandbox)),
        Ok(registry::ApnsEnvironment::Production) => Ok(Some(api::ApnsEnvironment::Production)),
        Err(_) => Err(OutOfContract("apns environment")),
    }
}

impl From<api::DeviceFilter> for registry::DeviceFilter {
    fn from(filter: api::DeviceFilter) -> Self {
        Self {
            sources: filter
                .sources
                .iter()
                .map(|s| s.as_str().to_owned())
                .collect(),
            agent_states: filter
                .agent_states
                .iter()
                .map(|s| s.as_str().to_owned())
                .collect(),
        }
    }
}

impl TryFrom<registry::DeviceFilter> for api::DeviceFilter {
    type Error = OutOfContract;

    fn try_from(filter: registry::DeviceFilter) -> Result<Self, Self::Error> {
        let outside = OutOfContract("filter value outside the contract's enums");
        Ok(Self {
            sources: filter
                .sources
                .iter()
                .map(|s| api::Source::parse(s).ok_or(outside))
                .collect::<Result<_, _>>()?,
            agent_states: filter
                .agent_states
                .iter()
                .map(|s| api::AgentState::parse(s).ok_or(outside))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// A public registration body, for the host `host_fingerprint` the facade authenticated.
pub fn register_request(
    body: api::RegisterRequest,
    host_fingerprint: String,
) -> registry::RegisterDeviceRequest {
    registry::RegisterDeviceRequest {
        host_fingerprint,
        device_id: body.device_id,
        platform: registry::Platform::from(body.platform) as i32,
        token: body.token,
        apns_environment: environment_to_wire(body.apns_environment),
        filter: body.filter.map(Into::into),
    }
}

impl From<api::Kind> for queue::Kind {
    fn from(kind: api::Kind) -> Self {
        match kind {
            api::Kind::Alert => Self::Alert,
            api::Kind::Dismiss => Self::Dismiss,
        }
    }
}

impl From<api::Notification> for queue::Notification {
    /// `sound` is not part of the event: it travels per recipient (`Recipient.silent`).
    fn from(n: api::Notification) -> Self {
        Self {
            kind: queue::Kind::from(n.kind()) as i32,
            notification_id: n.notification_id,
            notification_seq: n.notification_seq,
            notification_epoch: n.notification_epoch,
            source: n.source.as_str().to_owned(),
            agent_state: n.agent_state.map(|s| s.as_str().to_owned()),
            title: n.title,
            body: n.body,
            worktree_id: n.worktree_id,
            expires_at_ms: n.expires_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_enum_round_trips_the_wire() {
        for platform in api::Platform::ALL {
            let wire = registry::Platform::from(*platform) as i32;
            assert_eq!(platform_from_wire(wire), Ok(*platform));
        }
        assert!(platform_from_wire(0).is_err());
        for environment in [
            None,
            Some(api::ApnsEnvironment::Sandbox),
            Some(api::ApnsEnvironment::Production),
        ] {
            let wire = environment_to_wire(environment);
            assert_eq!(environment_from_wire(wire), Ok(environment));
        }
        assert!(environment_from_wire(99).is_err());
        let filter = api::DeviceFilter::everything();
        let wire = registry::DeviceFilter::from(filter.clone());
        assert_eq!(api::DeviceFilter::try_from(wire), Ok(filter));
        let unknown = registry::DeviceFilter {
            sources: vec!["email".into()],
            agent_states: vec![],
        };
        assert!(api::DeviceFilter::try_from(unknown).is_err());
    }
}
