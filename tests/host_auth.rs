//! Host authentication end to end: a real `orca-push serve` process, on SQLite and on PostgreSQL.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host::{GatewayClient, HostKey, answer_challenge};
use orca_push_tests::{Backend, Gateway, Raw, bearer, now_ms, on_both_backends, origin};
use serde_json::json;

on_both_backends!(
    sdk_handshake_then_an_authenticated_call,
    wrong_proof_is_refused_and_leaves_the_challenge_usable,
    replayed_proof_is_refused,
    proof_after_ten_seconds_is_refused,
    unknown_challenge_is_invalid_challenge,
    forged_and_malformed_bearers_are_invalid_token,
    expired_session_is_session_expired_and_the_sdk_re_proves,
    malformed_bodies_are_invalid_request,
    cli_keygen_and_login,
);

async fn sdk_handshake_then_an_authenticated_call(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let key = HostKey::generate();
    let client = GatewayClient::new(&gateway.base, key.clone()).unwrap();
    let session = client.login().await.expect("login");
    assert_eq!(session.host_fingerprint, key.fingerprint());
    assert_eq!(session.session_token.len(), 43);
    let expires_in = session.expires_at as i64 - now_ms() as i64;
    assert!(
        (24 * 3600 * 1000 - 60_000..=24 * 3600 * 1000).contains(&expires_in),
        "{expires_in}"
    );
    let devices = client
        .call(reqwest::Method::GET, "/v1/devices", None)
        .await
        .unwrap();
    assert_eq!(devices, json!({ "devices": [] }));
    // The response shapes are the contract's, field for field.
    let raw = Raw::new(&gateway);
    let (challenge, _) = raw.challenge(&key, &[]).await;
    let mut fields: Vec<_> = challenge
        .body
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        [
            "challengeId",
            "ciphertextB64",
            "expiresAt",
            "gatewayEphemeralPublicKeyB64",
            "nonceB64"
        ]
    );
    assert_eq!(challenge.body["nonceB64"].as_str().unwrap().len(), 32);
}

async fn wrong_proof_is_refused_and_leaves_the_challenge_usable(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let key = HostKey::generate();
    let (_, envelope) = raw.challenge(&key, &[]).await;
    let envelope = envelope.unwrap();
    let proof = answer_challenge(&key, &origin(&gateway.base), &envelope, now_ms()).unwrap();
    let mut wrong = proof;
    wrong[31] ^= 0x80;
    let reply = raw
        .post(
            "/v1/host/session",
            &json!({ "v": 1, "challengeId": envelope.challenge_id, "proofB64": STANDARD.encode(wrong) }),
            &[],
        )
        .await;
    assert_eq!((reply.status, reply.error()), (401, Some("invalid_proof")));
    let reply = raw
        .post(
            "/v1/host/session",
            &json!({ "v": 1, "challengeId": envelope.challenge_id, "proofB64": STANDARD.encode(proof) }),
            &[],
        )
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.body["hostFingerprint"], key.fingerprint());
}

async fn replayed_proof_is_refused(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let key = HostKey::generate();
    let (_, envelope) = raw.challenge(&key, &[]).await;
    let envelope = envelope.unwrap();
    let proof = answer_challenge(&key, &origin(&gateway.base), &envelope, now_ms()).unwrap();
    let body =
        json!({ "v": 1, "challengeId": envelope.challenge_id, "proofB64": STANDARD.encode(proof) });
    assert_eq!(raw.post("/v1/host/session", &body, &[]).await.status, 200);
    let replay = raw.post("/v1/host/session", &body, &[]).await;
    assert_eq!(
        (replay.status, replay.error()),
        (401, Some("invalid_proof"))
    );
}

