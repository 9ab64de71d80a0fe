//! Registrar tests: registering, unregistering and their storage, against a scripted gateway.

use std::sync::atomic::Ordering;

use orca_push_api::{AgentState, DeviceFilter};

use super::fake::{Fail, FakeGateway, Gate, register, registered, setup};
use super::store::tests::break_writes;
use super::*;

fn pending_ids(registrar: &Registrar<FakeGateway>) -> Vec<String> {
    registrar
        .outbox()
        .pending()
        .into_iter()
        .map(|e| e.registration_id)
        .collect()
}

#[tokio::test]
async fn register_stores_it_and_sends_only_the_gateway_part_of_the_filter() {
    let s = setup();
    s.now.store(42_000, Ordering::SeqCst);
    let filter = HostFilter {
        sources: vec![orca_push_api::Source::Plugin],
        agent_states: vec![AgentState::NeedsInput],
        follow_desktop: Some(false),
        sound: Some(false),
    };
    let token = "f".repeat(40);
    let outcome = s
        .registrar
        .register("a", Platform::Android, &token, None, filter.clone())
        .await;
    assert_eq!(outcome, registered("reg-a"));

    let sent = s.gateway.requests.lock().unwrap()[0].clone();
    assert_eq!(sent.filter, Some(filter.gateway_part()));
    let body = serde_json::to_string(&sent).unwrap();
    assert!(
        !body.contains("followDesktop") && !body.contains("sound"),
        "{body}"
    );

    let stored = RegistrationStore::open(s.dir.path())
        .unwrap()
        .get("a")
        .unwrap();
    assert_eq!(stored.registration_id, "reg-a");
    assert_eq!(stored.token, token);
    assert_eq!(stored.filter, filter, "the host-local flags are kept here");
    assert_eq!(stored.registered_at, 42_000);
}

