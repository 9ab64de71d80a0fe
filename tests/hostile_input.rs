//! Hostile input over real HTTP: NUL in every string the public API stores or looks up, IPv6
//! clients spread over one /64, and connections that hold the public listener without using it.

use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host::HostKey;
use orca_push_tests::{Answer, Backend, Gateway, Raw, bearer, on_both_backends};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

on_both_backends!(nul_in_any_string_is_invalid_request_on_every_backend);

fn ios(device: &str, token: &str) -> Value {
    json!({ "v": 1, "deviceId": device, "platform": "ios", "token": token, "apnsEnvironment": "sandbox" })
}

fn notification() -> Value {
    json!({
        "notificationId": "task-1", "notificationSeq": 1, "notificationEpoch": "epoch-1",
        "source": "agent-task-complete", "agentState": "finished",
        "title": "Done", "body": "All good", "worktreeId": "wt-1",
    })
}

fn refused(reply: &Answer, what: &str) {
    assert_eq!(
        (reply.status, reply.error()),
        (400, Some("invalid_request")),
        "{what}: {reply:?}"
    );
}

async fn nul_in_any_string_is_invalid_request_on_every_backend(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let h = [("authorization", auth.as_str())];
    let registration = raw.register(&auth, &ios("phone", "a1b2")).await;

    // Registration: deviceId, token (both platforms), filter values.
    refused(
        &raw.post("/v1/devices", &ios("pho\0ne", "a1b2"), &h).await,
        "deviceId",
    );
    refused(
        &raw.post("/v1/devices", &ios("phone-2", "a1b2\0"), &h).await,
        "ios token",
    );
    let android = json!({ "v": 1, "deviceId": "pixel", "platform": "android",
        "token": format!("fcm:{}\0", "x".repeat(40)) });
    refused(
        &raw.post("/v1/devices", &android, &h).await,
        "android token",
    );
    let mut filtered = ios("phone-3", "a1b2");
    filtered["filter"] = json!({ "sources": ["plugin\0"], "agentStates": [] });
    refused(&raw.post("/v1/devices", &filtered, &h).await, "filter");
    // A key with NUL is as unknown as any other, and refused the same way.
    let mut keyed = ios("phone-4", "a1b2");
    keyed["v\0"] = json!(1);
    refused(&raw.post("/v1/devices", &keyed, &h).await, "key");

    // registrationId as a path segment (`%00` decodes to NUL; `%FF` to no UTF-8 at all, which
    // axum refuses in plain text unless the route maps it).
    for path in [
        format!("/v1/devices/{registration}%00"),
        "/v1/devices/%00".to_owned(),
        "/v1/devices/%FF".to_owned(),
    ] {
        refused(&raw.delete(&path, &h).await, &path);
    }

    // Send: every string of the notification, and the ids.
    let send =
        |ids: Vec<String>, n: Value| json!({ "v": 1, "registrationIds": ids, "notification": n });
    refused(
        &raw.post(
            "/v1/send",
            &send(vec![format!("{registration}\0")], notification()),
            &h,
        )
        .await,
        "registrationIds",
    );
    for field in [
        "notificationId",
        "notificationEpoch",
        "title",
        "body",
        "worktreeId",
    ] {
        let mut n = notification();
        n[field] = json!(format!("{}\0x", n[field].as_str().unwrap()));
        refused(
            &raw.post("/v1/send", &send(vec![registration.clone()], n), &h)
                .await,
            field,
        );
    }

    // The handshake: challengeId, and the public key (refused as base64 whatever its content).
    let session =
        json!({ "v": 1, "challengeId": "2c1d6f3e-\0", "proofB64": STANDARD.encode([0u8; 32]) });
    refused(
        &raw.post("/v1/host/session", &session, &[]).await,
        "challengeId",
    );
    let challenge =
        json!({ "v": 1, "hostPublicKeyB64": format!("{}\0", STANDARD.encode([1u8; 32])) });
    refused(
        &raw.post("/v1/host/challenge", &challenge, &[]).await,
        "hostPublicKeyB64",
    );

    // Nothing of the above was stored, and the gateway still serves the same host normally.
    let listed = raw.get("/v1/devices", &h).await;
    assert_eq!(listed.body["devices"].as_array().map(Vec::len), Some(1));
    let sent = raw
        .post("/v1/send", &send(vec![registration], notification()), &h)
        .await;
    assert_eq!(sent.status, 200, "{sent:?}");
    assert_eq!(sent.body["results"][0]["status"], "queued");
}

/// Spends a client's 30 unauthenticated tokens at once with cheap requests (bodies refused after
/// the bucket is charged), so no token refills (one per 2 s) before the test looks.
async fn exhaust(raw: &Raw, forwarded_for: &str) {
    let body = json!({ "v": 1 });
    let h = [("x-forwarded-for", forwarded_for)];
    let calls = (0..30).map(|_| raw.post("/v1/host/session", &body, &h));
    for reply in futures::future::join_all(calls).await {
        assert_eq!(reply.status, 400, "{reply:?}");
    }
}

