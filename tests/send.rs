//! `POST /v1/send` end to end: a real `orca-push serve` process, on SQLite and on PostgreSQL.

use orca_push_host::HostKey;
use orca_push_storage::Pool;
use orca_push_tests::{Backend, Gateway, Raw, bearer, on_both_backends, scrape_sum};
use serde_json::{Value, json};

on_both_backends!(
    results_follow_first_seen_order_one_per_distinct_id,
    queued_means_event_recipient_and_payload_are_committed,
    quota_is_per_event_and_refusals_are_per_result,
    fifty_parallel_sends_at_299_used_admit_exactly_one,
    a_retry_is_queued_again_and_changed_content_is_an_error,
    the_send_schema_is_strict,
    a_burst_to_one_phone_is_one_batch_and_a_full_batch_splits,
    a_dismissal_over_http_takes_back_the_pending_alert,
    events_without_an_identity_and_with_a_zero_window_go_alone,
    the_deadline_is_capped_at_five_minutes,
    a_split_facade_keeps_resolves_and_hears_every_device_change,
);

struct Host {
    raw: Raw,
    auth: String,
}

impl Host {
    async fn new(gateway: &Gateway) -> Self {
        let raw = Raw::new(gateway);
        let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
        Self { raw, auth }
    }

    async fn register(&self, device: &str) -> String {
        let reply = self
            .raw
            .post(
                "/v1/devices",
                &json!({ "v": 1, "deviceId": device, "platform": "ios", "token": "abcd", "apnsEnvironment": "sandbox" }),
                &[("authorization", &self.auth)],
            )
            .await;
        reply.body["registrationId"].as_str().unwrap().to_owned()
    }

    async fn send(&self, ids: &[&str], notification: Value) -> orca_push_tests::Answer {
        self.raw
            .post(
                "/v1/send",
                &json!({ "v": 1, "registrationIds": ids, "notification": notification }),
                &[("authorization", &self.auth)],
            )
            .await
    }
}

fn notification(seq: u64) -> Value {
    json!({
        "notificationId": format!("task-{seq}"),
        "notificationSeq": seq,
        "notificationEpoch": "3f1c0d52-epoch",
        "source": "agent-task-complete",
        "agentState": "finished",
        "title": "Agent finished",
        "body": "Refactor done",
        "worktreeId": "wt-1",
    })
}

