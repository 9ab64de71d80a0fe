//! Outbox drain and worker tests.

use std::sync::atomic::Ordering;

use tokio::sync::watch;

use super::fake::{Fail, FakeGateway, Gate, register, registered, registrar_in, setup};
use super::*;

fn busy() -> Fail {
    Fail::Api(503, ErrorCode::Busy)
}

#[tokio::test]
async fn a_pass_confirms_deletes_and_takes_not_found_as_done() {
    let s = setup();
    s.registrar.outbox().push("r1", "a", 1).unwrap();
    s.registrar.outbox().push("r2", "b", 2).unwrap();
    s.gateway.script_unregister(Ok(()));
    s.gateway
        .script_unregister(Err(Fail::Api(404, ErrorCode::NotFound)));
    let report = s.registrar.drain().await;
    let expected = DrainReport {
        deleted: 2,
        dropped: 0,
        failed: 0,
        remaining: 0,
    };
    assert_eq!(report, expected);
    assert_eq!(s.gateway.log(), ["unregister:r1", "unregister:r2"]);
    assert!(UnregisterOutbox::open(s.dir.path()).unwrap().is_empty());
}

#[tokio::test]
async fn authentication_failures_and_outages_never_drop_a_delete() {
    let s = setup();
    let failures = [
        Fail::Api(401, ErrorCode::SessionExpired),
        Fail::Api(401, ErrorCode::InvalidProof),
        Fail::Api(401, ErrorCode::Unknown),
        Fail::Refused,
        busy(),
        Fail::Api(429, ErrorCode::RateLimited),
        Fail::Api(409, ErrorCode::TooManyDevices),
    ];
    for (i, fail) in failures.iter().enumerate() {
        s.registrar.outbox().push(&format!("r{i}"), "a", 1).unwrap();
        s.gateway.script_unregister(Err(*fail));
    }
    let report = s.registrar.drain().await;
    assert_eq!((report.failed, report.remaining), (7, 7));
    assert_eq!((report.deleted, report.dropped), (0, 0));
    let reopened = UnregisterOutbox::open(s.dir.path()).unwrap().pending();
    assert_eq!(reopened.len(), 7);
    assert!(reopened.iter().all(|e| e.attempts == 1), "{reopened:?}");

    let report = s.registrar.drain().await;
    assert_eq!((report.deleted, report.remaining), (7, 0));
}

#[tokio::test]
async fn an_invalid_request_delete_is_dropped_and_counted() {
    let s = setup();
    s.registrar.outbox().push("r1", "a", 1).unwrap();
    s.registrar.outbox().push("r2", "a", 2).unwrap();
    s.gateway
        .script_unregister(Err(Fail::Api(400, ErrorCode::InvalidRequest)));
    s.gateway.script_unregister(Err(busy()));
    let report = s.registrar.drain().await;
    let expected = DrainReport {
        deleted: 0,
        dropped: 1,
        failed: 1,
        remaining: 1,
    };
    assert_eq!(report, expected);
    assert_eq!(s.registrar.outbox().pending()[0].registration_id, "r2");
}

#[tokio::test]
async fn a_pass_tries_each_delete_once() {
    let s = setup();
    *s.gateway.unregister_default.lock().unwrap() = Some(busy());
    s.registrar.outbox().push("r1", "a", 1).unwrap();
    s.registrar.outbox().push("r2", "b", 1).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(5), s.registrar.drain())
        .await
        .expect("a pass ends even when every delete fails");
    assert_eq!((report.failed, report.remaining), (2, 2));
    assert_eq!(s.gateway.log(), ["unregister:r1", "unregister:r2"]);
}

#[tokio::test(start_paused = true)]
async fn a_delete_queued_mid_pass_is_sent_in_the_same_pass() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    register(&s.registrar, "b", "abcd").await;
    s.registrar.unregister("a").await;
    let gate = Gate::new();
    *s.gateway.unregister_gate.lock().unwrap() = Some(Arc::clone(&gate));
    let pass = tokio::spawn({
        let registrar = Arc::clone(&s.registrar);
        async move { registrar.drain().await }
    });
    gate.entered().await;
    assert!(s.registrar.unregister("b").await);
    *s.gateway.unregister_gate.lock().unwrap() = None;
    gate.open();

    let report = pass.await.unwrap();
    assert_eq!((report.deleted, report.remaining), (2, 0));
    assert_eq!(
        s.gateway.log()[2..],
        ["unregister:reg-a", "unregister:reg-b"]
    );
}

#[tokio::test(start_paused = true)]
async fn outbox_deletes_do_not_interleave_with_the_devices_registration() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    s.registrar.unregister("a").await;
    let gate = Gate::new();
    *s.gateway.unregister_gate.lock().unwrap() = Some(Arc::clone(&gate));
    let pass = tokio::spawn({
        let registrar = Arc::clone(&s.registrar);
        async move { registrar.drain().await }
    });
    gate.entered().await;
    let registering = tokio::spawn({
        let registrar = Arc::clone(&s.registrar);
        async move { register(&registrar, "a", "beef").await }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!registering.is_finished());
    assert_eq!(s.gateway.log(), ["register:a", "unregister:reg-a"]);

    *s.gateway.unregister_gate.lock().unwrap() = None;
    gate.open();
    assert_eq!(pass.await.unwrap().deleted, 1);
    assert_eq!(registering.await.unwrap(), registered("reg-a"));
    assert_eq!(
        s.gateway.log(),
        ["register:a", "unregister:reg-a", "register:a"],
        "the delete finished before the new registration, and was not sent twice"
    );
    assert!(s.registrar.outbox().is_empty());
    assert_eq!(s.registrar.store().get("a").unwrap().token, "beef");
}

