//! Devices API and every request limit of the public facade, over real HTTP.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host::HostKey;
use orca_push_tests::{Backend, Gateway, Raw, bearer, on_both_backends};
use serde_json::{Value, json};

on_both_backends!(
    register_list_and_delete_devices,
    a_host_never_sees_or_deletes_another_hosts_registration,
    the_65th_device_is_refused_until_one_is_deleted,
    registrations_are_validated_strictly,
);

fn ios(device: &str) -> Value {
    json!({ "v": 1, "deviceId": device, "platform": "ios", "token": "a1b2c3d4", "apnsEnvironment": "sandbox" })
}

fn android(device: &str) -> Value {
    json!({ "v": 1, "deviceId": device, "platform": "android", "token": "fcm:APA91b-".to_owned() + &"x".repeat(40) })
}

async fn register_list_and_delete_devices(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let token = raw.login(&HostKey::generate(), &[]).await;
    let auth = bearer(&token);
    let h = [("authorization", auth.as_str())];
    let phone = raw.post("/v1/devices", &ios("phone"), &h).await;
    assert_eq!(phone.status, 200, "{phone:?}");
    let phone_id = phone.body["registrationId"].as_str().unwrap().to_owned();
    assert_eq!(phone.body.as_object().unwrap().len(), 1);
    let mut with_filter = android("pixel");
    with_filter["filter"] = json!({ "sources": ["plugin"], "agentStates": ["needs-input"] });
    let pixel = raw.post("/v1/devices", &with_filter, &h).await;
    assert_eq!(pixel.status, 200, "{pixel:?}");
    let pixel_id = pixel.body["registrationId"].as_str().unwrap().to_owned();
    // Re-registering the same deviceId keeps its registration.
    let mut new_token = ios("phone");
    new_token["token"] = json!("ffee");
    let again = raw.post("/v1/devices", &new_token, &h).await;
    assert_eq!(again.body["registrationId"], phone_id);

    let listed = raw.get("/v1/devices", &h).await;
    assert_eq!(listed.status, 200);
    let devices = listed.body["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let phone_row = devices
        .iter()
        .find(|d| d["registrationId"] == phone_id)
        .unwrap();
    assert_eq!(
        phone_row,
        &json!({ "registrationId": phone_id, "deviceId": "phone", "platform": "ios", "dead": false })
    );
    let pixel_row = devices
        .iter()
        .find(|d| d["registrationId"] == pixel_id)
        .unwrap();
    assert_eq!(
        pixel_row["filter"],
        json!({ "sources": ["plugin"], "agentStates": ["needs-input"] })
    );
    // Tokens never come back.
    assert!(!listed.body.to_string().contains("a1b2c3d4"));

    let deleted = raw.delete(&format!("/v1/devices/{phone_id}"), &h).await;
    assert_eq!((deleted.status, &deleted.body), (204, &Value::Null));
    let twice = raw.delete(&format!("/v1/devices/{phone_id}"), &h).await;
    assert_eq!((twice.status, twice.error()), (404, Some("not_found")));
    assert_eq!(
        raw.get("/v1/devices", &h).await.body["devices"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

async fn a_host_never_sees_or_deletes_another_hosts_registration(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let owner = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let other = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let id = raw
        .post("/v1/devices", &ios("phone"), &[("authorization", &owner)])
        .await
        .body["registrationId"]
        .as_str()
        .unwrap()
        .to_owned();
    let theirs = raw
        .delete(&format!("/v1/devices/{id}"), &[("authorization", &other)])
        .await;
    let unknown = raw
        .delete(
            "/v1/devices/no-such-registration",
            &[("authorization", &other)],
        )
        .await;
    assert_eq!(
        (theirs.status, &theirs.body),
        (unknown.status, &unknown.body)
    );
    assert_eq!(theirs.error(), Some("not_found"));
    let listed = raw.get("/v1/devices", &[("authorization", &other)]).await;
    assert_eq!(listed.body, json!({ "devices": [] }));
    // Still there for its owner.
    let listed = raw.get("/v1/devices", &[("authorization", &owner)]).await;
    assert_eq!(listed.body["devices"].as_array().unwrap().len(), 1);
}

async fn the_65th_device_is_refused_until_one_is_deleted(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let h = [("authorization", auth.as_str())];
    let mut first = String::new();
    for i in 0..64 {
        let reply = raw
            .post("/v1/devices", &ios(&format!("device-{i}")), &h)
            .await;
        assert_eq!(reply.status, 200, "{i}: {reply:?}");
        if i == 0 {
            first = reply.body["registrationId"].as_str().unwrap().to_owned();
        }
    }
    let over = raw.post("/v1/devices", &ios("device-64"), &h).await;
    assert_eq!((over.status, over.error()), (409, Some("too_many_devices")));
    assert_eq!(
        raw.post("/v1/devices", &ios("device-7"), &h).await.status,
        200
    );
    assert_eq!(
        raw.delete(&format!("/v1/devices/{first}"), &h).await.status,
        204
    );
    assert_eq!(
        raw.post("/v1/devices", &ios("device-64"), &h).await.status,
        200
    );
}

async fn registrations_are_validated_strictly(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let h = [("authorization", auth.as_str())];
    let mut cases = Vec::new();
    let mut c = ios("phone");
    c["apnsEnvironment"] = Value::Null;
    cases.push(c);
    let mut c = ios("phone");
    c.as_object_mut().unwrap().remove("apnsEnvironment");
    cases.push(c);
    let mut c = ios("phone");
    c["token"] = json!("abc");
    cases.push(c);
    let mut c = ios("phone");
    c["token"] = json!("zz");
    cases.push(c);
    let mut c = android("pixel");
    c["apnsEnvironment"] = json!("production");
    cases.push(c);
    let mut c = android("pixel");
    c["token"] = json!("short");
    cases.push(c);
    let mut c = ios("phone");
    c["deviceId"] = json!("");
    cases.push(c);
    let mut c = ios("phone");
    c["deviceId"] = json!("d".repeat(129));
    cases.push(c);
    let mut c = ios("phone");
    c["platform"] = json!("windows");
    cases.push(c);
    let mut c = ios("phone");
    c["extra"] = json!(1);
    cases.push(c);
    let mut c = ios("phone");
    c["filter"] = json!({ "sources": ["email"], "agentStates": [] });
    cases.push(c);
    let mut c = ios("phone");
    c["filter"] = json!({ "sources": [], "agentStates": [], "followDesktop": true });
    cases.push(c);
    for body in cases {
        let reply = raw.post("/v1/devices", &body, &h).await;
        assert_eq!(
            (reply.status, reply.error()),
            (400, Some("invalid_request")),
            "{body}"
        );
    }
    assert_eq!(
        raw.get("/v1/devices", &h).await.body,
        json!({ "devices": [] })
    );
}

/// Spends a client's 30 unauthenticated tokens at once with cheap requests (bodies refused after
/// the bucket is charged), so no token refills (one per 2 s) before the test looks.
async fn exhaust(raw: &Raw, headers: &[(&str, &str)]) {
    let body = json!({ "v": 1 });
    let calls = (0..30).map(|_| raw.post("/v1/host/session", &body, headers));
    for reply in futures::future::join_all(calls).await {
        assert_eq!(reply.status, 400, "{reply:?}");
    }
}

fn challenge_body() -> Value {
    json!({ "v": 1, "hostPublicKeyB64": STANDARD.encode(HostKey::generate().public_key()) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_16_kib_are_refused_even_when_chunked() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    // Up to 1 MiB, chunked, with no Content-Length, written slowly on a raw connection: the gateway
    // must answer 413 once the cap is passed, long before the body ends (a limit that buffered the
    // whole body would wait for the end). Writing stops as soon as the answer is in.
    let addr = gateway.base.trim_start_matches("http://").to_owned();
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let answer = tokio::spawn(async move {
        use tokio::io::AsyncReadExt as _;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("request_too_large") {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    });
    let head = format!(
        "POST /v1/host/challenge HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    let mut sent = 0usize;
    {
        use tokio::io::AsyncWriteExt as _;
        writer.write_all(head.as_bytes()).await.unwrap();
        let chunk = format!("1000\r\n{}\r\n", " ".repeat(4096));
        while sent < 1024 * 1024 && !answer.is_finished() {
            if writer.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
            sent += 4096;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let response = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .unwrap()
        .unwrap();
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert!(
        response.contains(r#"{"error":"request_too_large"}"#),
        "{response}"
    );
    assert!(
        sent < 64 * 1024,
        "answered after {sent} bytes, not at the end of the body"
    );
    // A declared length over the cap, authenticated route too. A fresh client after each refused
    // body: the server closes a connection whose body it would not read, and a pooled client may
    // race that close.
    let auth = bearer(
        &Raw::new(&gateway)
            .login(&HostKey::generate(), &[("x-forwarded-for", "9.9.9.9")])
            .await,
    );
    let big = json!({ "v": 1, "deviceId": "x".repeat(17 * 1024) });
    let reply = Raw::new(&gateway)
        .post("/v1/devices", &big, &[("authorization", &auth)])
        .await;
    assert_eq!(
        (reply.status, reply.error()),
        (413, Some("request_too_large"))
    );
    // Just under the cap is parsed (and refused for what it says, not for its size).
    let raw = Raw::new(&gateway);
    let mut padded = challenge_body();
    padded["pad"] = json!(" ".repeat(16 * 1024 - 120));
    let reply = raw
        .post(
            "/v1/host/challenge",
            &padded,
            &[("x-forwarded-for", "9.9.9.8")],
        )
        .await;
    assert_eq!(
        (reply.status, reply.error()),
        (400, Some("invalid_request"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_31st_unauthenticated_request_in_a_minute_is_rate_limited() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    let ip = [("x-forwarded-for", "203.0.113.7")];
    // Challenge and session share the bucket: spend it on sessions, then ask for a challenge.
    exhaust(&raw, &ip).await;
    let reply = raw.post("/v1/host/challenge", &challenge_body(), &ip).await;
    assert_eq!((reply.status, reply.error()), (429, Some("rate_limited")));
    // Forged left-hand hops do not buy a new bucket.
    let forged = [("x-forwarded-for", "198.51.100.1, 203.0.113.7")];
    let reply = raw
        .post("/v1/host/challenge", &challenge_body(), &forged)
        .await;
    assert_eq!(reply.status, 429);
    // Another client has its own.
    let other = [("x-forwarded-for", "203.0.113.8")];
    assert_eq!(
        raw.post("/v1/host/challenge", &challenge_body(), &other)
            .await
            .status,
        200
    );
    // x-real-ip is the fallback when there is no x-forwarded-for.
    let real = [("x-real-ip", "203.0.113.9")];
    assert_eq!(
        raw.post("/v1/host/challenge", &challenge_body(), &real)
            .await
            .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trusted_hop_skips_the_proxy_and_distrusts_short_headers() {
    let gateway =
        Gateway::start_with(Backend::Sqlite, &[("ORCA_PUSH_TRUSTED_PROXY_HOPS", "1")]).await;
    let raw = Raw::new(&gateway);
    // The client is the hop before the load balancer's, whatever the proxy's own address.
    exhaust(&raw, &[("x-forwarded-for", "203.0.113.7, 10.0.0.1")]).await;
    let reply = raw
        .post(
            "/v1/host/challenge",
            &challenge_body(),
            &[("x-forwarded-for", "203.0.113.7, 10.0.0.2")],
        )
        .await;
    assert_eq!(reply.status, 429, "the proxy hop is skipped");
    let reply = raw
        .post(
            "/v1/host/challenge",
            &challenge_body(),
            &[("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.9")],
        )
        .await;
    assert_eq!(
        reply.status, 429,
        "forged hops left of the client change nothing"
    );
    // A header with fewer hops than the trusted depth is not trusted: it lands in the shared
    // bucket, whatever address it names (and x-real-ip does not rescue it).
    let calls = (0..30).map(|i| {
        let raw = raw.clone();
        async move {
            let alone = format!("198.51.100.{i}");
            raw.post(
                "/v1/host/session",
                &json!({ "v": 1 }),
                &[("x-forwarded-for", &alone), ("x-real-ip", &alone)],
            )
            .await
            .status
        }
    });
    assert!(
        futures::future::join_all(calls)
            .await
            .iter()
            .all(|s| *s == 400)
    );
    let reply = raw
        .post(
            "/v1/host/challenge",
            &challenge_body(),
            &[("x-forwarded-for", "198.51.100.200")],
        )
        .await;
    assert_eq!((reply.status, reply.error()), (429, Some("rate_limited")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_bearer_flood_does_not_starve_a_real_host_elsewhere() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    let real = bearer(
        &raw.login(&HostKey::generate(), &[("x-forwarded-for", "192.0.2.10")])
            .await,
    );
    let neighbour = bearer(
        &raw.login(&HostKey::generate(), &[("x-forwarded-for", "192.0.2.66")])
            .await,
    );
    let flood = {
        let raw = raw.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for round in 0..10 {
                let calls = (0..40).map(|i| {
                    let raw = raw.clone();
                    let forged = bearer(&format!("{:0>43}", round * 100 + i));
                    async move {
                        raw.get(
                            "/v1/devices",
                            &[
                                ("authorization", &forged),
                                ("x-forwarded-for", "192.0.2.66"),
                            ],
                        )
                        .await
                        .status
                    }
                });
                statuses.extend(futures::future::join_all(calls).await);
            }
            statuses
        })
    };
    let mut real_statuses = Vec::new();
    for _ in 0..60 {
        let reply = raw
            .get(
                "/v1/devices",
                &[("authorization", &real), ("x-forwarded-for", "192.0.2.10")],
            )
            .await;
        real_statuses.push(reply.status);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let flood_statuses = flood.await.unwrap();
    assert!(real_statuses.iter().all(|s| *s == 200), "{real_statuses:?}");
    assert!(
        flood_statuses.iter().all(|s| *s == 401 || *s == 429),
        "no 5xx: {flood_statuses:?}"
    );
    assert!(
        flood_statuses.iter().filter(|s| **s == 401).count() <= 30,
        "only 30 look-ups a minute"
    );
    assert!(flood_statuses.contains(&429));
    // A real host behind the flooding address is not refused for its neighbours' forgeries: its
    // bearer carries a valid tag, so it is checked even once the IP's budget is spent.
    let behind = raw
        .get(
            "/v1/devices",
            &[
                ("authorization", &neighbour),
                ("x-forwarded-for", "192.0.2.66"),
            ],
        )
        .await;
    assert_eq!(behind.status, 200, "{behind:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_host_has_600_requests_a_minute() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let other = bearer(
        &raw.login(&HostKey::generate(), &[("x-real-ip", "192.0.2.1")])
            .await,
    );
    let mut limited = 0;
    let started = std::time::Instant::now();
    for chunk in 0..13 {
        let calls = (0..50).map(|_| {
            let raw = raw.clone();
            let auth = auth.clone();
            async move {
                raw.get("/v1/devices", &[("authorization", &auth)])
                    .await
                    .status
            }
        });
        for status in futures::future::join_all(calls).await {
            match status {
                200 => {}
                429 => limited += 1,
                s => panic!("chunk {chunk}: {s}"),
            }
        }
    }
    // The bucket holds 600 and refills 10 a second: of 650 requests, at most 600 plus what refilled
    // while they ran get through.
    let refilled = (started.elapsed().as_secs_f64() * 10.0).ceil() as usize + 1;
    assert!(limited > 0, "the bucket never ran dry");
    assert!(
        650 - limited <= 600 + refilled,
        "{limited} limited, {refilled} refilled"
    );
    // Another host behind the same address is unaffected.
    assert_eq!(
        raw.get("/v1/devices", &[("authorization", &other)])
            .await
            .status,
        200
    );
}