fn statuses(reply: &orca_push_tests::Answer) -> Vec<(String, String)> {
    assert_eq!(reply.status, 200, "{reply:?}");
    reply.body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["registrationId"].as_str().unwrap().to_owned(),
                r["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn mark_dead(gateway: &Gateway, registration_id: &str) {
    match orca_push_storage::open(&gateway.database, &orca_push_registry::STORAGE)
        .await
        .unwrap()
    {
        Pool::Sqlite(p) => {
            sqlx::query("UPDATE push_devices SET dead_at = 1 WHERE registration_id = $1")
                .bind(registration_id)
                .execute(&p)
                .await
                .unwrap();
        }
        Pool::Postgres(p) => {
            sqlx::query("UPDATE push_devices SET dead_at = 1 WHERE registration_id = $1")
                .bind(registration_id)
                .execute(&p)
                .await
                .unwrap();
        }
    }
}

async fn queue_count(gateway: &Gateway, sql: &'static str) -> i64 {
    match orca_push_storage::open(&gateway.database, &orca_push_queue::STORAGE)
        .await
        .unwrap()
    {
        Pool::Sqlite(p) => sqlx::query_scalar(sql).fetch_one(&p).await.unwrap(),
        Pool::Postgres(p) => sqlx::query_scalar(sql).fetch_one(&p).await.unwrap(),
    }
}

async fn results_follow_first_seen_order_one_per_distinct_id(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let host = Host::new(&gateway).await;
    let stranger = Host::new(&gateway).await;
    let a = host.register("a").await;
    let dead = host.register("dead").await;
    let theirs = stranger.register("theirs").await;
    mark_dead(&gateway, &dead).await;
    let reply = host
        .send(
            &[&dead, &a, "no-such-id", &a, &theirs, &dead],
            notification(1),
        )
        .await;
    assert_eq!(
        statuses(&reply),
        vec![
            (dead.clone(), "dead".to_owned()),
            (a.clone(), "queued".to_owned()),
            ("no-such-id".to_owned(), "error".to_owned()),
            (theirs.clone(), "error".to_owned()),
        ]
    );
}

async fn queued_means_event_recipient_and_payload_are_committed(backend: Backend) {
    // A long window, so nothing is delivered (and its payload cleared) before the test looks.
    let gateway = Gateway::start_with(backend, &[("ORCA_PUSH_COALESCE_MS", "60000")]).await;
    let host = Host::new(&gateway).await;
    let ids = [host.register("a").await, host.register("b").await];
    let reply = host.send(&[&ids[0], &ids[1]], notification(1)).await;
    assert!(statuses(&reply).iter().all(|(_, s)| s == "queued"));
    assert_eq!(
        queue_count(
            &gateway,
            "SELECT COUNT(*) FROM push_events WHERE payload_json IS NOT NULL"
        )
        .await,
        1
    );
    assert_eq!(
        queue_count(
            &gateway,
            "SELECT COUNT(*) FROM push_event_recipients WHERE status = 'pending'"
        )
        .await,
        2
    );
    assert_eq!(
        queue_count(&gateway, "SELECT COUNT(*) FROM push_delivery_batches").await,
        2
    );
}

async fn quota_is_per_event_and_refusals_are_per_result(backend: Backend) {
    let mut gateway = Gateway::start(backend).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    let b = host.register("b").await;
    for seq in 0..300 {
        let reply = host.send(&[&a, &b], notification(seq)).await;
        assert!(statuses(&reply).iter().all(|(_, s)| s == "queued"), "{seq}");
    }
    let reply = host.send(&[&a, &b], notification(300)).await;
    assert_eq!(
        statuses(&reply),
        vec![
            (a.clone(), "rate_limited".into()),
            (b.clone(), "rate_limited".into())
        ]
    );
    // One refused event, counted once (not once per recipient).
    let refusals = scrape_sum(
        &gateway.process("all").metrics_url(),
        "orca_push_quota_refusals_total",
        &[("kind", "alert")],
    )
    .await;
    assert_eq!(refusals, 1.0);
    // Dismissals have their own quota.
    let mut dismissal = notification(301);
    dismissal["kind"] = json!("dismiss");
    dismissal["notificationId"] = json!("task-1");
    let reply = host.send(&[&a], dismissal).await;
    assert_eq!(statuses(&reply), vec![(a.clone(), "queued".into())]);
}

async fn fifty_parallel_sends_at_299_used_admit_exactly_one(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    for seq in 0..299 {
        host.send(&[&a], notification(seq)).await;
    }
    let sends = (0..50).map(|i| {
        let raw = host.raw.clone();
        let auth = host.auth.clone();
        let a = a.clone();
        async move {
            raw.post(
                "/v1/send",
                &json!({ "v": 1, "registrationIds": [a], "notification": notification(1000 + i) }),
                &[("authorization", &auth)],
            )
            .await
        }
    });
    let replies = futures::future::join_all(sends).await;
    let statuses: Vec<String> = replies.iter().map(|r| statuses(r)[0].1.clone()).collect();
    assert_eq!(
        statuses.iter().filter(|s| *s == "queued").count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| *s == "rate_limited").count(), 49);
}

async fn a_retry_is_queued_again_and_changed_content_is_an_error(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    assert_eq!(
        statuses(&host.send(&[&a], notification(7)).await)[0].1,
        "queued"
    );
    assert_eq!(
        statuses(&host.send(&[&a], notification(7)).await)[0].1,
        "queued"
    );
    assert_eq!(
        queue_count(&gateway, "SELECT COUNT(*) FROM push_event_recipients").await,
        1
    );
    // A silent copy for another device is the same event, not changed content.
    let b = host.register("b").await;
    let mut silent = notification(7);
    silent["sound"] = json!(false);
    assert_eq!(statuses(&host.send(&[&b], silent).await)[0].1, "queued");
    let mut changed = notification(7);
    changed["title"] = json!("Something else");
    assert_eq!(statuses(&host.send(&[&a], changed).await)[0].1, "error");
    let mut expired = notification(8);
    expired["expiresAt"] = json!(1_000);
    assert_eq!(statuses(&host.send(&[&a], expired).await)[0].1, "error");
}

async fn the_send_schema_is_strict(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    let ids21: Vec<String> = (0..21).map(|_| a.clone()).collect();
    let ids21: Vec<&str> = ids21.iter().map(String::as_str).collect();
    let reply = host.send(&ids21, notification(1)).await;
    assert_eq!(
        (reply.status, reply.error()),
        (400, Some("invalid_request")),
        "21 ids, even repeated"
    );
    let reply = host.send(&ids21[..20], notification(1)).await;
    assert_eq!(
        statuses(&reply).len(),
        1,
        "20 copies of one id are one result"
    );
    let reply = host.send(&[], notification(1)).await;
    assert_eq!(reply.status, 400);
    let mut unknown = notification(2);
    unknown["priority"] = json!("high");
    assert_eq!(host.send(&[&a], unknown).await.status, 400);
    let mut long = notification(3);
    long["notificationId"] = json!("n".repeat(2048));
    long["worktreeId"] = json!("w".repeat(1000));
    assert_eq!(
        host.send(&[&a], long).await.status,
        400,
        "over 3000 bytes of notification JSON"
    );
    let reply = host
        .raw
        .post(
            "/v1/send",
            &json!({ "v": 1, "registrationIds": [a], "notification": notification(4), "extra": 1 }),
            &[("authorization", &host.auth)],
        )
        .await;
    assert_eq!(
        (reply.status, reply.error()),
        (400, Some("invalid_request"))
    );
    let reply = host.raw.post("/v1/send", &json!({ "v": 1 }), &[]).await;
    assert_eq!((reply.status, reply.error()), (401, Some("invalid_token")));
}

