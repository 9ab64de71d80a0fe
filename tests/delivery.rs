//! Delivery end to end: a real gateway delivering to mock APNs (HTTP/2 over TLS, JWT checked) and
//! mock FCM (OAuth assertion checked), on SQLite and on PostgreSQL where storage matters.

use std::time::{Duration, Instant};

use orca_push_host::HostKey;
use orca_push_storage::Pool;
use orca_push_tests::mock_apns::{Answer, MockApns};
use orca_push_tests::mock_fcm::{FcmAnswer, MockFcm, fcm_error};
use orca_push_tests::world::{WAIT, World, alert};
use orca_push_tests::{Backend, Gateway, Raw, bearer, on_both_backends, scrape_sum};
use serde_json::{Value, json};

const IOS: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90";
const ANDROID: &str = "fcm-token:APA91bHun4MxP5egoKMwt2KZFBaFUH-1RYqx";

on_both_backends!(
    an_alert_reaches_both_providers_exactly_as_the_contract_says,
    a_burst_reaches_each_phone_as_one_summary,
    dead_tokens_of_every_class_are_marked_and_answered_dead,
    a_token_refused_after_the_phone_replaced_it_still_delivers_to_the_new_one,
    a_split_sender_keeps_the_phones_it_looked_up_and_hears_a_new_token,
);

async fn an_alert_reaches_both_providers_exactly_as_the_contract_says(backend: Backend) {
    let w = World::start(backend, "0").await;
    let ios = w.register_ios("iphone", IOS).await;
    let android = w.register_android("pixel", ANDROID).await;
    assert_eq!(
        w.send(&[&ios, &android], alert(1)).await,
        ["queued", "queued"]
    );

    let call = w.apns.wait_for(IOS, 1, WAIT).await.remove(0);
    assert_eq!(call.path, format!("/3/device/{IOS}"));
    assert_eq!(call.headers["apns-topic"], "com.stably.orca.mobile");
    assert_eq!(call.headers["apns-push-type"], "alert");
    assert_eq!(call.headers["apns-priority"], "10");
    let expiration: u64 = call.headers["apns-expiration"].parse().unwrap();
    let now_s = orca_push_tests::now_ms() / 1000;
    assert!(
        (now_s + 290..=now_s + 300).contains(&expiration),
        "deadline: five minutes after acceptance"
    );
    let collapse = &call.headers["apns-collapse-id"];
    assert_eq!(collapse.len(), 64);
    let fingerprint = HostKey::from_secret([7u8; 32]).fingerprint();
    assert_eq!(
        call.body,
        json!({
            "aps": { "alert": { "title": "Agent finished", "body": "Refactor done" }, "sound": "default", "thread-id": fingerprint },
            "orca": {
                "hostFingerprint": fingerprint, "worktreeId": "wt-1", "notificationId": "task-1",
                "notificationSeq": 1, "notificationEpoch": "epoch-1", "source": "agent-task-complete",
                "agentState": "finished", "coalescedCount": 1
            }
        })
    );
    assert_eq!(w.apns.rejected_jwts(), 0);

    let message = w.fcm.wait_for(ANDROID, 1, WAIT).await.remove(0).message;
    assert_eq!(message["token"], ANDROID);
    assert_eq!(
        message["notification"],
        json!({ "title": "Agent finished", "body": "Refactor done" })
    );
    assert_eq!(message["android"]["priority"], "HIGH");
    let ttl = message["android"]["ttl"]
        .as_str()
        .unwrap()
        .trim_end_matches('s')
        .parse::<u64>()
        .unwrap();
    assert!((290..=300).contains(&ttl), "{ttl}");
    assert_eq!(
        message["android"]["notification"],
        json!({ "channel_id": "orca-desktop", "tag": collapse })
    );
    assert_eq!(
        message["android"]["collapse_key"].as_str().unwrap().len(),
        32
    );
    assert_eq!(
        message["data"],
        json!({
            "hostFingerprint": fingerprint, "worktreeId": "wt-1", "notificationId": "task-1",
            "notificationSeq": "1", "notificationEpoch": "epoch-1", "source": "agent-task-complete",
            "agentState": "finished", "coalescedCount": "1"
        })
    );
    w.wait_outcome(&ios, "sent").await;
    w.wait_outcome(&android, "sent").await;
}