#[tokio::test]
async fn a_request_that_breaks_the_contract_is_refused_before_sending() {
    let s = setup();
    let no_env = s
        .registrar
        .register("a", Platform::Ios, "abcd", None, HostFilter::everything())
        .await;
    assert_eq!(
        no_env,
        RegisterOutcome::NotRegistered(NotRegistered::InvalidRequest)
    );
    let mut repeated = HostFilter::everything();
    repeated.sources.push(orca_push_api::Source::Plugin);
    let env = Some(ApnsEnvironment::Production);
    let outcome = s
        .registrar
        .register("a", Platform::Ios, "abcd", env, repeated)
        .await;
    assert_eq!(
        outcome,
        RegisterOutcome::NotRegistered(NotRegistered::InvalidRequest)
    );
    assert!(s.gateway.log().is_empty());
    assert!(s.registrar.store().all().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_eleventh_register_in_a_minute_is_throttled_and_changes_nothing() {
    let s = setup();
    for i in 0..10 {
        tokio::time::advance(Duration::from_secs(5)).await;
        s.now.store(1_000 + i, Ordering::SeqCst);
        let token = format!("{i:02}aa");
        assert_eq!(
            register(&s.registrar, "a", &token).await,
            registered("reg-a")
        );
    }
    let before = s.registrar.store().get("a").unwrap();
    let file_before = std::fs::read(s.registrar.store().path()).unwrap();

    s.now.store(9_999, Ordering::SeqCst);
    s.gateway.script_register(Ok("reg-other"));
    let throttled = register(&s.registrar, "a", "ffff").await;
    assert_eq!(
        throttled,
        RegisterOutcome::NotRegistered(NotRegistered::Throttled)
    );
    assert_eq!(s.gateway.log().len(), 10, "no gateway call");
    assert_eq!(s.registrar.store().get("a").unwrap(), before);
    assert_eq!(
        std::fs::read(s.registrar.store().path()).unwrap(),
        file_before
    );
    assert!(s.registrar.outbox().is_empty());

    // Another phone has its own budget; unregister is never throttled.
    assert_eq!(
        register(&s.registrar, "b", "abcd").await,
        registered("reg-other")
    );
    assert!(s.registrar.unregister("a").await);

    // The first call was made 45 s before the refusal; 15 s later it is a minute old.
    tokio::time::advance(Duration::from_secs(14)).await;
    assert_eq!(
        register(&s.registrar, "a", "ffff").await,
        RegisterOutcome::NotRegistered(NotRegistered::Throttled)
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        register(&s.registrar, "a", "ffff").await,
        registered("reg-a")
    );
}

#[tokio::test]
async fn gateway_failures_become_the_contracts_reasons_and_store_nothing() {
    let s = setup();
    let cases = [
        (
            Fail::Api(503, ErrorCode::Busy),
            NotRegistered::GatewayUnreachable,
        ),
        (
            Fail::Api(429, ErrorCode::RateLimited),
            NotRegistered::GatewayUnreachable,
        ),
        (
            Fail::Api(502, ErrorCode::Unknown),
            NotRegistered::GatewayUnreachable,
        ),
        (Fail::Refused, NotRegistered::GatewayUnreachable),
        (
            Fail::Api(409, ErrorCode::TooManyDevices),
            NotRegistered::GatewayRejected(ErrorCode::TooManyDevices),
        ),
        (
            Fail::Api(401, ErrorCode::InvalidProof),
            NotRegistered::GatewayRejected(ErrorCode::InvalidProof),
        ),
        (
            Fail::Api(400, ErrorCode::InvalidRequest),
            NotRegistered::GatewayRejected(ErrorCode::InvalidRequest),
        ),
    ];
    for (fail, reason) in cases {
        s.gateway.script_register(Err(fail));
        let outcome = register(&s.registrar, "a", "abcd").await;
        assert_eq!(outcome, RegisterOutcome::NotRegistered(reason), "{fail:?}");
    }
    assert!(s.registrar.store().all().is_empty());
    assert!(s.registrar.outbox().is_empty());
    assert_eq!(
        NotRegistered::GatewayRejected(ErrorCode::Busy).as_str(),
        "gateway_rejected"
    );
    assert_eq!(
        NotRegistered::StorageFailed.as_str(),
        "registration_storage_failed"
    );
}

#[tokio::test]
async fn an_accepted_registration_that_cannot_be_stored_has_its_delete_queued() {
    let s = setup();
    break_writes(s.registrar.store().path());
    let outcome = register(&s.registrar, "a", "abcd").await;
    assert_eq!(
        outcome,
        RegisterOutcome::NotRegistered(NotRegistered::StorageFailed)
    );
    assert!(s.registrar.store().get("a").is_none());
    let reopened = UnregisterOutbox::open(s.dir.path()).unwrap();
    assert_eq!(reopened.pending()[0].registration_id, "reg-a");
    assert_eq!(reopened.pending()[0].device_id, "a");

    let report = s.registrar.drain().await;
    assert_eq!((report.deleted, report.remaining), (1, 0));
    assert_eq!(s.gateway.log(), ["register:a", "unregister:reg-a"]);
}

#[tokio::test]
async fn a_storage_failure_never_deletes_the_id_the_store_still_sends_to() {
    let s = setup();
    assert_eq!(
        register(&s.registrar, "a", "abcd").await,
        registered("reg-a")
    );
    break_writes(s.registrar.store().path());

    // The gateway kept the device's id: the old record still names a live registration.
    let outcome = register(&s.registrar, "a", "beef").await;
    assert_eq!(
        outcome,
        RegisterOutcome::NotRegistered(NotRegistered::StorageFailed)
    );
    assert_eq!(s.registrar.store().get("a").unwrap().token, "abcd");
    assert!(s.registrar.outbox().is_empty());

    // A new id would be referenced by nothing: it is deleted, the stored one is kept.
    s.gateway.script_register(Ok("reg-a2"));
    let outcome = register(&s.registrar, "a", "beef").await;
    assert_eq!(
        outcome,
        RegisterOutcome::NotRegistered(NotRegistered::StorageFailed)
    );
    assert_eq!(pending_ids(&s.registrar), ["reg-a2"]);
    assert_eq!(
        s.registrar.store().get("a").unwrap().registration_id,
        "reg-a"
    );
}

#[tokio::test]
async fn a_changed_registration_id_queues_the_old_ones_delete() {
    let s = setup();
    assert_eq!(
        register(&s.registrar, "a", "abcd").await,
        registered("reg-a")
    );
    assert_eq!(
        register(&s.registrar, "a", "abcd").await,
        registered("reg-a")
    );
    assert!(
        s.registrar.outbox().is_empty(),
        "the same id is not deleted"
    );

    s.gateway.script_register(Ok("reg-a2"));
    assert_eq!(
        register(&s.registrar, "a", "abcd").await,
        registered("reg-a2")
    );
    assert_eq!(pending_ids(&s.registrar), ["reg-a"]);
    assert_eq!(
        s.registrar.store().get("a").unwrap().registration_id,
        "reg-a2"
    );
}

#[tokio::test]
async fn re_registration_first_settles_the_devices_earlier_deletes() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    register(&s.registrar, "b", "abcd").await;
    assert!(s.registrar.unregister("a").await);
    assert!(s.registrar.unregister("b").await);

    assert_eq!(
        register(&s.registrar, "a", "beef").await,
        registered("reg-a")
    );
    assert_eq!(
        s.gateway.log()[2..],
        ["unregister:reg-a", "register:a"],
        "only a's delete, and before the registration"
    );
    assert_eq!(pending_ids(&s.registrar), ["reg-b"]);
    assert_eq!(s.registrar.store().get("a").unwrap().token, "beef");
}

#[tokio::test]
async fn a_delete_that_failed_before_re_registering_never_removes_the_new_registration() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    s.registrar.unregister("a").await;
    s.gateway
        .script_unregister(Err(Fail::Api(503, ErrorCode::Busy)));

    // The gateway answers with the device's same id: that id is live again.
    assert_eq!(
        register(&s.registrar, "a", "beef").await,
        registered("reg-a")
    );
    assert!(s.registrar.outbox().is_empty());
    assert!(UnregisterOutbox::open(s.dir.path()).unwrap().is_empty());
    s.registrar.drain().await;
    let deletes = s
        .gateway
        .log()
        .iter()
        .filter(|c| c.starts_with("unregister"))
        .count();
    assert_eq!(deletes, 1, "only the failed settle attempt");
}