async fn proof_after_ten_seconds_is_refused(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let key = HostKey::generate();
    let (reply, envelope) = raw.challenge(&key, &[]).await;
    let envelope = envelope.unwrap();
    assert!(reply.body["expiresAt"].as_u64().unwrap() <= now_ms() + 10_000);
    let proof = answer_challenge(&key, &origin(&gateway.base), &envelope, now_ms()).unwrap();
    let wait = envelope.expires_at_ms.saturating_sub(now_ms()) + 50;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let late = raw
        .post(
            "/v1/host/session",
            &json!({ "v": 1, "challengeId": envelope.challenge_id, "proofB64": STANDARD.encode(proof) }),
            &[],
        )
        .await;
    assert_eq!((late.status, late.error()), (401, Some("invalid_proof")));
}

async fn unknown_challenge_is_invalid_challenge(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let reply = raw
        .post(
            "/v1/host/session",
            &json!({ "v": 1, "challengeId": "no-such-challenge", "proofB64": STANDARD.encode([0u8; 32]) }),
            &[],
        )
        .await;
    assert_eq!(
        (reply.status, reply.error()),
        (401, Some("invalid_challenge"))
    );
}

async fn forged_and_malformed_bearers_are_invalid_token(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let forged = bearer(&"A".repeat(43));
    for headers in [
        vec![],
        vec![("authorization", forged.as_str())],
        vec![("authorization", "Bearer short")],
        vec![("authorization", "Basic dXNlcjpwYXNz")],
    ] {
        let reply = raw.get("/v1/devices", &headers).await;
        assert_eq!(
            (reply.status, reply.error()),
            (401, Some("invalid_token")),
            "{headers:?}"
        );
    }
}

async fn expired_session_is_session_expired_and_the_sdk_re_proves(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let key = HostKey::generate();
    let client = GatewayClient::new(&gateway.base, key.clone()).unwrap();
    let session = client.login().await.unwrap();
    // Move this session's expiry into the past, as 24 hours would.
    match gateway.auth_pool().await {
        orca_push_storage::Pool::Sqlite(pool) => {
            sqlx::query("UPDATE push_sessions SET expires_at = 1")
                .execute(&pool)
                .await
                .unwrap();
        }
        orca_push_storage::Pool::Postgres(pool) => {
            sqlx::query("UPDATE push_sessions SET expires_at = 1")
                .execute(&pool)
                .await
                .unwrap();
        }
    }
    let raw = Raw::new(&gateway);
    let reply = raw
        .get(
            "/v1/devices",
            &[("authorization", &bearer(&session.session_token))],
        )
        .await;
    assert_eq!(
        (reply.status, reply.error()),
        (401, Some("session_expired"))
    );
    // The SDK redoes the handshake on 401 and the call goes through.
    let devices = client
        .call(reqwest::Method::GET, "/v1/devices", None)
        .await
        .unwrap();
    assert_eq!(devices, json!({ "devices": [] }));
}

async fn malformed_bodies_are_invalid_request(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let raw = Raw::new(&gateway);
    let key = STANDARD.encode([7u8; 32]);
    let truncated = &key[..key.len() - 4];
    let non_canonical = format!("{}F=", &key[..key.len() - 2]);
    let cases = [
        json!({ "v": 1, "hostPublicKeyB64": key, "extra": true }),
        json!({ "v": 2, "hostPublicKeyB64": key }),
        json!({ "hostPublicKeyB64": key }),
        json!({ "v": 1, "hostPublicKeyB64": truncated }),
        json!({ "v": 1, "hostPublicKeyB64": non_canonical }),
        json!({ "v": 1, "hostPublicKeyB64": STANDARD.encode([7u8; 31]) }),
        json!({ "v": 1, "hostPublicKeyB64": 7 }),
        json!([1, 2]),
    ];
    for body in cases {
        let reply = raw.post("/v1/host/challenge", &body, &[]).await;
        assert_eq!(
            (reply.status, reply.error()),
            (400, Some("invalid_request")),
            "{body}"
        );
    }
    let reply = raw.post_raw("/v1/host/challenge", "{not json").await;
    assert_eq!(
        (reply.status, reply.error()),
        (400, Some("invalid_request"))
    );
    for body in [
        json!({ "v": 1, "challengeId": "", "proofB64": STANDARD.encode([0u8; 32]) }),
        json!({ "v": 1, "challengeId": "x".repeat(129), "proofB64": STANDARD.encode([0u8; 32]) }),
        json!({ "v": 1, "challengeId": "c", "proofB64": STANDARD.encode([0u8; 31]) }),
        json!({ "v": 1, "challengeId": "c", "proofB64": STANDARD.encode([0u8; 32]), "x": 1 }),
    ] {
        let reply = raw.post("/v1/host/session", &body, &[]).await;
        assert_eq!(
            (reply.status, reply.error()),
            (400, Some("invalid_request")),
            "{body}"
        );
    }
    let reply = raw.get("/v1/nothing-here", &[]).await;
    assert_eq!((reply.status, reply.error()), (404, Some("not_found")));
    let health = raw.get("/health", &[]).await;
    assert_eq!(
        health.body,
        json!({ "ok": true, "pushProtocol": 1, "deliveryProtocol": 2, "mode": "serve" })
    );
    assert_eq!(raw.get("/healthz", &[]).await.body, health.body);
    assert_eq!(raw.get("/ready", &[]).await.body, json!({ "ok": true }));
}