async fn a_burst_reaches_each_phone_as_one_summary(backend: Backend) {
    let w = World::start(backend, "700").await;
    let ios = w.register_ios("iphone", IOS).await;
    let android = w.register_android("pixel", ANDROID).await;
    for seq in 1..=3 {
        let mut n = alert(seq);
        if seq == 2 {
            n["agentState"] = json!("needs-input");
        }
        w.send(&[&ios, &android], n).await;
    }
    let call = w.apns.wait_for(IOS, 1, WAIT).await.remove(0);
    assert_eq!(
        call.body["aps"]["alert"],
        json!({ "title": "Orca", "body": "3 agents need attention" })
    );
    assert_eq!(call.body["orca"]["coalescedCount"], 3);
    assert_eq!(
        call.body["orca"]["notificationSeq"], 3,
        "the latest event's routing fields"
    );
    assert_eq!(
        call.body["orca"]["summaryMembers"],
        json!([
            { "notificationId": "task-1", "notificationEpoch": "epoch-1", "notificationSeq": 1 },
            { "notificationId": "task-2", "notificationEpoch": "epoch-1", "notificationSeq": 2 },
            { "notificationId": "task-3", "notificationEpoch": "epoch-1", "notificationSeq": 3 },
        ])
    );
    let message = w.fcm.wait_for(ANDROID, 1, WAIT).await.remove(0).message;
    assert_eq!(message["data"]["coalescedCount"], "3");
    let members: Value =
        serde_json::from_str(message["data"]["summaryMembers"].as_str().unwrap()).unwrap();
    assert_eq!(members, call.body["orca"]["summaryMembers"]);
    assert_eq!(
        message["android"]["notification"]["tag"],
        call.headers["apns-collapse-id"].as_str()
    );
    // One provider request per phone for the whole burst.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(w.apns.calls_for(IOS).len(), 1);
    assert_eq!(w.fcm.calls_for(ANDROID).len(), 1);
}