#[tokio::test]
async fn unregister_forgets_the_phone_and_queues_its_delete_durably() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    s.now.store(77_000, Ordering::SeqCst);
    assert!(s.registrar.unregister("a").await);
    assert!(s.registrar.store().get("a").is_none());
    assert!(
        RegistrationStore::open(s.dir.path())
            .unwrap()
            .all()
            .is_empty()
    );
    let queued = UnregisterOutbox::open(s.dir.path()).unwrap().pending();
    let expected = PendingDelete {
        registration_id: "reg-a".into(),
        device_id: "a".into(),
        queued_at: 77_000,
        attempts: 0,
    };
    assert_eq!(queued, [expected]);
    assert_eq!(
        s.gateway.log(),
        ["register:a"],
        "the worker sends it, not the RPC"
    );

    assert!(!s.registrar.unregister("a").await);
    assert!(!s.registrar.unregister("never").await);
    assert_eq!(s.registrar.outbox().len(), 1);
}

#[tokio::test]
async fn unregister_queues_the_delete_even_when_the_store_cannot_be_written() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    break_writes(s.registrar.store().path());
    assert!(s.registrar.unregister("a").await);
    assert_eq!(pending_ids(&s.registrar), ["reg-a"]);
}

#[tokio::test]
async fn without_an_outbox_the_delete_is_tried_at_once() {
    let s = setup();
    register(&s.registrar, "a", "abcd").await;
    break_writes(s.registrar.outbox().path());
    assert!(s.registrar.unregister("a").await);
    assert_eq!(s.gateway.log(), ["register:a", "unregister:reg-a"]);
}

#[tokio::test(start_paused = true)]
async fn register_and_unregister_of_one_device_do_not_interleave() {
    let s = setup();
    let gate = Gate::new();
    *s.gateway.register_gate.lock().unwrap() = Some(Arc::clone(&gate));
    let registering = tokio::spawn({
        let registrar = Arc::clone(&s.registrar);
        async move { register(&registrar, "a", "abcd").await }
    });
    gate.entered().await;
    let unregistering = tokio::spawn({
        let registrar = Arc::clone(&s.registrar);
        async move { registrar.unregister("a").await }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !unregistering.is_finished(),
        "unregister waits for the register in flight"
    );

    // Another device is not held up.
    *s.gateway.register_gate.lock().unwrap() = None;
    assert_eq!(
        register(&s.registrar, "b", "abcd").await,
        registered("reg-b")
    );

    gate.open();
    assert_eq!(registering.await.unwrap(), registered("reg-a"));
    assert!(
        unregistering.await.unwrap(),
        "it saw the registration just stored"
    );
    assert!(s.registrar.store().get("a").is_none());
    assert_eq!(pending_ids(&s.registrar), ["reg-a"]);
}

#[test]
fn filters_convert_without_the_local_flags() {
    let filter = HostFilter::from(DeviceFilter::everything());
    assert_eq!((filter.follow_desktop, filter.sound), (None, None));
    assert_eq!(short("abcdefgh"), "abcd");
    assert_eq!(short("ab"), "ab");
    assert_eq!(short("ééééé"), "éééé");
}