async fn cli_keygen_and_login(backend: Backend) {
    let gateway = Gateway::start(backend).await;
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("host.key");
    let run = |args: &[&str]| {
        std::process::Command::new(orca_push_tests::binary())
            .args(args)
            .env_remove("ORCA_PUSH_HOST_KEY")
            .env_remove("ORCA_PUSH_GATEWAY_URL")
            .output()
            .expect("run orca-push")
    };
    let key_arg = key_path.to_str().unwrap();
    let keygen = run(&["host", "keygen", "--key", key_arg]);
    assert!(keygen.status.success(), "{keygen:?}");
    let fingerprint = HostKey::load(&key_path).unwrap().fingerprint();
    assert!(String::from_utf8_lossy(&keygen.stdout).contains(&fingerprint));
    // A second keygen never overwrites the key.
    let again = run(&["host", "keygen", "--key", key_arg]);
    assert!(!again.status.success());
    assert_eq!(HostKey::load(&key_path).unwrap().fingerprint(), fingerprint);
    // For scripts: one JSON object naming the new key's fingerprint and file.
    let other_path = dir.path().join("other.key");
    let other = run(&[
        "host",
        "keygen",
        "--json",
        "--key",
        other_path.to_str().unwrap(),
    ]);
    assert!(other.status.success(), "{other:?}");
    let printed: serde_json::Value = serde_json::from_slice(&other.stdout).unwrap();
    assert_eq!(
        printed["hostFingerprint"],
        HostKey::load(&other_path).unwrap().fingerprint()
    );
    assert_eq!(printed["keyFile"], other_path.to_str().unwrap());
    let login = run(&[
        "host",
        "login",
        "--gateway",
        &gateway.base,
        "--key",
        key_arg,
    ]);
    assert!(login.status.success(), "{login:?}");
    let stdout = String::from_utf8_lossy(&login.stdout);
    assert!(stdout.contains(&fingerprint), "{stdout}");
    // The token goes to the owner-only cache, never to the terminal.
    let cache = std::fs::read_to_string(key_path.with_extension("session")).unwrap();
    let cache: serde_json::Value = serde_json::from_str(&cache).unwrap();
    let token = &cache["sessions"][origin(&gateway.base)]["sessionToken"];
    assert!(!stdout.contains(token.as_str().unwrap()));
    // A dismissal goes while the agent works again; an alert does not. (No phone of this host
    // has that id: the gateway answers `error` for it, and the command has sent.)
    let send = |extra: &[&str]| {
        let mut args = vec!["host", "send", "--gateway", &gateway.base, "--key", key_arg];
        args.extend_from_slice(&[
            "--title",
            "Done",
            "--notification-id",
            "n-1",
            "--agent-state",
            "working",
            "--registration-id",
            "not-a-phone-of-this-host",
        ]);
        args.extend_from_slice(extra);
        run(&args)
    };
    let dismissal = send(&["--dismiss"]);
    assert!(dismissal.status.success(), "{dismissal:?}");
    assert!(
        String::from_utf8_lossy(&dismissal.stdout).contains("not-a-phone-of-this-host  error"),
        "{dismissal:?}"
    );
    let alert = send(&[]);
    assert!(!alert.status.success());
    assert!(String::from_utf8_lossy(&alert.stderr).contains("still working"));
}

