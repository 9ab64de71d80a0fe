//! Which phones an event goes to: the agent-state mapping and each phone's filter.

use orca_push_api::limits::is_opaque_id;
use orca_push_api::{AgentState, Kind, Notification};

use super::{DispatchEvent, Skip};
use crate::Registration;

/// The desktop's agent state, as the gateway knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mapped {
    /// The agent is still at work: the event is not final and sends no push at all.
    NotFinal,
    /// `None` is the contract's `agentState: null` (a source without an agent).
    State(Option<AgentState>),
}

/// blocked/waiting → needs-input; working/running/busy → not final; any other state → finished.
/// Case and surrounding spaces are ignored so a "Working" never reads as finished.
pub(super) fn map_agent_state(raw: Option<&str>) -> Mapped {
    let Some(raw) = raw else {
        return Mapped::State(None);
    };
    match raw.trim().to_ascii_lowercase().as_str() {
        // "needs-input" is already the gateway's word; reading it as "finished" would mislabel it.
        "blocked" | "waiting" | "needs-input" => Mapped::State(Some(AgentState::NeedsInput)),
        "working" | "running" | "busy" => Mapped::NotFinal,
        _ => Mapped::State(Some(AgentState::Finished)),
    }
}

/// The desktop's agent state as a gateway notification carries it: `None` when the agent is still
/// working (no push at all), `Some(None)` for `agentState: null`. What the CLI's direct send uses.
pub fn gateway_agent_state(raw: Option<&str>) -> Option<Option<AgentState>> {
    match map_agent_state(raw) {
        Mapped::NotFinal => None,
        Mapped::State(state) => Some(state),
    }
}

/// Whether `registration` takes `event` (with its mapped state) by its own filter.
pub(super) fn check(
    registration: &Registration,
    event: &DispatchEvent,
    state: Option<AgentState>,
    now_ms: u64,
) -> Result<(), Skip> {
    let filter = &registration.filter;
    if registration.is_expired(now_ms) {
        return Err(Skip::RegistrationExpired);
    }
    if !is_opaque_id(&registration.registration_id) {
        return Err(Skip::InvalidRegistrationId);
    }
    if !filter.sources.contains(&event.source) {
        return Err(Skip::Source);
    }
    // A dismissal withdraws an alert the phone may hold whatever the desktop's switches and the
    // agent's state are now (an alert sent while it was blocked is dismissed once it is done).
    if event.kind == orca_push_api::Kind::Dismiss {
        return Ok(());
    }
    // Absent means the legacy behaviour: the desktop's switches gate the phone too.
    if filter.follow_desktop != Some(false) && !event.desktop_allowed {
        return Err(Skip::DesktopDisabled);
    }
    if let Some(state) = state
        && !filter.agent_states.contains(&state)
    {
        return Err(Skip::AgentState);
    }
    Ok(())
}

/// `sound: Some(false)`: this phone's alerts go silent, in requests of their own.
pub(super) fn is_silent(registration: &Registration) -> bool {
    registration.filter.sound == Some(false)
}

/// The notification as sent to a gateway of the given capability: `kind`, `expiresAt` and `sound`
/// only for a gateway that takes them (older ones refuse unknown fields).
pub(super) fn notification(
    event: &DispatchEvent,
    state: Option<AgentState>,
    with_kind: bool,
    silent: bool,
) -> Notification {
    Notification {
        notification_id: event.notification_id.clone(),
        notification_seq: event.notification_seq,
        notification_epoch: event.notification_epoch.clone(),
        source: event.source,
        agent_state: state,
        title: event.title.clone(),
        body: event.body.clone(),
        worktree_id: event.worktree_id.clone(),
        // Alert is the default; leaving it out keeps bytes inside the 3000-byte cap.
        kind: (with_kind && event.kind == Kind::Dismiss).then_some(Kind::Dismiss),
        expires_at: event.expires_at.filter(|_| with_kind),
        sound: (with_kind && silent).then_some(false),
    }
}

/// The contract's bounds on a notification, including its JSON size cap (which only
/// `SendRequest::validate` checks).
pub(super) fn is_valid(notification: &Notification) -> bool {
    notification.validate().is_ok()
        && notification.json_len() <= orca_push_api::limits::MAX_NOTIFICATION_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_maps_agent_states_as_the_contract_says() {
        let needs = Mapped::State(Some(AgentState::NeedsInput));
        let finished = Mapped::State(Some(AgentState::Finished));
        for (raw, want) in [
            ("blocked", needs),
            ("waiting", needs),
            ("needs-input", needs),
            (" Blocked ", needs),
            ("working", Mapped::NotFinal),
            ("running", Mapped::NotFinal),
            ("busy", Mapped::NotFinal),
            ("Working", Mapped::NotFinal),
            ("done", finished),
            ("finished", finished),
            ("idle", finished),
            ("", finished),
        ] {
            assert_eq!(map_agent_state(Some(raw)), want, "{raw:?}");
        }
        assert_eq!(map_agent_state(None), Mapped::State(None));
    }
}
