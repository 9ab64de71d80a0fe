//! Failure counts: by category only, logged at most once per interval, flushed on shutdown.

use std::time::Duration;

use orca_push_api::{ErrorCode, SendStatus};

use super::*;

fn errors(h: &Harness, n: usize) {
    for _ in 0..n {
        h.gateway.then(|r| Ok(all(r, SendStatus::Error)));
    }
}

#[tokio::test(start_paused = true)]
async fn failures_are_logged_at_most_once_per_interval_with_the_counts_since_the_last_line() {
    let (lines, _guard) = capture::start();
    let h = harness(phones(1), 2);
    errors(&h, 4);
    h.dispatcher.dispatch(event(0)).await;
    assert_eq!(lines.get().len(), 1);
    assert!(lines.get()[0].contains("result.error=1"));

    tokio::time::sleep(Duration::from_secs(10)).await;
    h.dispatcher.dispatch(event(10_000)).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    h.dispatcher.dispatch(event(20_000)).await;
    assert_eq!(lines.get().len(), 1, "nothing more inside the minute");

    // The minute is up: the two counted since the first line are logged without another failure.
    tokio::time::sleep(Duration::from_secs(41)).await;
    let got = lines.get();
    assert_eq!(got.len(), 2);
    assert!(got[1].contains("result.error=2"), "{}", got[1]);
    assert!(got.iter().all(|l| l.starts_with("WARN")));

    // Long after, a failure is logged at once.
    tokio::time::sleep(Duration::from_secs(120)).await;
    h.dispatcher.dispatch(event(200_000)).await;
    assert_eq!(lines.get().len(), 3);
    assert_eq!(h.dispatcher.failure_counts()["result.error"], 4);
}

#[tokio::test(start_paused = true)]
async fn shutdown_flushes_what_was_not_logged_yet_once() {
    let (lines, _guard) = capture::start();
    let h = harness(phones(1), 2);
    errors(&h, 2);
    h.dispatcher.dispatch(event(0)).await;
    h.dispatcher.dispatch(event(10_000)).await;
    assert_eq!(lines.get().len(), 1);
    h.dispatcher.shutdown().await;
    let got = lines.get();
    assert_eq!(got.len(), 2);
    assert!(got[1].contains("result.error=1") && got[1].contains("shutdown"));
    h.dispatcher.shutdown().await;
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(lines.get().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn logs_and_counts_carry_no_payload() {
    let (lines, _guard) = capture::start();
    let h = harness(phones(3), 2);
    h.gateway.set_protocol(None);
    h.gateway.then(|r| {
        let mut reply = all(r, SendStatus::Dead);
        reply.results[1].status = SendStatus::Error;
        reply.results[2].status = SendStatus::RateLimited;
        Ok(reply)
    });
    h.gateway.then_err(503, ErrorCode::Busy, None);
    h.gateway.then_err(503, ErrorCode::Busy, None);
    let mut e = event(0);
    e.title = "Secret title".to_owned();
    h.dispatcher.dispatch(e.clone()).await;
    e.emitted_at = Some(BASE_MS + 10_000);
    h.dispatcher.dispatch(e).await;
    let mut invalid = event(20_000);
    invalid.title = "Secret title".repeat(10);
    h.dispatcher.dispatch(invalid).await;
    h.dispatcher.shutdown().await;

    let got = lines.get().join("\n");
    for category in [
        "health.busy",
        "result.dead",
        "result.error",
        "result.rate_limited",
        "send.busy",
        "invalid_event",
    ] {
        assert!(got.contains(category), "{category} missing from {got}");
    }
    let counts = h.dispatcher.failure_counts();
    let keys = counts.keys().cloned().collect::<Vec<_>>().join(" ");
    for payload in [
        "Secret", "secret", "token", "reg-", "device-", "worktree", "epoch",
    ] {
        assert!(!got.contains(payload), "{payload} in logs: {got}");
        assert!(!keys.contains(payload), "{payload} in counts: {keys}");
    }
}
