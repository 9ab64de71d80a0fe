//! Provider outages, stalls and stops against a real gateway: a provider that fails for everyone is
//! held (probed, not hammered) and its backlog drains when it recovers; one provider cannot starve
//! the other; APNs tokens are re-signed once per generation; a stop hands work back and exits 0.

use std::time::Duration;

use orca_push_storage::Pool;
use orca_push_tests::mock_apns::Answer;
use orca_push_tests::world::{World, alert};
use orca_push_tests::{Backend, Gateway};
use serde_json::json;

const ANDROID: &str = "fcm-token:APA91bHun4MxP5egoKMwt2KZFBaFUH-1RYqx";

fn ios_token(i: usize) -> String {
    format!("{i:04x}b2c3d4e5f60718293a4b5c6d7e8f90")
}

async fn metric(w: &mut World, name: &str) -> f64 {
    orca_push_tests::scrape_sum(&w.gateway.process("all").metrics_url(), name, &[]).await
}

/// `n` iPhones registered, each of whose sends APNs answers 503 (down for everyone).
async fn iphones_apns_refuses(w: &mut World, n: usize) -> Vec<String> {
    let mut phones = Vec::new();
    for i in 0..n {
        let token = ios_token(i);
        w.apns
            .always(&token, Answer::status(503, Some("ServiceUnavailable")));
        phones.push(w.register_ios(&format!("iphone-{i}"), &token).await);
    }
    phones
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_down_for_everyone_is_probed_not_hammered_and_drains_when_it_recovers() {
    let mut w = World::start_with(Backend::Sqlite, "0", &[("ORCA_PUSH_RETRY_BASE_MS", "50")]).await;
    let phones = iphones_apns_refuses(&mut w, 40).await;
    let pixel = w.register_android("pixel", ANDROID).await;
    for (n, chunk) in phones.chunks(20).enumerate() {
        let ids: Vec<&str> = chunk.iter().map(String::as_str).collect();
        assert!(
            w.send(&ids, alert(n as u64))
                .await
                .iter()
                .all(|s| s == "queued")
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The other provider is not starved while this one fails.
    let sent = std::time::Instant::now();
    w.send(&[&pixel], alert(7)).await;
    w.fcm.wait_for(ANDROID, 1, Duration::from_secs(5)).await;
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "{:?}",
        sent.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Without a breaker, 40 batches retried every 50 ms to 1.6 s would make hundreds of calls in
    // these 6 s; held, they make the first round, the failures that open the circuit, and a probe
    // per hold (2 s, then 4 s).
    let calls = w.apns.calls().len();
    assert!(calls <= 60, "{calls} calls to a provider that is down");
    assert_eq!(
        metric(&mut w, "orca_push_provider_circuit_open{provider=\"apns\"}").await,
        1.0
    );
    // Every alert is still waiting, none was given up.
    for id in &phones {
        assert_eq!(w.outcome(id).await, ["pending"]);
    }
    w.apns.heal();
    let healed = std::time::Instant::now();
    for id in &phones {
        w.wait_outcome(id, "sent").await;
    }
    // The next probe (at most one hold, 8 s here) closes the circuit and releases the backlog.
    assert!(
        healed.elapsed() < Duration::from_secs(15),
        "{:?}",
        healed.elapsed()
    );
    assert_eq!(
        metric(&mut w, "orca_push_provider_circuit_open{provider=\"apns\"}").await,
        0.0
    );
}

/// Once a hold is over, one lane claims one batch to be the probe, and the provider's other work
/// stays in the queue. Before, every lane claimed that work in full and handed all but the probe
/// back, one write each: 96 at one probe in the admission benchmark (docs/benchmarks.md, round
/// 47), 56 ms in which admissions waited for SQLite's writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_claims_one_batch_and_hands_none_back() {
    const HELD: &str = "orca_push_delivery_hand_backs_total{reason=\"provider_held\"}";
    const OPEN: &str = "orca_push_provider_circuit_open{provider=\"apns\"}";
    let mut w = World::start_with(Backend::Sqlite, "0", &[("ORCA_PUSH_RETRY_BASE_MS", "50")]).await;
    let phones = iphones_apns_refuses(&mut w, 60).await;
    let ids: Vec<&str> = phones.iter().map(String::as_str).collect();
    // The first 20 open the breaker (eight failures in a row): held for 2 s.
    w.send(&ids[..20], alert(1)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while metric(&mut w, OPEN).await < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the breaker never opened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let opened = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 40 more while it is held: due at once, they wait for the probe. (A lane whose claim began
    // before the breaker opened may be handed some of them, and hand them back: counted before.)
    for chunk in ids[20..].chunks(20) {
        assert!(w.send(chunk, alert(2)).await.iter().all(|s| s == "queued"));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = metric(&mut w, HELD).await;
    let calls_before = w.apns.calls().len();
    // The probe goes out when the hold ends, fails, and the work is held again (4 s).
    tokio::time::sleep(
        (opened + Duration::from_millis(3500)).saturating_duration_since(std::time::Instant::now()),
    )
    .await;
    assert_eq!(
        w.apns.calls().len(),
        calls_before + 1,
        "the probe, and nothing else"
    );
    let handed_back = metric(&mut w, HELD).await - before;
    assert!(
        handed_back <= 3.0,
        "{handed_back} batches claimed at the probe and handed back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_provider_token_is_re_signed_once_however_many_requests_saw_it() {
    let mut w = World::start(Backend::Sqlite, "0").await;
    let mut phones = Vec::new();
    for i in 0..12 {
        let token = ios_token(i);
        w.apns.script(
            &token,
            vec![Answer::status(403, Some("ExpiredProviderToken"))],
        );
        phones.push(w.register_ios(&format!("iphone-{i}"), &token).await);
    }
    let ids: Vec<&str> = phones.iter().map(String::as_str).collect();
    w.send(&ids, alert(1)).await;
    for id in &phones {
        w.wait_outcome(id, "sent").await;
    }
    // The first token, then one more for the twelve refusals of it.
    assert_eq!(
        metric(&mut w, "orca_push_apns_tokens_signed_total").await,
        2.0
    );
    // Our stale token says nothing of APNs: twelve refusals of it open no breaker (eight failures
    // would), so no APNs work was held for them.
    assert_eq!(
        metric(&mut w, "orca_push_provider_circuit_opened_total").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_gateway_stops_at_once_and_exits_zero() {
    let mut w = World::start(Backend::Sqlite, "0").await;
    // The lanes are in their long-poll claims.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (took, status) = w
        .gateway
        .process("all")
        .terminate_with_status(Duration::from_secs(12))
        .await
        .expect("exited");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(4), "took {took:?}");
}

/// A split queue stops while the sender's lanes wait in its long-poll claims (up to 10 s each):
/// those claims end at once, empty, so the queue exits within its grace, with status 0, rather
/// than wait them out into the hard stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_stops_at_once_while_lanes_wait_in_its_claims() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    // The lanes are in their long-poll claims.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (took, status) = gateway
        .process("queue")
        .terminate_with_status(Duration::from_secs(12))
        .await
        .expect("the queue exited");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(4), "took {took:?}");
}

/// The sender stops while its lanes wait in long-poll claims: those claims end with it, so work
/// admitted afterwards is not leased to a lane that is gone, and a new sender takes it at once
/// instead of after the 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_sender_leaves_no_lease_behind() {
    let apns = orca_push_tests::mock_apns::MockApns::start().await;
    let mut env = apns.env();
    env.push(("ORCA_PUSH_COALESCE_MS".into(), "0".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut gateway = Gateway::start_split_with(Backend::Postgres, &env).await;
    let raw = orca_push_tests::Raw::new(&gateway);
    let auth = orca_push_tests::bearer(&raw.login(&orca_push_host::HostKey::generate(), &[]).await);
    let token = ios_token(1);
    let id = raw.register(&auth, &json!({ "v": 1, "deviceId": "iphone", "platform": "ios", "token": token, "apnsEnvironment": "production" })).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (took, status) = gateway
        .process("sender")
        .terminate_with_status(Duration::from_secs(12))
        .await
        .expect("the sender exited");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(4), "took {took:?}");
    let reply = raw
        .post(
            "/v1/send",
            &json!({ "v": 1, "registrationIds": [id], "notification": alert(1) }),
            &[("authorization", &auth)],
        )
        .await;
    assert_eq!(reply.body["results"][0]["status"], "queued");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let sql = "SELECT state FROM push_delivery_batches";
    let states: Vec<String> =
        match orca_push_storage::open(&gateway.database, &orca_push_queue::STORAGE)
            .await
            .unwrap()
        {
            Pool::Sqlite(p) => sqlx::query_scalar(sql).fetch_all(&p).await.unwrap(),
            Pool::Postgres(p) => sqlx::query_scalar(sql).fetch_all(&p).await.unwrap(),
        };
    assert_eq!(states, ["pending"], "nobody holds a lease on it");
    gateway.process("sender").respawn().await;
    apns.wait_for(&token, 1, Duration::from_secs(10)).await;
}

/// The FCM token endpoint's own breaker: while it refuses every fetch, sends stop asking it
/// after a few failures (one probe per hold), and the first probe after it recovers succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_token_endpoint_is_not_asked_again_for_every_send() {
    use orca_push_sender::breaker::{FIRST_HOLD, TRIP_AFTER};
    use orca_push_sender::fcm::{Fcm, TokenSource};
    use orca_push_sender::verdict::Verdict;

    let mock = orca_push_tests::mock_fcm::MockFcm::start().await;
    mock.set_token_endpoint_down(true);
    let env: std::collections::HashMap<String, String> = mock.env().into_iter().collect();
    let tls =
        orca_push_sender::tls::h2_client_config(orca_push_sender::tls::root_store(None).unwrap())
            .unwrap();
    let fcm = Fcm::new(
        &env["ORCA_PUSH_FCM_URL"],
        "onorca-cloud",
        &TokenSource::ServiceAccountFile(env["GOOGLE_APPLICATION_CREDENTIALS"].clone().into()),
        &tls,
    )
    .await
    .unwrap();
    let message = json!({ "message": { "token": ANDROID, "data": { "kind": "probe" } } });
    for _ in 0..50 {
        let verdict = fcm.send(message.clone(), true).await;
        assert!(
            matches!(
                verdict,
                Verdict::Retry {
                    answered: false,
                    ..
                }
            ),
            "{verdict:?}"
        );
    }
    let asked = mock.token_requests();
    assert!(
        asked <= 2 * TRIP_AFTER as usize,
        "{asked} token requests for 50 sends"
    );
    mock.set_token_endpoint_down(false);
    tokio::time::sleep(FIRST_HOLD + Duration::from_millis(100)).await;
    assert_eq!(fcm.send(message, true).await, Verdict::Sent);
}

/// A provider that answers only after the event's deadline: the attempt ends at the deadline and
/// the batch expires (before, it was sent and reported `sent` 8 s later), and its lease is not
/// renewed past the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_sent_or_renewed_past_the_deadline() {
    let mut w = World::start_with(Backend::Sqlite, "0", &[("ORCA_PUSH_LEASE_MS", "1000")]).await;
    let ios = w.register_ios("iphone", &ios_token(1)).await;
    w.apns.set_latency(Duration::from_secs(8));
    let mut short = alert(1);
    short["expiresAt"] = json!(orca_push_tests::now_ms() + 3_000);
    let sent = std::time::Instant::now();
    w.send(&[&ios], short).await;
    w.wait_outcome(&ios, "expired").await;
    assert!(
        sent.elapsed() < Duration::from_secs(7),
        "{:?}",
        sent.elapsed()
    );
    // Renewed every third of the 1 s lease until the deadline, 3 s after the send: about 9.
    let renewals = orca_push_tests::scrape_sum(
        &w.gateway.process("all").metrics_url(),
        "orca_push_grpc_server_calls_total",
        &[("method", "RenewLease")],
    )
    .await;
    assert!((1.0..=12.0).contains(&renewals), "{renewals} renewals");
}
