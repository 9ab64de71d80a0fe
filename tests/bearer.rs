//! Bearer checks end to end, on a real `orca-push` process: forged bearers never reach auth, a
//! valid host keeps working behind an IP that spent its forged-bearer budget, a replaced session
//! stops working within a second, a watched one is not looked up each second, auth refuses an
//! expired one, and sessions survive a restart.

use std::time::{Duration, Instant};

use orca_push_host::HostKey;
use orca_push_tests::{Backend, Gateway, Raw, bearer, on_both_backends, scrape_sum};

on_both_backends!(
    forged_bearers_are_refused_without_reaching_auth,
    a_replaced_session_stops_working_within_a_second,
    sessions_survive_a_restart_of_an_all_in_one_gateway,
    a_watched_session_is_not_looked_up_again_each_second,
    auth_refuses_an_expired_session_as_session_expired,
);

/// How many Authenticate calls the auth service has served.
async fn auth_look_ups(gateway: &mut Gateway) -> f64 {
    scrape_sum(
        &gateway.process("all").metrics_url(),
        "orca_push_grpc_server_calls_total",
        &[
            ("service", "orca.push.auth.v1.AuthService"),
            ("method", "Authenticate"),
        ],
    )
    .await
}

fn base64url(token: &str) -> bool {
    token.len() == 43
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

async fn forged_bearers_are_refused_without_reaching_auth(backend: Backend) {
    let mut gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let real = raw.login(&HostKey::generate(), &[]).await;
    assert!(base64url(&real), "{real}");
    let reply = raw
        .get("/v1/devices", &[("authorization", &bearer(&real))])
        .await;
    assert_eq!(reply.status, 200);
    let before = auth_look_ups(&mut gateway).await;
    assert!(before >= 1.0, "the real bearer was looked up");
    // Well-formed 43-character bearers, one differing from the real token in its last characters:
    // none carries a valid tag.
    let mut near_miss = real[..40].to_owned();
    near_miss.push_str(if real.ends_with("AAA") { "BBB" } else { "AAA" });
    let forged: Vec<String> = (0..20)
        .map(|i| format!("{i:A>43}"))
        .chain([near_miss])
        .collect();
    for token in &forged {
        let reply = raw
            .get(
                "/v1/devices",
                &[
                    ("authorization", &bearer(token)),
                    ("x-forwarded-for", "198.51.100.9"),
                ],
            )
            .await;
        assert_eq!((reply.status, reply.error()), (401, Some("invalid_token")));
    }
    assert_eq!(
        auth_look_ups(&mut gateway).await,
        before,
        "a forged bearer reached auth"
    );
}

async fn a_replaced_session_stops_working_within_a_second(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let key = HostKey::generate();
    let old = bearer(&raw.login(&key, &[]).await);
    // Verified, so the facade now holds it.
    assert_eq!(
        raw.get("/v1/devices", &[("authorization", &old)])
            .await
            .status,
        200
    );
    let new = bearer(&raw.login(&key, &[]).await);
    let replaced_at = Instant::now();
    assert_eq!(
        raw.get("/v1/devices", &[("authorization", &new)])
            .await
            .status,
        200
    );
    loop {
        let reply = raw.get("/v1/devices", &[("authorization", &old)]).await;
        if reply.status == 401 {
            assert_eq!(reply.error(), Some("invalid_token"));
            break;
        }
        assert_eq!(reply.status, 200, "{reply:?}");
        assert!(
            replaced_at.elapsed() < Duration::from_millis(1_100),
            "the replaced session still worked after {:?}",
            replaced_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(replaced_at.elapsed() < Duration::from_millis(1_100));
    // And it stays refused, while the new one works.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let reply = raw.get("/v1/devices", &[("authorization", &old)]).await;
    assert_eq!((reply.status, reply.error()), (401, Some("invalid_token")));
    assert_eq!(
        raw.get("/v1/devices", &[("authorization", &new)])
            .await
            .status,
        200
    );
}

/// Auth's session watch (SQLite: this process; PostgreSQL: every replica, through the database)
/// lets the facade trust a verified session past the one-second rule.
async fn a_watched_session_is_not_looked_up_again_each_second(backend: Backend) {
    let mut gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let token = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let headers = [("authorization", token.as_str())];
    let devices = || raw.get("/v1/devices", &headers);
    // The first check may precede the watch (it opens as the gateway starts): measure after it.
    assert_eq!(devices().await.status, 200);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(devices().await.status, 200);
    let before = auth_look_ups(&mut gateway).await;
    // The counter is the right one: the first check did look the session up.
    assert!(before >= 1.0, "no look-up counted at all: {before}");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(devices().await.status, 200);
    let again = auth_look_ups(&mut gateway).await - before;
    assert_eq!(again, 0.0, "the watched session was looked up again");
}

/// Expiry never moves: the facade refuses a cached session at the expiry it looked up, without
/// asking (the unit test `a_cached_session_past_its_expiry_is_expired_without_a_look_up`). What is
/// left to show end to end is that auth refuses it too: the test moves the expiry into the past in
/// the database, behind auth, and restarts the gateway so nothing it cached answers.
async fn auth_refuses_an_expired_session_as_session_expired(backend: Backend) {
    let mut gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let token = bearer(&raw.login(&HostKey::generate(), &[]).await);
    assert_eq!(
        raw.get("/v1/devices", &[("authorization", &token)])
            .await
            .status,
        200
    );
    gateway.process("all").kill().await;
    let expire = "UPDATE push_sessions SET expires_at = 1";
    match gateway.auth_pool().await {
        orca_push_storage::Pool::Sqlite(pool) => {
            sqlx::query(expire).execute(&pool).await.unwrap();
        }
        orca_push_storage::Pool::Postgres(pool) => {
            sqlx::query(expire).execute(&pool).await.unwrap();
        }
    }
    gateway.process("all").respawn().await;
    let mut reply = raw.get("/v1/devices", &[("authorization", &token)]).await;
    for _ in 0..100 {
        if reply.status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        reply = raw.get("/v1/devices", &[("authorization", &token)]).await;
    }
    assert_eq!(
        (reply.status, reply.error()),
        (401, Some("session_expired")),
        "{reply:?}"
    );
}

async fn sessions_survive_a_restart_of_an_all_in_one_gateway(backend: Backend) {
    let mut gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let session = raw.login(&HostKey::generate(), &[]).await;
    assert!(base64url(&session), "{session}");
    let auth = bearer(&session);
    assert_eq!(
        raw.get("/v1/devices", &[("authorization", &auth)])
            .await
            .status,
        200
    );
    gateway.process("all").kill().await;
    gateway.process("all").respawn().await;
    let mut status = 0;
    for _ in 0..100 {
        status = raw
            .get("/v1/devices", &[("authorization", &auth)])
            .await
            .status;
        if status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, 200, "the session did not survive the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_host_keeps_working_behind_an_ip_that_spent_its_forged_bearer_budget() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    let ip = [("x-forwarded-for", "192.0.2.77")];
    let key = HostKey::generate();
    let replaced = bearer(&raw.login(&key, &ip).await);
    let real = bearer(&raw.login(&key, &ip).await);
    let forged = |i: usize| bearer(&format!("{i:B>43}"));
    let mut statuses = Vec::new();
    for i in 0..40 {
        let reply = raw
            .get("/v1/devices", &[("authorization", &forged(i)), ip[0]])
            .await;
        statuses.push(reply.status);
    }
    assert!(statuses[..30].iter().all(|s| *s == 401), "{statuses:?}");
    assert!(statuses[32..].iter().all(|s| *s == 429), "{statuses:?}");
    // The budget is spent, yet the valid host on that IP is served, time after time.
    for _ in 0..20 {
        let reply = raw
            .get("/v1/devices", &[("authorization", &real), ip[0]])
            .await;
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    // Forgeries from that IP still get 429, and so does its replaced session: it spends the
    // budget like a forgery.
    let reply = raw
        .get("/v1/devices", &[("authorization", &forged(99)), ip[0]])
        .await;
    assert_eq!((reply.status, reply.error()), (429, Some("rate_limited")));
    let reply = raw
        .get("/v1/devices", &[("authorization", &replaced), ip[0]])
        .await;
    assert_eq!((reply.status, reply.error()), (429, Some("rate_limited")));
}

/// In split mode the facade holds the key auth gave it: with auth gone, a forged bearer is still
/// refused as `invalid_token` rather than failing on the missing look-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_bearers_are_refused_even_while_auth_is_down() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    let real = bearer(&raw.login(&HostKey::generate(), &[]).await);
    assert_eq!(
        raw.get("/v1/devices", &[("authorization", &real)])
            .await
            .status,
        200
    );
    gateway.process("auth").kill().await;
    let reply = raw
        .get(
            "/v1/devices",
            &[("authorization", &bearer(&"Z".repeat(43)))],
        )
        .await;
    assert_eq!((reply.status, reply.error()), (401, Some("invalid_token")));
}