#[tokio::test]
async fn a_queued_delete_survives_a_restart() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    *s.gateway.unregister_default.lock().unwrap() = Some(busy());
    s.registrar.unregister("a").await;
    assert_eq!(s.registrar.drain().await.remaining, 1);
    drop(s.registrar);

    let gateway = Arc::new(FakeGateway::default());
    let (restarted, _) = registrar_in(s.dir.path(), &gateway, RegistrarConfig::default());
    assert!(restarted.store().get("a").is_none());
    assert_eq!(restarted.outbox().pending()[0].attempts, 1);
    assert_eq!(restarted.drain().await.deleted, 1);
    assert_eq!(gateway.log(), ["unregister:reg-a"]);
}

#[tokio::test(start_paused = true)]
async fn the_worker_drains_at_start_and_after_each_unregister() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    s.registrar.unregister("a").await;
    let (stop, shutdown) = watch::channel(false);
    let worker = s.registrar.spawn_outbox_worker(shutdown);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.gateway.log(), ["register:a", "unregister:reg-a"]);

    register(&s.registrar, "b", "abcd").await;
    s.registrar.unregister("b").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.gateway.log()[3..], ["unregister:reg-b"]);
    assert!(s.registrar.outbox().is_empty());

    stop.send(true).unwrap();
    worker.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_worker_backs_off_doubling_to_the_cap_and_starts_over_once_empty() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    *s.gateway.unregister_default.lock().unwrap() = Some(busy());
    s.registrar.unregister("a").await;
    let (stop, shutdown) = watch::channel(false);
    let worker = s.registrar.spawn_outbox_worker(shutdown);
    tokio::time::sleep(Duration::from_secs(2131)).await;
    let gaps = |times: &[tokio::time::Instant]| -> Vec<u64> {
        times.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect()
    };
    let times = s.gateway.unregister_times.lock().unwrap().clone();
    assert_eq!(gaps(&times), [30, 60, 120, 240, 480, 600, 600]);

    // The next retry succeeds and empties the outbox, which resets the delay.
    *s.gateway.unregister_default.lock().unwrap() = None;
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(s.registrar.outbox().is_empty());
    *s.gateway.unregister_default.lock().unwrap() = Some(busy());
    register(&s.registrar, "b", "abcd").await;
    let kicked_at = tokio::time::Instant::now();
    s.registrar.unregister("b").await;
    tokio::time::sleep(Duration::from_secs(31)).await;
    let times = s.gateway.unregister_times.lock().unwrap().clone();
    assert_eq!(times.len(), 11);
    assert_eq!(times[9], kicked_at, "the unregister kicked a pass at once");
    assert_eq!(gaps(&times[9..]), [30]);

    stop.send(true).unwrap();
    worker.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_worker_stops_on_shutdown_even_mid_pass_and_loses_nothing() {
    let s = setup();
    s.registrar.outbox().push("r1", "a", 1).unwrap();
    let gate = Gate::new();
    *s.gateway.unregister_gate.lock().unwrap() = Some(Arc::clone(&gate));
    let (stop, shutdown) = watch::channel(false);
    let worker = s.registrar.spawn_outbox_worker(shutdown);
    gate.entered().await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(1), worker)
        .await
        .expect("stops without waiting for the gateway")
        .unwrap();
    assert!(UnregisterOutbox::open(s.dir.path()).unwrap().contains("r1"));

    // Dropping the sender stops it too.
    *s.gateway.unregister_gate.lock().unwrap() = None;
    let (stop, shutdown) = watch::channel(false);
    let worker = s.registrar.spawn_outbox_worker(shutdown);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(s.registrar.outbox().is_empty());
    drop(stop);
    tokio::time::timeout(Duration::from_secs(1), worker)
        .await
        .expect("stops when the sender is gone")
        .unwrap();
}

#[tokio::test]
async fn registered_at_comes_from_the_clock_and_only_registering_renews_it() {
    let s = setup();
    s.now.store(5_000, Ordering::SeqCst);
    register(&s.registrar, "a", "abcd").await;
    let expires = 5_000 + crate::REGISTRATION_LIFETIME_MS;
    let active = |now| crate::RegistrationSource::active(s.registrar.store().as_ref(), now);
    assert_eq!(active(expires - 1).len(), 1);
    assert!(active(expires).is_empty());
    s.now.store(expires + 10, Ordering::SeqCst);
    register(&s.registrar, "a", "abcd").await;
    assert_eq!(
        active(expires + 10).len(),
        1,
        "a new registration renews the lease"
    );
}
