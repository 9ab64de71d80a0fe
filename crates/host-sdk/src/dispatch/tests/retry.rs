//! One retry per request: after 2 s or Retry-After (capped), never past the event's deadline,
//! never for a refusal or a `rate_limited` answer.

use std::time::Duration;

use orca_push_api::{ErrorCode, SendStatus};

use super::*;
use crate::dispatch::Outcome;

/// The times of the gateway's send calls, relative to `start`.
fn offsets(h: &Harness, start: Instant) -> Vec<Duration> {
    h.gateway
        .sends()
        .iter()
        .map(|(at, _)| *at - start)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_retryable_failure_is_retried_once_after_two_seconds() {
    let h = harness(phones(1), 2);
    h.gateway.then_err(503, ErrorCode::Busy, None);
    let start = Instant::now();
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(offsets(&h, start), [Duration::ZERO, Duration::from_secs(2)]);
    assert_eq!(
        report.outcomes["reg-0"],
        Outcome::Status(SendStatus::Queued)
    );
    assert_eq!(report.requests[0].attempts, 2);
    assert_eq!(report.failures["send.busy"], 1);
    let requests = h.gateway.requests();
    assert_eq!(requests[0], requests[1]);
}

#[tokio::test(start_paused = true)]
async fn five_hundreds_are_retried_too() {
    let h = harness(phones(1), 2);
    h.gateway.then_err(502, ErrorCode::Unknown, None);
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(report.requests[0].attempts, 2);
    assert_eq!(
        report.outcomes["reg-0"],
        Outcome::Status(SendStatus::Queued)
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_honoured_and_capped_at_five_minutes() {
    let h = harness(phones(1), 2);
    h.gateway
        .then_err(429, ErrorCode::RateLimited, Some(Duration::from_secs(30)));
    let start = Instant::now();
    h.dispatcher.dispatch(event(0)).await;
    assert_eq!(offsets(&h, start)[1], Duration::from_secs(30));

    let h = harness(phones(1), 2);
    h.gateway
        .then_err(503, ErrorCode::Busy, Some(Duration::from_secs(3600)));
    let start = Instant::now();
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(offsets(&h, start)[1], Duration::from_secs(300));
    assert_eq!(
        report.outcomes["reg-0"],
        Outcome::Status(SendStatus::Queued)
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_of_zero_still_waits_two_seconds() {
    let h = harness(phones(1), 2);
    h.gateway
        .then_err(503, ErrorCode::Busy, Some(Duration::ZERO));
    let start = Instant::now();
    h.dispatcher.dispatch(event(0)).await;
    assert_eq!(offsets(&h, start)[1], Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn no_retry_that_would_land_after_the_events_deadline() {
    let h = harness(phones(1), 2);
    h.gateway.then_err(503, ErrorCode::Busy, None);
    let mut e = event(0);
    e.expires_at = Some((BASE_MS + 1_999) as i64);
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(h.gateway.requests().len(), 1);
    assert!(report.requests[0].retry_skipped_expired);
    assert_eq!(report.outcomes["reg-0"], Outcome::Failed("busy"));

    // A deadline the retry still makes is retried.
    let h = harness(phones(1), 2);
    h.gateway.then_err(503, ErrorCode::Busy, None);
    let mut e = event(0);
    e.expires_at = Some((BASE_MS + 2_001) as i64);
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(report.requests[0].attempts, 2);
}

#[tokio::test(start_paused = true)]
async fn refusals_are_not_retried() {
    for (status, code) in [
        (400, ErrorCode::InvalidRequest),
        (404, ErrorCode::NotFound),
        (401, ErrorCode::SessionExpired),
        (413, ErrorCode::RequestTooLarge),
    ] {
        let h = harness(phones(1), 2);
        h.gateway.then_err(status, code, None);
        let report = h.dispatcher.dispatch(event(0)).await;
        assert_eq!(h.gateway.requests().len(), 1, "{code}");
        assert_eq!(report.outcomes["reg-0"], Outcome::Failed(code.as_str()));
        assert_eq!(report.failures[&format!("send.{code}")], 1);
    }
}

#[tokio::test(start_paused = true)]
async fn rate_limited_answers_are_not_retried() {
    let h = harness(phones(1), 2);
    h.gateway.then(|r| Ok(all(r, SendStatus::RateLimited)));
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(h.gateway.requests().len(), 1);
    assert_eq!(
        report.outcomes["reg-0"],
        Outcome::Status(SendStatus::RateLimited)
    );
    assert_eq!(report.failures["result.rate_limited"], 1);
}

#[tokio::test(start_paused = true)]
async fn there_is_only_one_retry() {
    let h = harness(phones(1), 2);
    h.gateway.then_err(503, ErrorCode::Busy, None);
    h.gateway.then_err(503, ErrorCode::ShuttingDown, None);
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(h.gateway.requests().len(), 2);
    assert_eq!(report.outcomes["reg-0"], Outcome::Failed("shutting_down"));
    assert_eq!(report.failures["send.busy"], 1);
    assert_eq!(report.failures["send.shutting_down"], 1);
}

#[tokio::test(start_paused = true)]
async fn each_request_retries_on_its_own_earliest_first() {
    let h = harness(phones(45), 2);
    // Request 1 waits a minute, request 2 succeeds, request 3 waits the default 2 s.
    h.gateway
        .then_err(503, ErrorCode::Busy, Some(Duration::from_secs(60)));
    h.gateway.then(|r| Ok(all(r, SendStatus::Queued)));
    h.gateway.then_err(503, ErrorCode::Busy, None);
    let start = Instant::now();
    let report = h.dispatcher.dispatch(event(0)).await;
    let sends = h.gateway.sends();
    let sizes: Vec<(Duration, usize)> = sends
        .iter()
        .map(|(at, r)| (*at - start, r.registration_ids.len()))
        .collect();
    assert_eq!(
        sizes,
        [
            (Duration::ZERO, 20),
            (Duration::ZERO, 20),
            (Duration::ZERO, 5),
            (Duration::from_secs(2), 5),
            (Duration::from_secs(60), 20),
        ]
    );
    assert_eq!(sends[4].1, sends[0].1);
    let attempts: Vec<u32> = report.requests.iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, [2, 1, 2]);
    assert_eq!(report.outcomes.len(), 45);
}
