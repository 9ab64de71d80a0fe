//! `/metrics` after real traffic: every family the gateway promises, with plausible values, and
//! nothing personal in any label; the process and build families in every process role; refusals
//! by the limiter's buckets and failed provider-token fetches counted as they happen.

use std::time::Duration;

use orca_push_host::HostKey;
use orca_push_tests::mock_apns::{Answer, MockApns};
use orca_push_tests::mock_fcm::MockFcm;
use orca_push_tests::{Backend, Gateway, Raw, bearer, scrape_sum};
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
    // This process: CPU, memory, descriptors, threads (metrics-process), and its build.
    for family in [
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_threads",
        "process_start_time_seconds",
    ] {
        at_least(family, &[], 1.0);
    }
    at_least("process_cpu_seconds_total", &[], 0.0);
    assert_eq!(
        sample(
            &text,
            "orca_push_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0),
        "{text}"
    );
    // Every service's pools: SQLite's one writer and four readers each.
    for service in ["auth", "registry", "queue"] {
        for state in ["idle", "in_use"] {
            for pool in ["writer", "readers"] {
                let labels = [
                    ("service", service),
                    ("backend", "sqlite"),
                    ("pool", pool),
                    ("state", state),
                ];
                at_least("orca_push_db_pool_connections", &labels, 0.0);
            }
        }
        let max = |pool| {
            sample(
                &text,
                "orca_push_db_pool_max_connections",
                &[("service", service), ("backend", "sqlite"), ("pool", pool)],
            )
        };
        assert_eq!(max("writer"), Some(1.0), "{service}");
        assert_eq!(max("readers"), Some(4.0), "{service}");
    }
    // The writers have served the traffic above: each has opened its one connection.
    for service in ["auth", "registry", "queue"] {
        let open: f64 = ["idle", "in_use"]
            .iter()
            .filter_map(|state| {
                sample(
                    &text,
                    "orca_push_db_pool_connections",
                    &[("service", service), ("pool", "writer"), ("state", state)],
                )
            })
            .sum();
        assert_eq!(open, 1.0, "{service}'s writer");
    }
    // Counted from zero before anything is refused or fails.
    for bucket in ["unauthenticated", "host", "invalid_bearer"] {
        at_least(
            "orca_push_rate_limit_refusals_total",
            &[("bucket", bucket)],
            0.0,
        );
    }
    for reason in ["lookup_queue_full", "lookup_wait_timeout"] {
        at_least("orca_push_busy_refusals_total", &[("reason", reason)], 0.0);
    }
    for provider in ["apns", "fcm"] {
        at_least(
            "orca_push_provider_token_failures_total",
            &[("provider", provider)],
            0.0,
        );
    }
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

/// `name{labels}` on `metrics_url`, polled until it reaches `min` (within 20 s).
async fn wait_for_metric(metrics_url: &str, name: &str, labels: &[(&str, &str)], min: f64) -> f64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let value = scrape_sum(metrics_url, name, labels).await;
        if value >= min || tokio::time::Instant::now() > deadline {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiter_refusals_are_counted_per_bucket() {
    let mut gateway = Gateway::start(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    let metrics = gateway.process("all").metrics_url();
    let refusals = |bucket: &'static str| {
        let metrics = metrics.clone();
        async move {
            scrape_sum(
                &metrics,
                "orca_push_rate_limit_refusals_total",
                &[("bucket", bucket)],
            )
            .await
        }
    };
    assert_eq!(refusals("unauthenticated").await, 0.0);
    // One client's challenges: 30 a minute, the 31st refused.
    let key = HostKey::generate();
    let from = [("x-forwarded-for", "198.51.100.7")];
    for _ in 0..30 {
        assert_eq!(raw.challenge(&key, &from).await.0.status, 200);
    }
    let (refused, _) = raw.challenge(&key, &from).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refusals("unauthenticated").await, 1.0);
    // Another client's bad bearers: 30 a minute answered 401, then 429.
    let forged = "Bearer AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
    let headers = [
        ("x-forwarded-for", "198.51.100.8"),
        ("authorization", forged),
    ];
    for _ in 0..30 {
        assert_eq!(raw.get("/v1/devices", &headers).await.status, 401);
    }
    assert_eq!(raw.get("/v1/devices", &headers).await.status, 429);
    assert!(refusals("invalid_bearer").await >= 1.0);
    assert_eq!(refusals("unauthenticated").await, 1.0);
    assert_eq!(refusals("host").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fcm_token_fetch_is_counted() {
    let fcm = MockFcm::start().await;
    fcm.set_token_endpoint_down(true);
    let env = fcm.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut gateway = Gateway::start_with(Backend::Sqlite, &env).await;
    let raw = Raw::new(&gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let android = raw
        .register(
            &auth,
            &json!({ "v": 1, "deviceId": "android", "platform": "android", "token": "f".repeat(40) }),
        )
        .await;
    let metrics = gateway.process("all").metrics_url();
    let failures = [("provider", "fcm")];
    assert_eq!(
        scrape_sum(
            &metrics,
            "orca_push_provider_token_failures_total",
            &failures
        )
        .await,
        0.0
    );
    let notification = json!({
        "notificationId": "n-1", "notificationSeq": 1, "notificationEpoch": "e", "source": "plugin",
        "agentState": null, "title": "t", "body": "b",
    });
    let reply = raw
        .post(
            "/v1/send",
            &json!({ "v": 1, "registrationIds": [android], "notification": notification }),
            &[("authorization", &auth)],
        )
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let counted = wait_for_metric(
        &metrics,
        "orca_push_provider_token_failures_total",
        &failures,
        1.0,
    )
    .await;
    assert!(counted >= 1.0, "no FCM token failure counted");
    assert!(fcm.token_requests() >= 1);
    assert!(
        fcm.calls_for(&"f".repeat(40)).is_empty(),
        "sent without a token"
    );
    assert_eq!(
        scrape_sum(
            &metrics,
            "orca_push_provider_token_failures_total",
            &[("provider", "apns")]
        )
        .await,
        0.0
    );
}

/// Split mode: each process reports its own CPU, memory and descriptors and its build; the auth,
/// registry and queue processes each their own service's pools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_process_role_reports_itself() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    for role in ["facade", "auth", "registry", "queue", "sender"] {
        let metrics = gateway.process(role).metrics_url();
        let text = reqwest::get(&metrics).await.unwrap().text().await.unwrap();
        for family in [
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            let value = sample(&text, family, &[]).unwrap_or_else(|| panic!("{role}: no {family}"));
            assert!(value > 0.0, "{role}: {family} = {value}");
        }
        assert!(
            sample(&text, "process_cpu_seconds_total", &[]).is_some(),
            "{role}: no CPU time"
        );
        assert_eq!(
            sample(
                &text,
                "orca_push_build_info",
                &[("version", env!("CARGO_PKG_VERSION"))]
            ),
            Some(1.0),
            "{role}"
        );
        for service in ["auth", "registry", "queue"] {
            let pools = sample(
                &text,
                "orca_push_db_pool_max_connections",
                &[("service", service), ("pool", "writer")],
            );
            if service == role {
                assert_eq!(pools, Some(1.0), "{role} reports its pool");
            } else {
                assert_eq!(pools, None, "{role} reports {service}'s pool");
            }
        }
    }
}