async fn dead_tokens_of_every_class_are_marked_and_answered_dead(backend: Backend) {
    let mut w = World::start(backend, "0").await;
    let apns_cases = [
        (Answer::status(410, Some("Unregistered")), "aa01"),
        (Answer::status(400, Some("BadDeviceToken")), "aa02"),
        (Answer::status(400, Some("Unregistered")), "aa03"),
        (Answer::status(400, Some("DeviceTokenNotForTopic")), "aa04"),
    ];
    let mut ids = Vec::new();
    for (i, (answer, token)) in apns_cases.into_iter().enumerate() {
        w.apns.script(token, vec![answer]);
        ids.push(w.register_ios(&format!("ios-{i}"), token).await);
    }
    let fcm_cases = [
        (
            fcm_error(
                404,
                "NOT_FOUND",
                "UNREGISTERED",
                "Requested entity was not found.",
            ),
            "f".repeat(40),
        ),
        (
            fcm_error(
                400,
                "INVALID_ARGUMENT",
                "INVALID_ARGUMENT",
                "The registration token is not a valid FCM registration token",
            ),
            "g".repeat(40),
        ),
    ];
    for (i, (answer, token)) in fcm_cases.into_iter().enumerate() {
        w.fcm.script(&token, vec![answer]);
        ids.push(w.register_android(&format!("android-{i}"), &token).await);
    }
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    assert!(
        w.send(&id_refs, alert(1))
            .await
            .iter()
            .all(|s| s == "queued")
    );
    for id in &ids {
        w.wait_outcome(id, "dead").await;
    }
    let metrics = w.gateway.process("all").metrics_url();
    let dead_tokens = scrape_sum(&metrics, "orca_push_dead_tokens_total", &[]);
    assert_eq!(dead_tokens.await, ids.len() as f64);
    // The next send to any of them answers `dead`, and the host sees it.
    assert!(w.send(&id_refs, alert(2)).await.iter().all(|s| s == "dead"));
    let devices = w
        .raw
        .get("/v1/devices", &[("authorization", &w.auth)])
        .await;
    assert!(
        devices.body["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["dead"] == true)
    );
    // A token replaced after the send stays alive: re-registering revives the registration.
    w.register_ios("ios-0", "bb01").await;
    assert_eq!(w.send(&[&ids[0]], alert(3)).await, ["queued"]);
}

/// The provider refuses a token as dead after the phone registered a new one (a reinstall while
/// the alert was on its way): the registration stays alive, and the alert goes to the new token
/// rather than ending `dead`.
async fn a_token_refused_after_the_phone_replaced_it_still_delivers_to_the_new_one(
    backend: Backend,
) {
    let mut w = World::start(backend, "0").await;
    let (old, new) = ("cc01", "cc02");
    w.apns
        .script(old, vec![Answer::status(410, Some("Unregistered"))]);
    let id = w.register_ios("iphone", old).await;
    // The refusal comes a while after the request: the phone re-registers meanwhile.
    w.apns.set_latency(Duration::from_millis(1500));
    assert_eq!(w.send(&[&id], alert(1)).await, ["queued"]);
    w.apns.wait_for(old, 1, WAIT).await;
    assert_eq!(
        w.register_ios("iphone", new).await,
        id,
        "the same registration"
    );
    w.apns.set_latency(Duration::ZERO);
    w.apns.wait_for(new, 1, WAIT).await;
    w.wait_outcome(&id, "sent").await;
    assert_eq!(
        w.batches(&id).await[0].attempts,
        1,
        "the refusal of a token the phone had left is no attempt"
    );
    let devices = w
        .raw
        .get("/v1/devices", &[("authorization", &w.auth)])
        .await;
    assert_eq!(
        devices.body["devices"][0]["dead"], false,
        "{}",
        devices.body
    );
    let metrics = w.gateway.process("all").metrics_url();
    let dead_tokens = scrape_sum(&metrics, "orca_push_dead_tokens_total", &[]);
    assert_eq!(
        dead_tokens.await,
        0.0,
        "a token the phone had left is no dead token"
    );
}

/// The providers' 4 KB holds for a summary whose latest event has the longest epoch the contract
/// allows, each character a control character (six bytes escaped): the budget counts the epoch the
/// summary names at the top level, so such an alert opens a batch of its own rather than join.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_stays_within_4_kb_whatever_its_latest_epoch() {
    let w = World::start(Backend::Sqlite, "800").await;
    let id = w.register_ios("iphone", IOS).await;
    let epoch = "\u{1}".repeat(128);
    let first = json!({
        "notificationId": "a", "notificationSeq": 1, "notificationEpoch": epoch,
        "source": "agent-task-complete", "agentState": "finished",
        "title": "Agent finished", "body": "Done",
    });
    let second = json!({
        "notificationId": "n", "notificationSeq": 2, "notificationEpoch": epoch,
        "source": "agent-task-complete", "agentState": "needs-input",
        "title": "Agent waiting", "body": "Input needed", "worktreeId": "w".repeat(1376),
    });
    assert_eq!(w.send(&[&id], first).await, ["queued"]);
    assert_eq!(w.send(&[&id], second).await, ["queued"]);
    let until = Instant::now() + WAIT;
    while w.outcome(&id).await != ["sent", "sent"] {
        assert!(Instant::now() < until, "{:?}", w.outcome(&id).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for call in w.apns.calls_for(IOS) {
        let bytes = serde_json::to_vec(&call.body).unwrap().len();
        assert!(bytes <= 4096, "an APNs body of {bytes} bytes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_alerts_and_dismissals_use_their_own_shapes() {
    let w = World::start(Backend::Sqlite, "0").await;
    let ios = w.register_ios("iphone", IOS).await;
    let android = w.register_android("pixel", ANDROID).await;
    let mut silent = alert(1);
    silent["sound"] = json!(false);
    w.send(&[&ios, &android], silent).await;
    let call = w.apns.wait_for(IOS, 1, WAIT).await.remove(0);
    assert!(call.body["aps"].get("sound").is_none());
    assert_eq!(call.body["aps"]["alert"]["title"], "Agent finished");
    let message = w.fcm.wait_for(ANDROID, 1, WAIT).await.remove(0).message;
    assert_eq!(
        message["android"]["notification"]["channel_id"],
        "orca-desktop-silent"
    );
    let alert_collapse_key = message["android"]["collapse_key"].clone();

    let mut dismissal = alert(2);
    dismissal["kind"] = json!("dismiss");
    dismissal["notificationId"] = json!("task-1");
    w.send(&[&ios, &android], dismissal).await;
    let call = w.apns.wait_for(IOS, 2, WAIT).await.remove(1);
    assert_eq!(call.headers["apns-push-type"], "background");
    assert_eq!(call.headers["apns-priority"], "5");
    assert!(!call.headers.contains_key("apns-collapse-id"));
    assert_eq!(call.body["aps"], json!({ "content-available": 1 }));
    assert_eq!(call.body["orca"]["kind"], "dismiss");
    assert_eq!(call.body["orca"]["notificationId"], "task-1");
    let message = w.fcm.wait_for(ANDROID, 2, WAIT).await.remove(1).message;
    assert!(message.get("notification").is_none());
    assert!(message["android"].get("notification").is_none());
    assert_eq!(message["data"]["kind"], "dismiss");
    // Its alert's collapse key: offline, the phone is kept only the dismissal.
    assert_eq!(message["android"]["collapse_key"], alert_collapse_key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured_and_never_shortened() {
    let w = World::start(Backend::Sqlite, "0").await;
    let ios = w.register_ios("iphone", IOS).await;
    w.apns.script(
        IOS,
        vec![Answer {
            status: 429,
            retry_after: Some(3),
            reason: Some("TooManyRequests"),
        }],
    );
    w.send(&[&ios], alert(1)).await;
    let calls = w.apns.wait_for(IOS, 2, WAIT).await;
    let gap = calls[1].at - calls[0].at;
    assert!(gap >= Duration::from_millis(2900), "{gap:?}");
    w.wait_outcome(&ios, "sent").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_outage_is_retried_until_the_provider_recovers() {
    // A short backoff base keeps the test quick; the policy is the production one.
    let w = World::start_with(Backend::Sqlite, "0", &[("ORCA_PUSH_RETRY_BASE_MS", "50")]).await;
    let ios = w.register_ios("iphone", IOS).await;
    w.apns.script(
        IOS,
        vec![Answer::status(503, Some("ServiceUnavailable")); 6],
    );
    w.send(&[&ios], alert(1)).await;
    // Six refusals, then the seventh attempt is delivered: a transient failure is not capped.
    let calls = w.apns.wait_for(IOS, 7, WAIT).await;
    w.wait_outcome(&ios, "sent").await;
    // The backoff grows (jittered between half and all of 50 ms, 100 ms, 200 ms, ...).
    let gaps: Vec<Duration> = calls.windows(2).map(|p| p[1].at - p[0].at).collect();
    assert!(gaps[5] >= Duration::from_millis(800), "{gaps:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_that_looks_permanent_is_capped() {
    let w = World::start_with(Backend::Sqlite, "0", &[("ORCA_PUSH_RETRY_BASE_MS", "50")]).await;
    let ios = w.register_ios("iphone", IOS).await;
    w.apns
        .always(IOS, Answer::status(403, Some("InvalidProviderToken")));
    w.send(&[&ios], alert(1)).await;
    w.wait_outcome(&ios, "failed").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        w.apns.calls_for(IOS).len(),
        5,
        "five provider answers, then given up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_would_pass_its_deadline_expires_instead() {
    let w = World::start(Backend::Sqlite, "0").await;
    let ios = w.register_ios("iphone", IOS).await;
    w.apns.script(
        IOS,
        vec![Answer {
            status: 429,
            retry_after: Some(10),
            reason: Some("TooManyRequests"),
        }],
    );
    let mut short = alert(1);
    short["expiresAt"] = json!(orca_push_tests::now_ms() + 3_000);
    w.send(&[&ios], short).await;
    w.wait_outcome(&ios, "expired").await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(w.apns.calls_for(IOS).len(), 1, "no late send");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_tokens_are_reused_across_sends() {
    let w = World::start(Backend::Sqlite, "0").await;
    let ios = w.register_ios("iphone", IOS).await;
    let android = w.register_android("pixel", ANDROID).await;
    for seq in 0..5 {
        w.send(&[&ios, &android], alert(seq)).await;
    }
    let calls = w.apns.wait_for(IOS, 5, WAIT).await;
    assert!(
        calls.iter().all(|c| c.jwt == calls[0].jwt),
        "one ES256 token for every send"
    );
    w.fcm.wait_for(ANDROID, 5, WAIT).await;
    assert_eq!(w.fcm.token_requests(), 1, "one OAuth token for every send");
    assert_eq!(w.fcm.rejected_assertions(), 0);
    assert_eq!(w.apns.connections(), 1, "one long-lived HTTP/2 connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfigured_provider_fails_its_deliveries_and_not_the_others() {
    let fcm = MockFcm::start().await;
    let env: Vec<(String, String)> = fcm.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut gateway = Gateway::start_with(Backend::Sqlite, &env).await;
    let raw = Raw::new(&gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let h = [("authorization", auth.as_str())];
    let ios = raw.register(&auth, &json!({ "v": 1, "deviceId": "i", "platform": "ios", "token": IOS, "apnsEnvironment": "sandbox" })).await;
    let android = raw
        .register(
            &auth,
            &json!({ "v": 1, "deviceId": "a", "platform": "android", "token": ANDROID }),
        )
        .await;
    raw.post(
        "/v1/send",
        &json!({ "v": 1, "registrationIds": [ios, android], "notification": alert(1) }),
        &h,
    )
    .await;
    fcm.wait_for(ANDROID, 1, WAIT).await;
    let sql = "SELECT status FROM push_event_recipients WHERE registration_id = $1";
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let status: Option<String> =
            match orca_push_storage::open(&gateway.database, &orca_push_queue::STORAGE)
                .await
                .unwrap()
            {
                Pool::Sqlite(p) => sqlx::query_scalar(sql)
                    .bind(&ios)
                    .fetch_optional(&p)
                    .await
                    .unwrap(),
                Pool::Postgres(p) => sqlx::query_scalar(sql)
                    .bind(&ios)
                    .fetch_optional(&p)
                    .await
                    .unwrap(),
            };
        if status.as_deref() == Some("failed") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gateway.logs().contains("APNs is not configured"));
    // Provider latency counts requests made: FCM's one, and nothing for the APNs that never was.
    let metrics = gateway.process("all").metrics_url();
    let requests = |provider: &'static str| {
        let metrics = metrics.clone();
        async move {
            scrape_sum(
                &metrics,
                "orca_push_provider_request_duration_seconds_count",
                &[("provider", provider)],
            )
            .await
        }
    };
    let deadline = std::time::Instant::now() + WAIT;
    while requests("fcm").await < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "FCM's request is timed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(requests("apns").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcm_retries_a_quota_refusal_no_sooner_than_a_minute() {
    let w = World::start(Backend::Sqlite, "0").await;
    let android = w.register_android("pixel", ANDROID).await;
    w.fcm.script(
        ANDROID,
        vec![FcmAnswer {
            status: 429,
            body: json!({}),
            retry_after: Some(1),
        }],
    );
    w.send(&[&android], alert(1)).await;
    w.fcm.wait_for(ANDROID, 1, WAIT).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        w.fcm.calls_for(ANDROID).len(),
        1,
        "Retry-After 1 s is raised to FCM's one-minute minimum"
    );
    assert_eq!(w.outcome(&android).await, ["pending"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcm_tokens_come_from_the_metadata_server_without_a_service_account() {
    let fcm = MockFcm::start().await;
    let env = fcm.metadata_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let gateway = Gateway::start_with(Backend::Sqlite, &env).await;
    let raw = Raw::new(&gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let h = [("authorization", auth.as_str())];
    let id = raw
        .register(
            &auth,
            &json!({ "v": 1, "deviceId": "a", "platform": "android", "token": ANDROID }),
        )
        .await;
    raw.post(
        "/v1/send",
        &json!({ "v": 1, "registrationIds": [id], "notification": alert(1) }),
        &h,
    )
    .await;
    fcm.wait_for(ANDROID, 1, WAIT).await;
    assert_eq!(fcm.metadata_requests(), 1);
    assert_eq!(fcm.token_requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fcm_probe_is_a_validate_only_send() {
    let fcm = MockFcm::start().await;
    let output = tokio::process::Command::new(orca_push_tests::binary())
        .args(["probe-fcm", "--token", ANDROID])
        .envs(fcm.env())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("fcm: ok"));
    let calls = fcm.validate_only_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].token, ANDROID);
    // Credentials FCM refuses make the probe fail.
    let broken = MockFcm::start().await;
    let mut env = broken.env();
    env.retain(|(k, _)| k != "ORCA_PUSH_FCM_URL");
    env.push(("ORCA_PUSH_FCM_URL".into(), "http://127.0.0.1:9".into()));
    let output = tokio::process::Command::new(orca_push_tests::binary())
        .args(["probe-fcm", "--token", ANDROID])
        .envs(env)
        .env("RUST_LOG", "off")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_opens_another_connection_only_when_the_open_ones_are_saturated() {
    use orca_push_sender::apns::ApnsPool;
    let apns = MockApns::start().await;
    apns.set_latency(Duration::from_millis(300));
    let roots = orca_push_sender::tls::root_store(Some(apns.ca_file.path())).unwrap();
    let tls = orca_push_sender::tls::h2_client_config(roots).unwrap();
    let pool = std::sync::Arc::new(ApnsPool::new(&apns.url, tls, 4).unwrap());
    let token = orca_push_sender::apns::ProviderToken::new(
        &apns.key_pem,
        orca_push_tests::mock_apns::KEY_ID,
        orca_push_tests::mock_apns::TEAM_ID,
    )
    .unwrap();
    let bearer = token.bearer().unwrap().token;
    let request = orca_push_sender::payload::ApnsRequest {
        path: "/3/device/abcd".into(),
        headers: vec![("apns-topic", "t".into())],
        body: b"{}".to_vec(),
    };
    // Four at once fit one connection.
    let four = (0..4).map(|_| pool.send(&request, &bearer));
    assert!(
        futures::future::join_all(four)
            .await
            .iter()
            .all(|r| matches!(r, Ok((200, _, _))))
    );
    assert_eq!(apns.connections(), 1);
    // Ten at once saturate it: more connections open, and are kept for later.
    let ten = (0..10).map(|_| pool.send(&request, &bearer));
    assert!(
        futures::future::join_all(ten)
            .await
            .iter()
            .all(|r| matches!(r, Ok((200, _, _))))
    );
    assert_eq!(apns.connections(), 3);
    assert_eq!(pool.connection_count().await, 3);
    let again = (0..4).map(|_| pool.send(&request, &bearer));
    futures::future::join_all(again).await;
    assert_eq!(
        apns.connections(),
        3,
        "no new connection while open ones have room"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_is_re_read_before_every_attempt() {
    let w = World::start(Backend::Sqlite, "800").await;
    let replaced = w.register_ios("iphone", IOS).await;
    let deleted = w.register_ios("ipad", "dd01").await;
    w.send(&[&replaced, &deleted], alert(1)).await;
    // While the alerts wait in their window, one phone gets a new token and the other is removed.
    w.register_ios("iphone", "ee02").await;
    let reply = w
        .raw
        .delete(
            &format!("/v1/devices/{deleted}"),
            &[("authorization", &w.auth)],
        )
        .await;
    assert_eq!(reply.status, 204);
    w.apns.wait_for("ee02", 1, WAIT).await;
    w.wait_outcome(&deleted, "failed").await;
    assert!(
        w.apns.calls_for(IOS).is_empty(),
        "the replaced token gets nothing"
    );
    assert!(
        w.apns.calls_for("dd01").is_empty(),
        "the deleted device gets nothing"
    );
}

/// Split mode: the sender keeps the phones its lanes looked up while the registry's device watch
/// vouches for them (otherwise a call across a socket per claim), and still delivers to what the
/// registry holds: a phone given a new token gets the next alerts at it once the watch brings the
/// change (milliseconds), well within the ten seconds an entry is kept at most.
async fn a_split_sender_keeps_the_phones_it_looked_up_and_hears_a_new_token(backend: Backend) {
    let mut w = World::start_split(backend, "0").await;
    let phone = w.register_ios("iphone", "aa01").await;
    let mut seq = 0;
    let kept_since = Instant::now();
    loop {
        seq += 1;
        assert_eq!(w.send(&[&phone], alert(seq)).await, ["queued"]);
        w.apns.wait_for("aa01", seq as usize, WAIT).await;
        if sender_lookups(&mut w.gateway, "memory").await >= 1.0 {
            break;
        }
        assert!(
            kept_since.elapsed() < Duration::from_secs(10),
            "no look-up was answered from the sender's copy"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.register_ios("iphone", "bb02").await;
    let changed_at = Instant::now();
    loop {
        seq += 1;
        assert_eq!(w.send(&[&phone], alert(seq)).await, ["queued"]);
        let delivered = Instant::now();
        while w.apns.calls_for("aa01").len() + w.apns.calls_for("bb02").len() < seq as usize {
            assert!(delivered.elapsed() < WAIT, "alert {seq} not delivered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if !w.apns.calls_for("bb02").is_empty() {
            break;
        }
        assert!(
            changed_at.elapsed() < Duration::from_secs(2),
            "the sender still delivers to the replaced token"
        );
    }
    let to_old = w.apns.calls_for("aa01").len();
    // From then on the new token gets everything, from the sender's copy again once the change
    // has settled (a second, for other registry replicas).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let kept_before = sender_lookups(&mut w.gateway, "memory").await;
    let settled_at = Instant::now();
    loop {
        seq += 1;
        assert_eq!(w.send(&[&phone], alert(seq)).await, ["queued"]);
        w.apns.wait_for("bb02", seq as usize - to_old, WAIT).await;
        if sender_lookups(&mut w.gateway, "memory").await > kept_before {
            break;
        }
        assert!(
            settled_at.elapsed() < Duration::from_secs(10),
            "the new token's phone is never kept"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(w.apns.calls_for("aa01").len(), to_old);
}

async fn sender_lookups(gateway: &mut Gateway, source: &str) -> f64 {
    scrape_sum(
        &gateway.process("sender").metrics_url(),
        "orca_push_sender_device_lookups_total",
        &[("source", source)],
    )
    .await
}
