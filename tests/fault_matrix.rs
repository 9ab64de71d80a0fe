//! The provider fault matrix (docs/fault-matrix.md): one test per class of provider failure not
//! already proven elsewhere, each end to end against a real gateway, asserting what the provider
//! saw, the recipient's final status and, where the contract is about time, the timing.

use std::time::{Duration, Instant};

use orca_push_tests::fault_proxy::{Fault, FaultProxy, held_for};
use orca_push_tests::mock_apns::{Answer, MockApns};
use orca_push_tests::mock_fcm::{FcmAnswer, MockFcm, fcm_error};
use orca_push_tests::world::{WAIT, World, alert};
use orca_push_tests::{Backend, now_ms};
use serde_json::json;

const IOS: &str = "c0ffee00e5f60718293a4b5c6d7e8f90";
const ANDROID: &str = "fcm-token:APA91bFaultMatrix-0001";
/// A short backoff base: a wrong retry shows within a second, a right one does not take long.
const FAST_RETRIES: (&str, &str) = ("ORCA_PUSH_RETRY_BASE_MS", "50");
/// Recovery after an outage waits for the breaker's next probe (holds double up to 30 s).
const RECOVERY: Duration = Duration::from_secs(60);

async fn fast_world() -> World {
    World::start_with(Backend::Sqlite, "0", &[FAST_RETRIES]).await
}

/// A world whose APNs is reached through a fault proxy starting in `fault`.
async fn world_behind_proxy(fault: Fault) -> (World, FaultProxy) {
    let apns = MockApns::start().await;
    let proxy = FaultProxy::start(apns.port(), fault).await;
    let url = proxy.url_for(&apns.url);
    let extra = [FAST_RETRIES, ("ORCA_PUSH_APNS_URL", url.as_str())];
    let fcm = MockFcm::start().await;
    let world = World::start_around(Backend::Sqlite, "0", &extra, apns, fcm).await;
    (world, proxy)
}

/// `orca_push_apns_tokens_signed_total` as the gateway's /metrics shows it.
async fn signatures(w: &mut World) -> f64 {
    orca_push_tests::scrape_sum(
        &w.gateway.process("all").metrics_url(),
        "orca_push_apns_tokens_signed_total",
        &[],
    )
    .await
}