on_both_backends!(split_topology_serves_the_same_api);

async fn split_topology_serves_the_same_api(backend: Backend) {
    let gateway = Gateway::start_split(backend).await;
    let client = GatewayClient::new(&gateway.base, HostKey::generate()).unwrap();
    client
        .login()
        .await
        .expect("login through the split services");
    let registered = client
        .call(
            reqwest::Method::POST,
            "/v1/devices",
            Some(&json!({ "v": 1, "deviceId": "phone", "platform": "ios", "token": "abcd", "apnsEnvironment": "sandbox" })),
        )
        .await
        .unwrap();
    assert!(registered["registrationId"].is_string());
    let devices = client
        .call(reqwest::Method::GET, "/v1/devices", None)
        .await
        .unwrap();
    assert_eq!(devices["devices"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_bad_setting_stops_start_up_with_one_line_naming_it() {
    for (variable, value) in [
        ("ORCA_PUSH_MODE", "staging"),
        ("PORT", "eighty"),
        ("ORCA_PUSH_PUBLIC_URL", "https://push.example.com/v1"),
        ("ORCA_PUSH_DATABASE_URL", "mysql://db"),
    ] {
        let output = tokio::process::Command::new(orca_push_tests::binary())
            .arg("serve")
            .env(variable, value)
            .output()
            .await
            .unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].starts_with(&format!("orca-push: {variable}: ")),
            "{stderr}"
        );
    }
    // Split mode names the service URL it lacks.
    let output = tokio::process::Command::new(orca_push_tests::binary())
        .args(["serve", "--service", "facade"])
        .env("PORT", "0")
        .env("ORCA_PUSH_INTERNAL_KEY", orca_push_tests::INTERNAL_KEY)
        .env_remove("ORCA_PUSH_AUTH_URL")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("ORCA_PUSH_AUTH_URL"));
}

#[tokio::test]
async fn migrate_applies_every_service_schema_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let output = tokio::process::Command::new(orca_push_tests::binary())
        .arg("migrate")
        .env("ORCA_PUSH_DATA_DIR", dir.path())
        .env_remove("ORCA_PUSH_DATABASE_URL")
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    for file in ["auth.sqlite", "registry.sqlite", "queue.sqlite"] {
        assert!(dir.path().join(file).exists(), "{file}");
    }
    // Migrating twice is a no-op.
    let again = tokio::process::Command::new(orca_push_tests::binary())
        .arg("migrate")
        .env("ORCA_PUSH_DATA_DIR", dir.path())
        .env_remove("ORCA_PUSH_DATABASE_URL")
        .output()
        .await
        .unwrap();
    assert!(again.status.success());
}

#[tokio::test]
async fn validation_mode_is_inert() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(Backend::Sqlite, &[("ORCA_PUSH_MODE", "validation")]).await;
    let raw = Raw::new(&gateway);
    let health = raw.get("/health", &[]).await;
    assert_eq!(health.body["mode"], "validation");
    assert_eq!(raw.get("/ready", &[]).await.status, 200);
    let reply = raw
        .post("/v1/host/challenge", &json!({ "v": 1 }), &[])
        .await;
    assert_eq!(
        (reply.status, reply.error()),
        (503, Some("validation_only"))
    );
    let reply = raw.get("/v1/devices", &[]).await;
    assert_eq!(
        (reply.status, reply.error()),
        (503, Some("validation_only"))
    );
    // A known route with another method, and an unknown one, alike.
    for path in ["/v1/send", "/v1/nothing-here"] {
        let reply = raw.get(path, &[]).await;
        assert_eq!(
            (reply.status, reply.error()),
            (503, Some("validation_only")),
            "GET {path}"
        );
    }
    // It wrote nothing: no database files in its data folder.
    drop(dir);
    assert!(!gateway.data_dir().join("auth.sqlite").exists());
}