async fn batch_sizes(gateway: &Gateway) -> Vec<i64> {
    // Every batch, whatever the sender has done with it since (member counts do not change).
    let sql = "SELECT CAST(member_count AS BIGINT) FROM push_delivery_batches ORDER BY created_at";
    match orca_push_storage::open(&gateway.database, &orca_push_queue::STORAGE)
        .await
        .unwrap()
    {
        Pool::Sqlite(p) => sqlx::query_scalar(sql).fetch_all(&p).await.unwrap(),
        Pool::Postgres(p) => sqlx::query_scalar(sql).fetch_all(&p).await.unwrap(),
    }
}

async fn a_burst_to_one_phone_is_one_batch_and_a_full_batch_splits(backend: Backend) {
    let gateway = Gateway::start_with(backend, &[("ORCA_PUSH_COALESCE_MS", "60000")]).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    // Short identities, so 32 members fit the 4 KB budget and the member cap is what binds.
    let short = |seq: u64| {
        let mut n = notification(seq);
        n["notificationId"] = json!(seq.to_string());
        n["notificationEpoch"] = json!("e");
        n
    };
    for seq in 0..3 {
        host.send(&[&a], short(seq)).await;
    }
    assert_eq!(batch_sizes(&gateway).await, vec![3]);
    for seq in 3..40 {
        host.send(&[&a], short(seq)).await;
    }
    assert_eq!(batch_sizes(&gateway).await, vec![32, 8]);
    // The full one is due at once (the sender has taken it); the rest waits for its window.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while queue_count(
        &gateway,
        "SELECT COUNT(*) FROM push_delivery_batches WHERE member_count = 32 AND attempts >= 1",
    )
    .await
        != 1
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the full batch was never handed out"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        queue_count(&gateway, "SELECT COUNT(*) FROM push_delivery_batches WHERE member_count = 8 AND state = 'open' AND attempts = 0").await,
        1
    );
}

async fn a_dismissal_over_http_takes_back_the_pending_alert(backend: Backend) {
    let gateway = Gateway::start_with(backend, &[("ORCA_PUSH_COALESCE_MS", "60000")]).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    host.send(&[&a], notification(1)).await;
    let mut dismissal = notification(2);
    dismissal["kind"] = json!("dismiss");
    dismissal["notificationId"] = json!("task-1");
    assert_eq!(statuses(&host.send(&[&a], dismissal).await)[0].1, "queued");
    assert_eq!(
        queue_count(
            &gateway,
            "SELECT COUNT(*) FROM push_event_recipients WHERE status = 'cancelled'"
        )
        .await,
        1
    );
    assert_eq!(
        queue_count(&gateway, "SELECT COUNT(*) FROM push_dismissed_events").await,
        1
    );
    // The alert's batch is left empty and cancelled; the dismissal goes alone.
    assert_eq!(batch_sizes(&gateway).await, vec![0, 1]);
    assert_eq!(
        queue_count(
            &gateway,
            "SELECT COUNT(*) FROM push_delivery_batches WHERE state = 'cancelled'"
        )
        .await,
        1
    );
    assert_eq!(
        queue_count(
            &gateway,
            "SELECT COUNT(*) FROM push_delivery_batches WHERE kind = 'dismiss' AND coalescible = 0"
        )
        .await,
        1
    );
}

async fn events_without_an_identity_and_with_a_zero_window_go_alone(backend: Backend) {
    let gateway = Gateway::start_with(backend, &[("ORCA_PUSH_COALESCE_MS", "60000")]).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    for seq in 0..2 {
        let mut bell = notification(seq);
        bell.as_object_mut().unwrap().remove("notificationId");
        bell["source"] = json!("terminal-bell");
        bell["agentState"] = Value::Null;
        assert_eq!(statuses(&host.send(&[&a], bell).await)[0].1, "queued");
    }
    assert_eq!(batch_sizes(&gateway).await, vec![1, 1]);
    let unbatched = Gateway::start_with(backend, &[("ORCA_PUSH_COALESCE_MS", "0")]).await;
    let host = Host::new(&unbatched).await;
    let a = host.register("a").await;
    for seq in 0..3 {
        host.send(&[&a], notification(seq)).await;
    }
    assert_eq!(batch_sizes(&unbatched).await, vec![1, 1, 1]);
}