async fn challenge_from(raw: &Raw, forwarded_for: &str) -> u16 {
    let body =
        json!({ "v": 1, "hostPublicKeyB64": STANDARD.encode(HostKey::generate().public_key()) });
    raw.post(
        "/v1/host/challenge",
        &body,
        &[("x-forwarded-for", forwarded_for)],
    )
    .await
    .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_clients_share_one_bucket_per_64() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    exhaust(&raw, "2001:db8:1:2::1").await;
    // Another address of the same /64 is the same client...
    assert_eq!(
        challenge_from(&raw, "2001:db8:1:2:dead:beef:0:7").await,
        429
    );
    assert_eq!(challenge_from(&raw, "[2001:db8:1:2::99]:443").await, 429);
    // ...the next /64 is someone else.
    assert_eq!(challenge_from(&raw, "2001:db8:1:3::1").await, 200);
    // An IPv4 client written IPv4-mapped is still that IPv4 client.
    exhaust(&raw, "203.0.113.50").await;
    assert_eq!(challenge_from(&raw, "::ffff:203.0.113.50").await, 429);
    assert_eq!(challenge_from(&raw, "203.0.113.51").await, 200);
}

/// A gateway whose public listener has these `ORCA_PUSH_HTTP_*` settings, and its address.
async fn gateway_with_http(header_ms: &str, idle_ms: &str, max: &str) -> (Gateway, String) {
    let gateway = Gateway::start_with(
        Backend::Sqlite,
        &[
            ("ORCA_PUSH_HTTP_HEADER_TIMEOUT_MS", header_ms),
            ("ORCA_PUSH_HTTP_IDLE_TIMEOUT_MS", idle_ms),
            ("ORCA_PUSH_HTTP_MAX_CONNECTIONS", max),
        ],
    )
    .await;
    let addr = gateway.base.trim_start_matches("http://").to_owned();
    (gateway, addr)
}

/// Sends `GET /health` on a kept-alive connection and reads the whole answer.
async fn health_on(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !(got.ends_with(b"}") && String::from_utf8_lossy(&got).contains("\r\n\r\n")) {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// How long until the server closes `stream` (reading and dropping whatever it still sends).
async fn closed_after(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    let until_eof = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, until_eof)
        .await
        .ok()
        .map(|()| started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_half_a_header_is_disconnected_after_the_header_timeout() {
    let (_gateway, addr) = gateway_with_http("500", "60000", "16").await;
    let mut slow = TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: gatew")
        .await
        .unwrap();
    let closed = closed_after(&mut slow, Duration::from_secs(10)).await;
    let closed = closed.expect("a half-sent head must not hold the connection");
    assert!(closed >= Duration::from_millis(400), "{closed:?}");
    assert!(closed < Duration::from_secs(5), "{closed:?}");
    // A whole head on time is served as usual.
    let mut quick = TcpStream::connect(&addr).await.unwrap();
    assert!(health_on(&mut quick).await.starts_with("HTTP/1.1 200"));
}

/// A whole head and then a body that never comes: hyper's header timeout is over and the idle
/// clock stops while a request is in flight, so only the body's own deadline frees the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_is_refused_after_the_header_timeout() {
    let (_gateway, addr) = gateway_with_http("500", "60000", "16").await;
    let mut stalled = TcpStream::connect(&addr).await.unwrap();
    stalled
        .write_all(
            b"POST /v1/host/challenge HTTP/1.1\r\nHost: gateway\r\n\
              Content-Length: 100\r\n\r\n{\"v\":",
        )
        .await
        .unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            match stalled.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    let closed = tokio::time::timeout(Duration::from_secs(10), read).await;
    let answer = String::from_utf8_lossy(&got);
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("invalid_request"),
        "{answer:?} after {:?}",
        started.elapsed()
    );
    assert!(closed.is_ok(), "the connection was kept after the answer");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed_after_the_idle_timeout() {
    let (_gateway, addr) = gateway_with_http("60000", "500", "16").await;
    let mut kept = TcpStream::connect(&addr).await.unwrap();
    // Two requests on the one connection: keep-alive works, and idleness counts from the last.
    assert!(health_on(&mut kept).await.starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(health_on(&mut kept).await.starts_with("HTTP/1.1 200"));
    let closed = closed_after(&mut kept, Duration::from_secs(10)).await;
    let closed = closed.expect("an idle connection must not be held for ever");
    assert!(closed >= Duration::from_millis(400), "{closed:?}");
    assert!(closed < Duration::from_secs(5), "{closed:?}");
    // A connection that never sends a byte is idle too.
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    let closed = closed_after(&mut silent, Duration::from_secs(10)).await;
    assert!(
        closed.is_some_and(|c| c < Duration::from_secs(5)),
        "{closed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let (_gateway, addr) = gateway_with_http("60000", "60000", "2").await;
    let mut first = TcpStream::connect(&addr).await.unwrap();
    let mut second = TcpStream::connect(&addr).await.unwrap();
    assert!(health_on(&mut first).await.starts_with("HTTP/1.1 200"));
    assert!(health_on(&mut second).await.starts_with("HTTP/1.1 200"));
    // The third is not served while both are open...
    let mut third = TcpStream::connect(&addr).await.unwrap();
    let waiting = tokio::spawn(async move {
        let answer = health_on(&mut third).await;
        (answer, Instant::now())
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished(), "served beyond the cap");
    // ...and is, as soon as one of them closes.
    let closed_at = Instant::now();
    drop(first);
    let (answer, served_at) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("served once a slot freed")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(served_at >= closed_at);
    assert!(health_on(&mut second).await.starts_with("HTTP/1.1 200"));
}