async fn dead_flags(w: &World) -> std::collections::HashMap<String, bool> {
    let devices = w
        .raw
        .get("/v1/devices", &[("authorization", &w.auth)])
        .await;
    devices.body["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["registrationId"].as_str().unwrap().to_owned(),
                d["dead"] == true,
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_400_reasons_split_dead_tokens_from_refused_payloads() {
    let w = fast_world().await;
    let cases = [
        (400, "BadDeviceToken", "dead"),
        (400, "Unregistered", "dead"),
        (400, "DeviceTokenNotForTopic", "dead"),
        (400, "BadCollapseId", "failed"),
        (400, "PayloadEmpty", "failed"),
        (400, "MissingTopic", "failed"),
        (413, "PayloadTooLarge", "failed"),
    ];
    let mut ids = Vec::new();
    for (i, (status, reason, _)) in cases.iter().enumerate() {
        let token = format!("{i:02x}{}", &IOS[2..]);
        w.apns
            .script(&token, vec![Answer::status(*status, Some(*reason))]);
        ids.push((w.register_ios(&format!("iphone-{i}"), &token).await, token));
    }
    // FCM's payload refusal: INVALID_ARGUMENT that names a field, not the registration token.
    w.fcm.script(
        ANDROID,
        vec![fcm_error(
            400,
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            "Invalid value at 'message.android.ttl'",
        )],
    );
    let android = w.register_android("pixel", ANDROID).await;
    let refs: Vec<&str> = ids
        .iter()
        .map(|(id, _)| id.as_str())
        .chain([android.as_str()])
        .collect();
    w.send(&refs, alert(1)).await;
    for ((id, _), (_, _, expected)) in ids.iter().zip(&cases) {
        w.wait_outcome(id, expected).await;
    }
    w.wait_outcome(&android, "failed").await;
    // Well past several 50 ms backoffs: none of them was tried again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for ((id, token), (_, reason, _)) in ids.iter().zip(&cases) {
        assert_eq!(w.apns.calls_for(token).len(), 1, "{reason}: one call");
        assert_eq!(w.batches(id).await[0].attempts, 1, "{reason}");
    }
    assert_eq!(w.fcm.calls_for(ANDROID).len(), 1);
    // Only the dead reasons mark the device dead; a refused payload says nothing of the token.
    let dead = dead_flags(&w).await;
    for ((id, _), (_, reason, expected)) in ids.iter().zip(&cases) {
        assert_eq!(dead[id], *expected == "dead", "{reason}");
    }
    assert!(!dead[&android]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_403_expired_provider_token_is_retried_once_with_a_new_token() {
    let mut w = World::start(Backend::Sqlite, "0").await;
    let ios = w.register_ios("iphone", IOS).await;
    w.apns
        .script(IOS, vec![Answer::status(403, Some("ExpiredProviderToken"))]);
    w.send(&[&ios], alert(1)).await;
    w.wait_outcome(&ios, "sent").await;
    let calls = w.apns.calls_for(IOS);
    assert_eq!(calls.len(), 2, "the refusal, then the send");
    // Re-signed before the retry: the first token, then one more. (ES256 here is deterministic,
    // so a token re-signed within the same second of `iat` is byte-identical; a really expired
    // one is at least 20 minutes old, so its successor differs.)
    assert_eq!(signatures(&mut w).await, 2.0);
    assert_eq!(w.apns.rejected_jwts(), 0, "both tokens valid ES256");
    // Both answers count; the cap of five is far away and never applies to this class anyway.
    assert_eq!(w.batches(&ios).await[0].attempts, 2);
}

/// FCM refuses our OAuth token on every request that carried it (it went stale with several in
/// flight): the first refusal refreshes it once, and the refusals of the old token that come back
/// after the new one was fetched leave the new one alone, rather than each forcing another fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcm_401s_of_one_stale_token_refresh_it_once() {
    let w = fast_world().await;
    let warm = w.register_android("pixel-warm", ANDROID).await;
    w.send(&[&warm], alert(1)).await;
    w.wait_outcome(&warm, "sent").await;
    assert_eq!(w.fcm.token_requests(), 1);
    // Each request waits 600 ms for its answer; the eight go out 60 ms apart, all with the first
    // token, and their refusals come back 60 ms apart, while the retries (50 ms backoff base) fetch
    // and use the next one.
    w.fcm.set_latency(Duration::from_millis(600));
    let stale = fcm_error(
        401,
        "UNAUTHENTICATED",
        "",
        "Request had invalid authentication credentials.",
    );
    let mut phones = Vec::new();
    for i in 0..8 {
        let token = format!("fcm-token:APA91bStaleOAuthBearerToken-{i:02}");
        w.fcm.script(&token, vec![stale.clone()]);
        phones.push(w.register_android(&format!("pixel-{i}"), &token).await);
    }
    for (i, phone) in phones.iter().enumerate() {
        w.send(&[phone], alert(10 + i as u64)).await;
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    for phone in &phones {
        w.wait_outcome(phone, "sent").await;
    }
    assert_eq!(
        w.fcm.token_requests(),
        2,
        "the first token, then one refresh for all eight refusals"
    );
}

/// A refresh that FCM's 401 asked for, which the token endpoint failed, is still a refresh when
/// next tried: the next send does not go out with the refused token from the OAuth client's own
/// cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_the_token_endpoint_failed_is_forced_again() {
    let w = fast_world().await;
    let warm = w.register_android("pixel-warm", ANDROID).await;
    w.send(&[&warm], alert(1)).await;
    w.wait_outcome(&warm, "sent").await;
    assert_eq!(w.fcm.token_requests(), 1);
    let token = "fcm-token:APA91bRefreshFailedOnce-00";
    let stale = fcm_error(
        401,
        "UNAUTHENTICATED",
        "",
        "Request had invalid authentication credentials.",
    );
    w.fcm.script(token, vec![stale]);
    let phone = w.register_android("pixel", token).await;
    w.fcm.set_token_endpoint_down(true);
    w.send(&[&phone], alert(2)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while w.fcm.token_requests() < 2 {
        assert!(std::time::Instant::now() < deadline, "no refresh tried");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    w.fcm.set_token_endpoint_down(false);
    w.wait_outcome(&phone, "sent").await;
    assert!(
        w.fcm.token_requests() >= 3,
        "sent with a token fetched after the endpoint came back, not the refused one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcm_403_sender_id_mismatch_fails_at_once() {
    let w = fast_world().await;
    let android = w.register_android("pixel", ANDROID).await;
    w.fcm.script(
        ANDROID,
        vec![fcm_error(
            403,
            "PERMISSION_DENIED",
            "SENDER_ID_MISMATCH",
            "SenderId mismatch",
        )],
    );
    w.send(&[&android], alert(1)).await;
    w.wait_outcome(&android, "failed").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(w.fcm.calls_for(ANDROID).len(), 1, "not retried");
    assert!(!dead_flags(&w).await[&android], "the token is not dead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_429_without_retry_after_backs_off_until_sent() {
    let w = fast_world().await;
    let ios = w.register_ios("iphone", IOS).await;
    let throttled = Answer::status(429, Some("TooManyRequests"));
    w.apns.script(IOS, vec![throttled; 6]);
    w.send(&[&ios], alert(1)).await;
    // Six refusals, more than the cap of five for suspect answers, then sent.
    let calls = w.apns.wait_for(IOS, 7, WAIT).await;
    w.wait_outcome(&ios, "sent").await;
    // Retry n waits at least half its ceiling: 25 ms, 50 ms, 100 ms, ... (base 50 ms, doubling).
    for (n, pair) in calls.windows(2).enumerate() {
        let gap = pair[1].at - pair[0].at;
        let floor = Duration::from_millis(25 << n);
        assert!(gap >= floor, "retry {}: {gap:?} < {floor:?}", n + 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcm_429_is_rescheduled_no_sooner_than_a_minute_or_its_retry_after() {
    let w = World::start(Backend::Sqlite, "0").await;
    let bare = "fcm-token:APA91bQuotaWithoutRetryAfter";
    let longer = "fcm-token:APA91bQuotaWithRetryAfter90";
    let quota = |retry_after| FcmAnswer {
        status: 429,
        body: json!({ "error": { "code": 429, "status": "RESOURCE_EXHAUSTED" } }),
        retry_after,
    };
    w.fcm.script(bare, vec![quota(None)]);
    w.fcm.script(longer, vec![quota(Some(90))]);
    let bare_id = w.register_android("pixel-1", bare).await;
    let longer_id = w.register_android("pixel-2", longer).await;
    let sent_ms = now_ms() as i64;
    w.send(&[&bare_id, &longer_id], alert(1)).await;
    w.fcm.wait_for(bare, 1, WAIT).await;
    w.fcm.wait_for(longer, 1, WAIT).await;
    // Read the rescheduled batches instead of waiting a minute for the retry.
    for (id, at_least) in [(&bare_id, 60_000), (&longer_id, 90_000)] {
        let deadline = Instant::now() + WAIT;
        let batch = loop {
            let batch = w.batches(id).await.remove(0);
            if batch.state == "pending" && batch.retries == 1 {
                break batch;
            }
            assert!(Instant::now() < deadline, "{batch:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let delay = batch.available_at - sent_ms;
        assert!(
            delay >= at_least,
            "retry in {delay} ms, wanted >= {at_least}"
        );
        assert_eq!(batch.attempts, 1);
        assert_eq!(w.outcome(id).await, ["pending"]);
    }
}

/// A 3xx from FCM is an answer the gateway classifies (a retry under the cap), not a redirect it
/// follows: followed, whatever answered at the new address would be taken for FCM's word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fcm_redirect_is_an_answer_not_followed() {
    let w = fast_world().await;
    let android = w.register_android("pixel", ANDROID).await;
    let redirect = FcmAnswer {
        status: 307,
        body: json!({}),
        retry_after: None,
    };
    w.fcm.script(ANDROID, vec![redirect]);
    w.send(&[&android], alert(1)).await;
    w.wait_outcome(&android, "sent").await;
    let batch = w.batches(&android).await.remove(0);
    assert_eq!(
        (batch.attempts, batch.retries),
        (2, 1),
        "the redirect counted as an answer and was retried: {batch:?}"
    );
    assert_eq!(w.fcm.calls_for(ANDROID).len(), 2);
}

/// An FCM error answer whose body never arrived whole says nothing of what was wrong: it is tried
/// again, not failed for good as a bare 404 would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fcm_error_answer_cut_off_before_its_body_is_tried_again() {
    let w = fast_world().await;
    let android = w.register_android("pixel", ANDROID).await;
    let cut = FcmAnswer {
        status: 404,
        body: json!(orca_push_tests::mock_fcm::CUT_OFF_BODY),
        retry_after: None,
    };
    w.fcm.script(ANDROID, vec![cut]);
    w.send(&[&android], alert(1)).await;
    w.wait_outcome(&android, "sent").await;
    assert_eq!(w.fcm.calls_for(ANDROID).len(), 2);

    // A 429 whose body was cut off said enough in its head: no sooner than its Retry-After.
    let throttled = "fcm-token:APA91bQuotaWithItsBodyCutOff";
    w.fcm.script(
        throttled,
        vec![FcmAnswer {
            status: 429,
            body: json!(orca_push_tests::mock_fcm::CUT_OFF_BODY),
            retry_after: Some(90),
        }],
    );
    let pixel = w.register_android("pixel-2", throttled).await;
    let sent_ms = now_ms() as i64;
    w.send(&[&pixel], alert(2)).await;
    w.fcm.wait_for(throttled, 1, WAIT).await;
    let deadline = Instant::now() + WAIT;
    let batch = loop {
        let batch = w.batches(&pixel).await.remove(0);
        if batch.state == "pending" && batch.retries == 1 {
            break batch;
        }
        assert!(Instant::now() < deadline, "{batch:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(batch.available_at - sent_ms >= 90_000, "{batch:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_500_is_retried_past_the_cap_until_the_provider_recovers() {
    let w = fast_world().await;
    let ios = w.register_ios("iphone", IOS).await;
    let android = w.register_android("pixel", ANDROID).await;
    w.apns.script(
        IOS,
        vec![Answer::status(500, Some("InternalServerError")); 7],
    );
    w.fcm.script(
        ANDROID,
        vec![fcm_error(500, "INTERNAL", "INTERNAL", "Internal error"); 7],
    );
    w.send(&[&ios, &android], alert(1)).await;
    w.wait_outcome(&ios, "sent").await;
    w.wait_outcome(&android, "sent").await;
    assert_eq!(w.apns.calls_for(IOS).len(), 8, "seven 500s, then sent");
    assert_eq!(w.fcm.calls_for(ANDROID).len(), 8, "seven 500s, then sent");
    assert_eq!(w.batches(&ios).await[0].attempts, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_503_is_retried_past_the_cap_until_the_provider_recovers() {
    let w = fast_world().await;
    let android = w.register_android("pixel", ANDROID).await;
    let unavailable = fcm_error(503, "UNAVAILABLE", "UNAVAILABLE", "Service unavailable");
    let mut answers = vec![unavailable.clone(); 7];
    // One of them asks for two seconds: a 5xx Retry-After is honoured too.
    answers[3].retry_after = Some(2);
    w.fcm.script(ANDROID, answers);
    w.send(&[&android], alert(1)).await;
    let calls = w.fcm.wait_for(ANDROID, 8, WAIT).await;
    w.wait_outcome(&android, "sent").await;
    let gap = calls[4].at - calls[3].at;
    assert!(gap >= Duration::from_millis(1950), "{gap:?}");
    assert_eq!(w.fcm.calls_for(ANDROID).len(), 8, "seven 503s, then sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_connection_refused_costs_no_attempts_and_delivers_when_it_listens_again() {
    let (w, proxy) = world_behind_proxy(Fault::Refuse).await;
    let ios = w.register_ios("iphone", IOS).await;
    w.send(&[&ios], alert(1)).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(w.apns.calls().is_empty());
    assert_eq!(w.outcome(&ios).await, ["pending"]);
    let batch = w.batches(&ios).await.remove(0);
    assert_eq!(
        batch.attempts, 0,
        "no provider answer, no attempt: {batch:?}"
    );
    assert!(batch.retries >= 1, "it was tried: {batch:?}");

    proxy.set(Fault::Pass).await;
    let back = Instant::now();
    w.wait_outcome_within(&ios, "sent", RECOVERY).await;
    eprintln!(
        "connection refused: delivered {:?} after the port listened again",
        back.elapsed()
    );
    assert_eq!(w.apns.calls_for(IOS).len(), 1);
    assert_eq!(w.batches(&ios).await[0].attempts, 1, "the one answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_tls_stall_times_out_at_the_connect_deadline_without_blocking_fcm() {
    let (w, proxy) = world_behind_proxy(Fault::Stall).await;
    let ios = w.register_ios("iphone", IOS).await;
    let android = w.register_android("pixel", ANDROID).await;
    w.send(&[&ios], alert(1)).await;
    let deadline = Instant::now() + WAIT;
    while proxy.stalled().is_empty() {
        assert!(Instant::now() < deadline, "APNs was never dialled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The other provider is not held up by the stalled handshake.
    let asked = Instant::now();
    w.send(&[&android], alert(2)).await;
    w.fcm.wait_for(ANDROID, 1, Duration::from_secs(5)).await;
    w.wait_outcome(&android, "sent").await;
    let android_took = asked.elapsed();
    assert!(android_took < Duration::from_secs(5), "{android_took:?}");

    // The gateway gives the handshake its 10 s connect deadline, then hangs up.
    let deadline = Instant::now() + Duration::from_secs(30);
    let held = loop {
        if let Some(held) = proxy.stalled().first().and_then(held_for) {
            break held;
        }
        assert!(
            Instant::now() < deadline,
            "the stalled handshake was never given up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        held >= Duration::from_secs(9) && held < Duration::from_secs(20),
        "held {held:?}"
    );
    eprintln!("TLS stall: handshake abandoned after {held:?}; FCM delivered in {android_took:?}");
    assert!(w.apns.calls().is_empty());
    assert_eq!(w.outcome(&ios).await, ["pending"]);
    assert_eq!(
        w.batches(&ios).await[0].attempts,
        0,
        "a timeout is no answer"
    );

    // The stall ends: the handshake in progress (or the next) completes and the alert goes.
    proxy.set(Fault::Pass).await;
    let ended = Instant::now();
    w.wait_outcome_within(&ios, "sent", RECOVERY).await;
    eprintln!("TLS stall: delivered {:?} after it ended", ended.elapsed());
    assert_eq!(w.apns.calls_for(IOS).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_goaway_mid_stream_is_retried_on_a_new_connection() {
    let w = World::start(Backend::Sqlite, "0").await;
    let ios = w.register_ios("iphone", IOS).await;
    w.apns.goaway_on_next(IOS);
    w.send(&[&ios], alert(1)).await;
    let calls = w.apns.wait_for(IOS, 2, WAIT).await;
    w.wait_outcome(&ios, "sent").await;
    assert_eq!(w.apns.goaways_sent(), 1);
    assert_eq!(
        w.apns.connections(),
        2,
        "the retry went on a new connection"
    );
    // The one repeat the contract allows (a request the provider may have taken), with the same
    // collapse id so the phone shows it once; and nothing more.
    assert_eq!(
        calls[0].headers["apns-collapse-id"],
        calls[1].headers["apns-collapse-id"]
    );
    assert_eq!(calls[0].body, calls[1].body);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(w.apns.calls_for(IOS).len(), 2);
    assert_eq!(w.outcome(&ios).await, ["sent"]);
    assert_eq!(
        w.batches(&ios).await[0].attempts,
        1,
        "the unanswered one is free"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcm_token_endpoint_down_holds_android_work_without_attempts_or_hammering() {
    let w = fast_world().await;
    w.fcm.set_token_endpoint_down(true);
    let mut phones = Vec::new();
    for i in 0..10 {
        let token = format!("fcm-token:APA91bTokenEndpointDown-{i:02}");
        phones.push((
            w.register_android(&format!("pixel-{i}"), &token).await,
            token,
        ));
    }
    let ios = w.register_ios("iphone", IOS).await;
    let ids: Vec<&str> = phones.iter().map(|(id, _)| id.as_str()).collect();
    w.send(&ids, alert(1)).await;
    // APNs does not depend on Google's token endpoint.
    w.send(&[&ios], alert(2)).await;
    w.wait_outcome(&ios, "sent").await;

    tokio::time::sleep(Duration::from_secs(2)).await;
    let early = w.fcm.token_requests();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let late = w.fcm.token_requests();
    eprintln!("token endpoint down: {early} token requests in ~2 s, {late} in ~8 s");
    // Ten batches retried every 25 ms to 1.6 s would ask well over a hundred times in 8 s. The
    // endpoint's breaker opens after 8 failures (each batch has at most one fetch in flight when
    // it does), then lets one probe through per hold (2 s, then 4 s).
    assert!(late <= 8 + 10 + 4, "{late} token requests");
    assert!(
        late - early <= 4,
        "{early} then {late}: more than one probe per hold"
    );
    for (id, token) in &phones {
        assert!(w.fcm.calls_for(token).is_empty());
        assert_eq!(w.outcome(id).await, ["pending"]);
        let batch = w.batches(id).await.remove(0);
        assert_eq!(
            batch.attempts, 0,
            "no provider answer, no attempt: {batch:?}"
        );
    }

    w.fcm.set_token_endpoint_down(false);
    let back = Instant::now();
    for (id, _) in &phones {
        w.wait_outcome_within(id, "sent", RECOVERY).await;
    }
    eprintln!(
        "token endpoint down: all delivered {:?} after it answered again",
        back.elapsed()
    );
    for (_, token) in &phones {
        assert_eq!(w.fcm.calls_for(token).len(), 1);
    }
}
