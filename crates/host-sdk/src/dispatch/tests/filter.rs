//! Which phones get an event: sources, agent states, followDesktop, expiry, validity.

use orca_push_api::{AgentState, Kind, SendStatus, Source};

use super::*;
use crate::dispatch::{Outcome, Skip};

#[tokio::test(start_paused = true)]
async fn source_must_be_in_the_phones_filter() {
    let bells_only = with_filter(0, |f| f.sources = vec![Source::TerminalBell]);
    let h = harness(vec![bells_only, phone(1)], 2);
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::Source));
    assert_eq!(report.sent_ids(), ["reg-1"]);
    assert_eq!(ids(&h.gateway.requests()[0]), ["reg-1"]);
}

#[tokio::test(start_paused = true)]
async fn blocked_and_waiting_send_needs_input_other_final_states_finished() {
    let h = harness(phones(1), 2);
    for (i, (raw, want)) in [
        ("blocked", AgentState::NeedsInput),
        ("waiting", AgentState::NeedsInput),
        ("done", AgentState::Finished),
        ("exited", AgentState::Finished),
    ]
    .into_iter()
    .enumerate()
    {
        let mut e = event(10_000 * i as u64);
        e.agent_state = Some(raw.to_owned());
        let report = h.dispatcher.dispatch(e).await;
        assert_eq!(report.sent_ids(), ["reg-0"], "{raw}");
        let sent = h.gateway.requests().pop().unwrap();
        assert_eq!(sent.notification.agent_state, Some(want), "{raw}");
    }
}

#[tokio::test(start_paused = true)]
async fn working_running_busy_send_no_push_at_all() {
    let h = harness(phones(2), 2);
    for raw in ["working", "running", "busy"] {
        let mut e = event(0);
        e.agent_state = Some(raw.to_owned());
        let report = h.dispatcher.dispatch(e).await;
        assert!(report.not_final, "{raw}");
        assert!(report.sent_ids().is_empty() && report.skipped.is_empty());
    }
    assert!(h.gateway.requests().is_empty());
    assert_eq!(h.gateway.health_calls(), 0);
    // Not final is not a failure either.
    assert!(h.dispatcher.failure_counts().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_dismissal_goes_even_while_the_agent_works_again() {
    let h = harness(phones(1), 2);
    let mut e = event(0);
    e.kind = Kind::Dismiss;
    e.agent_state = Some("working".to_owned());
    let report = h.dispatcher.dispatch(e).await;
    assert!(!report.not_final);
    assert_eq!(report.sent_ids(), ["reg-0"]);
    let sent = h.gateway.requests().pop().unwrap();
    assert_eq!(sent.notification.kind, Some(Kind::Dismiss));
    assert_eq!(sent.notification.agent_state, None);
}

/// A phone that takes only needs-input alerts got one while the agent was blocked; the dismissal
/// comes once the agent is done, with the desktop's switches off by then: it still goes, or the
/// stale alert would stay on the phone.
#[tokio::test(start_paused = true)]
async fn a_dismissal_passes_the_state_filter_and_the_desktops_switches() {
    let needs_input = with_filter(0, |f| f.agent_states = vec![AgentState::NeedsInput]);
    let h = harness(vec![needs_input], 2);
    let mut e = event(0);
    e.kind = Kind::Dismiss;
    e.agent_state = Some("done".to_owned());
    let report = h.dispatcher.dispatch(e.clone()).await;
    assert_eq!(report.sent_ids(), ["reg-0"]);
    e.desktop_allowed = false;
    let report = h.dispatcher.dispatch(e.clone()).await;
    assert_eq!(report.sent_ids(), ["reg-0"]);
    // An alert of that state is still filtered, as is a dismissal of a source the phone never takes.
    e.kind = Kind::Alert;
    e.desktop_allowed = true;
    let report = h.dispatcher.dispatch(e.clone()).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::AgentState));
    let bells_only = with_filter(0, |f| f.sources = vec![Source::TerminalBell]);
    let h = harness(vec![bells_only], 2);
    e.kind = Kind::Dismiss;
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::Source));
}

#[tokio::test(start_paused = true)]
async fn no_agent_state_is_sent_as_null_and_the_agent_state_filter_does_not_apply() {
    let no_states = with_filter(0, |f| f.agent_states.clear());
    let h = harness(vec![no_states], 2);
    let mut bell = event(0);
    bell.source = Source::TerminalBell;
    bell.agent_state = None;
    bell.notification_id = None;
    let report = h.dispatcher.dispatch(bell).await;
    assert_eq!(report.sent_ids(), ["reg-0"]);
    let sent = &h.gateway.requests()[0];
    assert_eq!(json(sent)["agentState"], serde_json::Value::Null);
    assert!(json(sent).as_object().unwrap().contains_key("agentState"));
}

#[tokio::test(start_paused = true)]
async fn the_mapped_state_must_be_in_the_phones_filter() {
    let needs_input_only = with_filter(0, |f| f.agent_states = vec![AgentState::NeedsInput]);
    let h = harness(vec![needs_input_only], 2);
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::AgentState));
    let mut blocked = event(1_000);
    blocked.agent_state = Some("blocked".to_owned());
    let report = h.dispatcher.dispatch(blocked).await;
    assert_eq!(report.sent_ids(), ["reg-0"]);
}

