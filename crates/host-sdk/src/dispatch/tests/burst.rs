//! Per-phone burst suppression on `emittedAt`, after filtering; dismissals exempt.

use std::time::Duration;

use orca_push_api::{Kind, Source};

use super::*;
use crate::dispatch::Skip;

#[tokio::test(start_paused = true)]
async fn one_alert_per_phone_per_five_seconds_of_emitted_at() {
    let h = harness(phones(1), 2);
    assert_eq!(h.dispatcher.dispatch(event(0)).await.sent_ids(), ["reg-0"]);
    let report = h.dispatcher.dispatch(event(4_999)).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::Burst));
    assert!(report.sent_ids().is_empty());
    // The suppressed alert did not extend the window.
    assert_eq!(
        h.dispatcher.dispatch(event(5_000)).await.sent_ids(),
        ["reg-0"]
    );
    assert_eq!(h.gateway.requests().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_window_is_measured_on_emitted_at_not_on_arrival() {
    let h = harness(phones(1), 2);
    // Bunched up on arrival, six seconds apart when they happened: both go.
    assert_eq!(h.dispatcher.dispatch(event(0)).await.sent_ids(), ["reg-0"]);
    assert_eq!(
        h.dispatcher.dispatch(event(6_000)).await.sent_ids(),
        ["reg-0"]
    );
    // Arriving ten seconds late, but emitted one second after the last: suppressed.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let report = h.dispatcher.dispatch(event(7_000)).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::Burst));
}

#[tokio::test(start_paused = true)]
async fn without_emitted_at_the_dispatch_time_is_used() {
    let h = harness(phones(1), 2);
    let now = |mut e: DispatchEvent| {
        e.emitted_at = None;
        e
    };
    assert_eq!(
        h.dispatcher.dispatch(now(event(0))).await.sent_ids(),
        ["reg-0"]
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let report = h.dispatcher.dispatch(now(event(0))).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::Burst));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        h.dispatcher.dispatch(now(event(0))).await.sent_ids(),
        ["reg-0"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_filtered_event_neither_opens_nor_extends_a_window() {
    let agents_only = with_filter(0, |f| f.sources = vec![Source::AgentTaskComplete]);
    let h = harness(vec![agents_only], 2);
    let mut bell = event(0);
    bell.source = Source::TerminalBell;
    bell.agent_state = None;
    assert_eq!(
        h.dispatcher.dispatch(bell).await.skipped.get("reg-0"),
        Some(&Skip::Source)
    );
    let mut disabled = event(500);
    disabled.desktop_allowed = false;
    assert_eq!(
        h.dispatcher.dispatch(disabled).await.skipped.get("reg-0"),
        Some(&Skip::DesktopDisabled)
    );
    assert_eq!(
        h.dispatcher.dispatch(event(1_000)).await.sent_ids(),
        ["reg-0"]
    );
    // And a filtered event inside the window does not push its end out.
    let mut bell = event(3_000);
    bell.source = Source::TerminalBell;
    h.dispatcher.dispatch(bell).await;
    assert_eq!(
        h.dispatcher.dispatch(event(6_000)).await.sent_ids(),
        ["reg-0"]
    );
}

#[tokio::test(start_paused = true)]
async fn windows_are_per_phone() {
    let bells_only = with_filter(1, |f| f.sources = vec![Source::TerminalBell]);
    let h = harness(vec![phone(0), bells_only], 2);
    assert_eq!(h.dispatcher.dispatch(event(0)).await.sent_ids(), ["reg-0"]);
    let mut bell = event(1_000);
    bell.source = Source::TerminalBell;
    bell.agent_state = None;
    let report = h.dispatcher.dispatch(bell).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::Burst));
    assert_eq!(report.sent_ids(), ["reg-1"]);
}

#[tokio::test(start_paused = true)]
async fn dismissals_are_never_suppressed_and_open_no_window() {
    let h = harness(phones(1), 2);
    let dismiss = |at| {
        let mut e = event(at);
        e.kind = Kind::Dismiss;
        e
    };
    assert_eq!(
        h.dispatcher.dispatch(dismiss(0)).await.sent_ids(),
        ["reg-0"]
    );
    assert_eq!(
        h.dispatcher.dispatch(event(100)).await.sent_ids(),
        ["reg-0"]
    );
    assert_eq!(
        h.dispatcher.dispatch(dismiss(200)).await.sent_ids(),
        ["reg-0"]
    );
    assert_eq!(h.gateway.requests().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_phone_registered_again_after_leaving_starts_fresh() {
    let h = harness(phones(1), 2);
    assert_eq!(h.dispatcher.dispatch(event(0)).await.sent_ids(), ["reg-0"]);
    let gone = h
        .source
        .registrations
        .lock()
        .unwrap()
        .drain(..)
        .collect::<Vec<_>>();
    h.dispatcher.dispatch(event(1_000)).await;
    // While it was gone its window was forgotten (the map stays as small as the registrations).
    h.source.registrations.lock().unwrap().extend(gone);
    assert_eq!(
        h.dispatcher.dispatch(event(2_000)).await.sent_ids(),
        ["reg-0"]
    );
}
