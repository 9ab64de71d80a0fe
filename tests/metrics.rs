//! `/metrics` after real traffic: every family the gateway promises, with plausible values, and
//! nothing personal in any label.

use std::time::Duration;

use orca_push_host::HostKey;
use orca_push_tests::mock_apns::{Answer, MockApns};
use orca_push_tests::mock_fcm::MockFcm;
use orca_push_tests::{Backend, Gateway, Raw, bearer};
use serde_json::json;

/// The value of the first sample of `name` whose labels include all of `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_every_family_after_traffic() {
    let apns = MockApns::start().await;
    let fcm = MockFcm::start().await;
    let mut env = apns.env();
    env.extend(fcm.env());
    env.push(("ORCA_PUSH_COALESCE_MS".into(), "0".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut gateway = Gateway::start_with(Backend::Sqlite, &env).await;
    let raw = Raw::new(&gateway);
    let key = HostKey::generate();
    let auth = bearer(&raw.login(&key, &[]).await);
    let h = [("authorization", auth.as_str())];
    let register = |device: &'static str, body: serde_json::Value| {
        let raw = raw.clone();
        let auth = auth.clone();
        async move {
            let mut body = body;
            body["v"] = json!(1);
            body["deviceId"] = json!(device);
            raw.post("/v1/devices", &body, &[("authorization", &auth)])
                .await
                .body["registrationId"]
                .as_str()
                .unwrap()
                .to_owned()
        }
    };
    let good = register(
        "good",
        json!({ "platform": "ios", "token": "aa11", "apnsEnvironment": "sandbox" }),
    )
    .await;
    let dead = register(
        "dead",
        json!({ "platform": "ios", "token": "aa22", "apnsEnvironment": "sandbox" }),
    )
    .await;
    let flaky = register(
        "flaky",
        json!({ "platform": "ios", "token": "aa33", "apnsEnvironment": "sandbox" }),
    )
    .await;
    let android = register(
        "android",
        json!({ "platform": "android", "token": "f".repeat(40) }),
    )
    .await;
    apns.script("aa22", vec![Answer::status(410, Some("Unregistered"))]);
    apns.script(
        "aa33",
        vec![Answer::status(503, Some("ServiceUnavailable"))],
    );
    let notification = json!({
        "notificationId": "n-1", "notificationSeq": 1, "notificationEpoch": "e", "source": "plugin",
        "agentState": null, "title": "MARKER-TITLE-7d1f", "body": "MARKER-BODY-2c9a",
    });
    let reply = raw
        .post("/v1/send", &json!({ "v": 1, "registrationIds": [good, dead, flaky, android], "notification": notification }), &h)
        .await;
    assert_eq!(reply.status, 200);
    apns.wait_for("aa33", 2, Duration::from_secs(20)).await;
    fcm.wait_for(&"f".repeat(40), 1, Duration::from_secs(20))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let text = reqwest::get(gateway.process("all").metrics_url())
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let at_least = |name: &str, labels: &[(&str, &str)], min: f64| {
        let value = sample(&text, name, labels)
            .unwrap_or_else(|| panic!("no {name} {labels:?} in:\n{text}"));
        assert!(value >= min, "{name} {labels:?} = {value}");
    };
    at_least(
        "orca_push_http_requests_total",
        &[("route", "/v1/send"), ("status", "200")],
        1.0,
    );
    at_least(
        "orca_push_http_requests_total",
        &[("route", "/v1/host/challenge"), ("status", "200")],
        1.0,
    );
    at_least(
        "orca_push_http_request_duration_seconds_count",
        &[("route", "/v1/send")],
        1.0,
    );
    at_least(
        "orca_push_grpc_server_calls_total",
        &[
            ("service", "orca.push.queue.v1.QueueService"),
            ("method", "Enqueue"),
            ("code", "0"),
        ],
        1.0,
    );
    at_least(
        "orca_push_grpc_server_duration_seconds_count",
        &[("method", "Authenticate")],
        1.0,
    );
    at_least("orca_push_quota_refusals_total", &[("kind", "alert")], 0.0);
    at_least("orca_push_queue_batches", &[("state", "due")], 0.0);
    at_least("orca_push_queue_oldest_due_age_seconds", &[], 0.0);
    at_least("orca_push_lease_expiries_total", &[], 0.0);
    at_least(
        "orca_push_deliveries_total",
        &[("provider", "apns"), ("outcome", "sent")],
        2.0,
    );
    at_least(
        "orca_push_deliveries_total",
        &[("provider", "fcm"), ("outcome", "sent")],
        1.0,
    );
    at_least(
        "orca_push_deliveries_total",
        &[("provider", "apns"), ("outcome", "dead")],
        1.0,
    );
    at_least(
        "orca_push_delivery_retries_total",
        &[("provider", "apns")],
        1.0,
    );
    at_least("orca_push_dead_tokens_total", &[("provider", "apns")], 1.0);
    at_least(
        "orca_push_provider_request_duration_seconds_count",
        &[("provider", "apns")],
        3.0,
    );
    // Aggregate only: no token, text, id or fingerprint reaches a label.
    for secret in [
        "aa11",
        "aa22",
        "MARKER-TITLE",
        "MARKER-BODY",
        &key.fingerprint()[..8],
        "n-1",
    ] {
        assert!(!text.contains(secret), "{secret} in metrics");
    }
    // Nor a log line: tokens, texts, session tokens, more than 4 characters of a fingerprint.
    let logs = gateway.logs();
    let session = auth.trim_start_matches("Bearer ");
    for secret in [
        "aa11",
        "aa22",
        "aa33",
        "MARKER-TITLE",
        "MARKER-BODY",
        session,
        &key.fingerprint()[..5],
    ] {
        assert!(!logs.contains(secret), "{secret} in the logs");
    }
}