#[tokio::test(start_paused = true)]
async fn follow_desktop_absent_or_true_obeys_the_desktop_switch_false_ignores_it() {
    let h = harness(
        vec![
            phone(0),
            with_filter(1, |f| f.follow_desktop = Some(true)),
            with_filter(2, |f| f.follow_desktop = Some(false)),
        ],
        2,
    );
    let mut disabled = event(0);
    disabled.desktop_allowed = false;
    let report = h.dispatcher.dispatch(disabled).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::DesktopDisabled));
    assert_eq!(report.skipped.get("reg-1"), Some(&Skip::DesktopDisabled));
    assert_eq!(report.sent_ids(), ["reg-2"]);

    let report = h.dispatcher.dispatch(event(10_000)).await;
    assert_eq!(report.sent_ids(), ["reg-0", "reg-1", "reg-2"]);
}

#[tokio::test(start_paused = true)]
async fn expired_registrations_are_skipped_even_if_the_source_lists_them() {
    let mut stale = phone(0);
    stale.registered_at = BASE_MS - crate::REGISTRATION_LIFETIME_MS;
    let h = harness(vec![stale, phone(1)], 2);
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(
        report.skipped.get("reg-0"),
        Some(&Skip::RegistrationExpired)
    );
    assert_eq!(report.sent_ids(), ["reg-1"]);
}

#[tokio::test(start_paused = true)]
async fn a_registration_id_the_contract_refuses_is_skipped_not_sent() {
    let mut broken = phone(0);
    broken.registration_id = "r".repeat(129);
    let h = harness(vec![broken.clone(), phone(1)], 2);
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(
        report.skipped.get(&broken.registration_id),
        Some(&Skip::InvalidRegistrationId)
    );
    // The other phone's request is still valid and sent.
    assert_eq!(report.sent_ids(), ["reg-1"]);
}

#[tokio::test(start_paused = true)]
async fn a_registration_listed_twice_is_sent_once() {
    let h = harness(vec![phone(0), phone(0)], 2);
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(report.sent_ids(), ["reg-0"]);
}

#[tokio::test(start_paused = true)]
async fn an_event_past_its_deadline_is_not_sent() {
    let h = harness(phones(1), 2);
    let mut late = event(0);
    late.expires_at = Some(BASE_MS as i64);
    let report = h.dispatcher.dispatch(late).await;
    assert!(report.event_expired);
    assert!(h.gateway.requests().is_empty());
}

#[tokio::test(start_paused = true)]
async fn invalid_events_are_counted_not_truncated_and_not_sent() {
    let h = harness(phones(1), 2);
    let mut long_title = event(0);
    long_title.title = "t".repeat(81);
    let mut oversized = event(0);
    oversized.notification_id = Some("n".repeat(2048));
    oversized.worktree_id = Some("w".repeat(2048));
    let mut empty_title = event(0);
    empty_title.title.clear();
    for broken in [long_title, oversized, empty_title] {
        let report = h.dispatcher.dispatch(broken).await;
        assert!(report.invalid_event);
        assert!(report.sent_ids().is_empty());
    }
    assert!(h.gateway.requests().is_empty());
    assert_eq!(h.gateway.health_calls(), 0);
    assert_eq!(h.dispatcher.failure_counts()["invalid_event"], 3);
    // None of them opened the phone's burst window.
    let report = h.dispatcher.dispatch(event(1)).await;
    assert_eq!(
        report.outcomes["reg-0"],
        Outcome::Status(SendStatus::Queued)
    );
}

#[tokio::test(start_paused = true)]
async fn an_event_only_the_full_notification_breaks_is_invalid_too() {
    // A dismissal without an id passes as a bare alert but not as what a new gateway is sent.
    let h = harness(phones(1), 2);
    let mut dismiss = event(0);
    dismiss.kind = Kind::Dismiss;
    dismiss.notification_id = None;
    let report = h.dispatcher.dispatch(dismiss).await;
    assert!(report.invalid_event);
    assert!(h.gateway.requests().is_empty());

    // The silent variant's extra bytes push this one over the 3000-byte cap.
    let silent = with_filter(1, |f| f.sound = Some(false));
    let h = harness(vec![silent], 2);
    let mut e = event(0);
    e.worktree_id = Some("w".repeat(2048));
    e.body = "b".repeat(180);
    let full = |e: &DispatchEvent| {
        crate::dispatch::select::notification(e, Some(AgentState::Finished), true, false)
    };
    let room = 3000 - full(&e).json_len();
    e.notification_id = Some(format!(
        "{}{}",
        e.notification_id.unwrap(),
        "n".repeat(room)
    ));
    let base = full(&e);
    assert_eq!(base.json_len(), 3000);
    let report = h.dispatcher.dispatch(e.clone()).await;
    assert!(!report.invalid_event, "valid for a phone that wants sound");
    assert_eq!(report.skipped.get("reg-1"), Some(&Skip::SilentTooLarge));
    assert!(h.gateway.requests().is_empty());
    // Beside a phone that wants sound, only the silent one misses it.
    let silent = with_filter(1, |f| f.sound = Some(false));
    let h = harness(vec![phone(0), silent], 2);
    let report = h.dispatcher.dispatch(e).await;
    assert!(!report.invalid_event);
    assert_eq!(report.skipped.get("reg-1"), Some(&Skip::SilentTooLarge));
    let requests = h.gateway.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(ids(&requests[0]), ["reg-0"]);
    assert_eq!(
        json(&requests[0]).get("sound"),
        None,
        "sent as it is, with sound"
    );
}
