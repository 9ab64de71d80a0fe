//! `enqueue` is fire-and-forget and never fails; `shutdown` waits for it.

use std::sync::Arc;
use std::time::Duration;

use orca_push_api::ErrorCode;

use super::*;

#[tokio::test(start_paused = true)]
async fn enqueue_runs_in_the_background_and_shutdown_waits_for_it_retry_included() {
    let h = harness(phones(1), 2);
    h.gateway.then_err(503, ErrorCode::Busy, None);
    h.dispatcher.enqueue(event(0));
    assert!(h.gateway.requests().is_empty(), "enqueue does not wait");
    let start = Instant::now();
    h.dispatcher.shutdown().await;
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(h.gateway.requests().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn enqueued_work_is_bounded_and_the_overflow_counted() {
    let gateway = Arc::new(FakeGateway::new(2));
    // Every request is answered busy with a minute's Retry-After: each dispatch waits it out.
    for _ in 0..10 {
        gateway.then_err(503, ErrorCode::Busy, Some(Duration::from_secs(60)));
    }
    let dispatcher = Dispatcher::with_clock(
        gateway,
        Arc::new(FakeSource::new(phones(1))),
        DispatchConfig {
            max_in_flight: 3,
            ..config()
        },
        Arc::new(|| BASE_MS),
    );
    for seq in 0..5 {
        dispatcher.enqueue(event(seq * 10_000));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(dispatcher.failure_counts()["overloaded"], 2);
}

#[tokio::test(start_paused = true)]
async fn enqueue_after_shutdown_is_counted_and_not_sent() {
    let h = harness(phones(1), 2);
    h.dispatcher.shutdown().await;
    h.dispatcher.enqueue(event(0));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(h.gateway.requests().is_empty());
    assert_eq!(h.dispatcher.failure_counts()["dispatcher_closed"], 1);
}

#[test]
fn enqueue_outside_any_runtime_does_not_panic() {
    let dispatcher = Dispatcher::with_clock(
        Arc::new(FakeGateway::new(2)),
        Arc::new(FakeSource::new(phones(1))),
        config(),
        Arc::new(|| BASE_MS),
    );
    dispatcher.enqueue(event(0));
    assert_eq!(dispatcher.failure_counts()["no_runtime"], 1);
}

#[tokio::test(start_paused = true)]
async fn enqueue_from_a_plain_thread_runs_on_the_runtime_it_was_made_in() {
    let h = harness(phones(1), 2);
    let dispatcher = h.dispatcher.clone();
    std::thread::spawn(move || dispatcher.enqueue(event(0)))
        .join()
        .unwrap();
    h.dispatcher.shutdown().await;
    assert_eq!(h.gateway.requests().len(), 1);
    assert!(h.dispatcher.failure_counts().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_panicking_gateway_neither_reaches_the_caller_nor_wedges_shutdown() {
    let h = harness(phones(1), 2);
    h.gateway.then(|_| panic!("scripted panic"));
    h.dispatcher.enqueue(event(0));
    h.dispatcher.shutdown().await;
    // The dispatcher still works afterwards.
    let report = h.dispatcher.dispatch(event(10_000)).await;
    assert_eq!(report.sent_ids(), ["reg-0"]);
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_at_most_its_grace_and_counts_what_it_abandons() {
    let (lines, _guard) = capture::start();
    let h = harness(phones(1), 2);
    h.gateway
        .then_err(503, ErrorCode::Busy, Some(Duration::from_secs(60)));
    h.dispatcher.enqueue(event(0));
    let start = Instant::now();
    h.dispatcher.shutdown().await;
    assert_eq!(start.elapsed(), config().shutdown_grace);
    let counts = h.dispatcher.failure_counts();
    assert_eq!(counts["shutdown_abandoned"], 1);
    assert_eq!(counts["send.busy"], 1);
    // One final line carries both.
    let got = lines.get();
    let last = got.last().unwrap();
    assert!(
        last.contains("shutdown_abandoned=1") && last.contains("final"),
        "{got:?}"
    );
}