async fn the_deadline_is_capped_at_five_minutes(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let host = Host::new(&gateway).await;
    let a = host.register("a").await;
    let mut far = notification(1);
    far["expiresAt"] = json!(9_000_000_000_000u64);
    host.send(&[&a], far).await;
    let mut near = notification(2);
    near["expiresAt"] = json!(orca_push_tests::now_ms() + 60_000);
    host.send(&[&a], near).await;
    assert_eq!(
        queue_count(
            &gateway,
            "SELECT COUNT(*) FROM push_events WHERE expires_at = accepted_at + 300000"
        )
        .await,
        1
    );
    assert_eq!(
        queue_count(
            &gateway,
            "SELECT COUNT(*) FROM push_events WHERE expires_at < accepted_at + 300000"
        )
        .await,
        1
    );
}

/// How many sends' resolves the facade of a split gateway answered from memory.
async fn resolves_from_memory(gateway: &mut Gateway) -> f64 {
    scrape_sum(
        &gateway.process("facade").metrics_url(),
        "orca_push_facade_resolves_total",
        &[("source", "memory")],
    )
    .await
}

/// Marks a registration dead the way the sender does: the registry's `MarkDead`, over gRPC, which
/// the facade does not see.
async fn mark_dead_through_the_registry(gateway: &mut Gateway, registration_id: &str) {
    use orca_push_proto::registry::v1 as pb;
    let port = gateway.process("registry").port;
    let key =
        orca_push_internal_auth::InternalKey::from_secret(orca_push_tests::INTERNAL_KEY).unwrap();
    let token = orca_push_internal_auth::mint(
        &key,
        "sender",
        "registry",
        orca_push_internal_auth::Scope::Full,
        std::time::Duration::from_secs(60),
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut request = tonic::Request::new(pb::MarkDeadRequest {
        registration_id: registration_id.to_owned(),
        token: "abcd".into(),
        platform: pb::Platform::Ios as i32,
        apns_environment: pb::ApnsEnvironment::Sandbox as i32,
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let marked = pb::registry_service_client::RegistryServiceClient::new(channel)
        .mark_dead(request)
        .await
        .unwrap();
    assert!(marked.into_inner().marked);
}

/// Split mode: the facade answers a host's repeated sends without asking the registry, and still
/// answers what the registry holds: a delete through the facade at once, a change it does not see
/// (a phone marked dead by the sender) as the registry's device watch brings it, well within the
/// ten seconds it would otherwise keep the old answer.
async fn a_split_facade_keeps_resolves_and_hears_every_device_change(backend: Backend) {
    use std::time::{Duration, Instant};
    let mut gateway = Gateway::start_split(backend).await;
    let host = Host::new(&gateway).await;
    let a = host.register("phone-a").await;
    let b = host.register("phone-b").await;
    let status = |id: &str, status: &str| (id.to_owned(), status.to_owned());
    let mut seq = 0;
    let mut send = async |ids: &[&str]| {
        seq += 1;
        statuses(&host.send(ids, notification(seq)).await)
    };
    // Served from memory once the watch is heard from (a heartbeat every 200 ms).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sent = send(&[&a, &b]).await;
        assert_eq!(sent, vec![status(&a, "queued"), status(&b, "queued")]);
        if resolves_from_memory(&mut gateway).await >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no send was resolved from memory"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deleted = host
        .raw
        .delete(
            &format!("/v1/devices/{a}"),
            &[("authorization", &host.auth)],
        )
        .await;
    assert_eq!(deleted.status, 204, "{deleted:?}");
    let sent = send(&[&a, &b]).await;
    assert_eq!(sent, vec![status(&a, "error"), status(&b, "queued")]);

    mark_dead_through_the_registry(&mut gateway, &b).await;
    let marked_at = Instant::now();
    while send(&[&b]).await != vec![status(&b, "dead")] {
        assert!(
            marked_at.elapsed() < Duration::from_secs(2),
            "the facade still resolves a dead phone as alive"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And kept again once the change has settled (a second, for other registry replicas).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(send(&[&b]).await, vec![status(&b, "dead")]);
    let before = resolves_from_memory(&mut gateway).await;
    assert_eq!(send(&[&b]).await, vec![status(&b, "dead")]);
    assert!(resolves_from_memory(&mut gateway).await > before);
}
