//! Internal security over real split-mode processes: every service refuses gRPC calls without a
//! valid token for it (missing, expired, another audience), answers health without one, and lists
//! its API through reflection to a caller with a token; a read-only token calls reads only; and a
//! facade whose internal key the services refuse answers hosts `dependency_unavailable`.

use std::time::Duration;

use orca_push_internal_auth::{InternalKey, Scope, mint, mint_between};
use orca_push_proto::auth::v1 as auth_pb;
use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use orca_push_tests::world::{WAIT, World};
use orca_push_tests::{Backend, Gateway, INTERNAL_KEY, free_port};
use tonic::transport::Channel;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

async fn channel(port: u16) -> Channel {
    Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A request carrying `token` (or none) as an internal bearer.
fn with_token<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

/// The tokens to try against `audience`: none, expired, for another service, and a good one.
fn tokens(audience: &str) -> (Vec<(&'static str, Option<String>)>, String) {
    let key = InternalKey::from_secret(INTERNAL_KEY).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let other = if audience == "queue" {
        "registry"
    } else {
        "queue"
    };
    let bad = vec![
        ("missing", None),
        (
            "expired",
            Some(mint_between(
                &key,
                "support",
                audience,
                Scope::Full,
                now - 600,
                now - 1,
            )),
        ),
        (
            "wrong audience",
            Some(mint(
                &key,
                "support",
                other,
                Scope::Full,
                Duration::from_secs(60),
            )),
        ),
        (
            "no caller named",
            Some(mint(
                &key,
                "",
                audience,
                Scope::Full,
                Duration::from_secs(60),
            )),
        ),
        (
            "wrong key",
            Some(mint(
                &InternalKey::generate(),
                "support",
                audience,
                Scope::Full,
                Duration::from_secs(60),
            )),
        ),
    ];
    (
        bad,
        mint(
            &key,
            "support",
            audience,
            Scope::Full,
            Duration::from_secs(60),
        ),
    )
}

async fn list_services(port: u16, token: Option<&str>) -> Result<Vec<String>, tonic::Status> {
    let mut client = ServerReflectionClient::new(channel(port).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(with_token(tokio_stream::iter(vec![request]), token))
        .await?
        .into_inner();
    let reply = stream.message().await?.expect("a reflection answer");
    match reply.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

async fn health(port: u16) -> i32 {
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel(port).await);
    client
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health answers without a token")
        .into_inner()
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_refuses_calls_without_a_valid_token_for_it() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    for service in ["auth", "registry", "queue", "sender"] {
        let port = gateway.process(service).port;
        assert_eq!(
            health(port).await,
            1,
            "{service}: health is open and SERVING"
        );
        let (bad, good) = tokens(service);
        for (what, token) in &bad {
            let refused = list_services(port, token.as_deref()).await.unwrap_err();
            assert_eq!(
                refused.code(),
                tonic::Code::Unauthenticated,
                "{service} reflection, {what}"
            );
            let refused = call(service, port, token.as_deref()).await;
            if let Some(refused) = refused {
                assert_eq!(
                    refused.err().map(|s| s.code()),
                    Some(tonic::Code::Unauthenticated),
                    "{service}, {what}"
                );
            }
        }
        let listed = list_services(port, Some(&good)).await.unwrap();
        assert!(
            listed.iter().any(|s| s == "grpc.health.v1.Health"),
            "{service}: {listed:?}"
        );
        if let Some(answer) = call(service, port, Some(&good)).await {
            answer.unwrap_or_else(|status| panic!("{service} with a good token: {status:?}"));
        }
    }
}

/// One method of `service`; None for the sender, which serves only health and reflection.
async fn call(service: &str, port: u16, token: Option<&str>) -> Option<Result<(), tonic::Status>> {
    let ch = channel(port).await;
    Some(match service {
        "auth" => auth_pb::auth_service_client::AuthServiceClient::new(ch)
            .issue_challenge(with_token(
                auth_pb::IssueChallengeRequest {
                    host_public_key: vec![9; 32],
                },
                token,
            ))
            .await
            .map(drop),
        "registry" => registry_pb::registry_service_client::RegistryServiceClient::new(ch)
            .list_devices(with_token(
                registry_pb::ListDevicesRequest {
                    host_fingerprint: "someone".into(),
                },
                token,
            ))
            .await
            .map(drop),
        "queue" => queue_pb::queue_service_client::QueueServiceClient::new(ch)
            .get_queue_depth(with_token(queue_pb::GetQueueDepthRequest {}, token))
            .await
            .map(drop),
        _ => return None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_mints_tokens_with_the_shared_key() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    let output = tokio::process::Command::new(orca_push_tests::binary())
        .args([
            "internal-token",
            "--audience",
            "queue",
            "--subject",
            "sre-team",
            "--ttl",
            "60",
        ])
        .env("ORCA_PUSH_INTERNAL_KEY", INTERNAL_KEY)
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let token = String::from_utf8(output.stdout).unwrap().trim().to_owned();
    let port = gateway.process("queue").port;
    call("queue", port, Some(&token))
        .await
        .unwrap()
        .expect("the CLI's token is accepted");
    let refused = call("registry", gateway.process("registry").port, Some(&token))
        .await
        .unwrap();
    assert_eq!(
        refused.unwrap_err().code(),
        tonic::Code::Unauthenticated,
        "a queue token is not a registry token"
    );
    // Without the key the CLI (and any split-mode process) refuses, naming the variable.
    let output = tokio::process::Command::new(orca_push_tests::binary())
        .args(["internal-token", "--audience", "queue", "--subject", "x"])
        .env_remove("ORCA_PUSH_INTERNAL_KEY")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("ORCA_PUSH_INTERNAL_KEY"));
    let output = tokio::process::Command::new(orca_push_tests::binary())
        .args(["serve", "--service", "queue"])
        .env_remove("ORCA_PUSH_INTERNAL_KEY")
        .env("ORCA_PUSH_GRPC_ADDR", "127.0.0.1:0")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).starts_with("orca-push: ORCA_PUSH_INTERNAL_KEY")
    );
}

/// `orca-push internal-token <args>` with the test fleet's key.
async fn internal_token(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(orca_push_tests::binary())
        .arg("internal-token")
        .args(args)
        .env("ORCA_PUSH_INTERNAL_KEY", INTERNAL_KEY)
        .output()
        .await
        .unwrap()
}

/// The token `orca-push internal-token <args>` prints.
async fn cli_token(args: &[&str]) -> String {
    let output = internal_token(args).await;
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// A token as versions before scopes minted it: no `scope` claim.
fn older_token(audience: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims =
        serde_json::json!({ "sub": "support", "aud": audience, "iat": now, "exp": now + 300 });
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(INTERNAL_KEY.as_bytes()),
    )
    .unwrap()
}

fn code<T>(answer: Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
    answer.map_or_else(|status| status.code(), |_| tonic::Code::Ok)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn team_tokens_are_read_only_unless_minted_full() {
    use tonic::Code::{Ok, PermissionDenied};
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    let registry_port = gateway.process("registry").port;
    let queue_port = gateway.process("queue").port;
    let auth_port = gateway.process("auth").port;
    let registry = |port| async move {
        registry_pb::registry_service_client::RegistryServiceClient::new(channel(port).await)
    };
    let queue = |port| async move {
        queue_pb::queue_service_client::QueueServiceClient::new(channel(port).await)
    };
    let register = |device: &str| registry_pb::RegisterDeviceRequest {
        host_fingerprint: "D20lU_8MD0R64gLt".into(),
        device_id: device.into(),
        platform: registry_pb::Platform::Android as i32,
        token: format!("fcm-token-of-{device}-0123456789abcdef"),
        apns_environment: 0,
        filter: None,
    };
    let list = || registry_pb::ListDevicesRequest {
        host_fingerprint: "D20lU_8MD0R64gLt".into(),
    };
    let outcomes = || queue_pb::GetEventOutcomesRequest {
        host_fingerprint: "D20lU_8MD0R64gLt".into(),
        kind: queue_pb::Kind::Alert as i32,
        notification_epoch: "epoch".into(),
        notification_seq: 1,
    };
    let claim = || queue_pb::ClaimRequest {
        lane: "support/lane".into(),
        max_batches: 1,
        lease_ms: 1_000,
        wait_ms: 0,
        ..Default::default()
    };

    // A full token (explicitly asked for) calls everything, push tokens included.
    let full = cli_token(&[
        "--audience",
        "registry",
        "--subject",
        "sre-oncall",
        "--scope",
        "full",
        "--ttl",
        "600",
    ])
    .await;
    let registration_id = registry(registry_port)
        .await
        .register_device(with_token(register("phone-1"), Some(&full)))
        .await
        .expect("a full token registers a device")
        .into_inner()
        .registration_id;
    let delivery = || registry_pb::GetDevicesForDeliveryRequest {
        registration_ids: vec![registration_id.clone()],
    };
    let devices = registry(registry_port)
        .await
        .get_devices_for_delivery(with_token(delivery(), Some(&full)))
        .await
        .expect("a full token reads delivery devices")
        .into_inner()
        .devices;
    assert_eq!(devices.len(), 1);
    assert!(devices[0].token.starts_with("fcm-token-of-phone-1"));
    let full_queue = cli_token(&[
        "--audience",
        "queue",
        "--subject",
        "sre-oncall",
        "--scope",
        "full",
    ])
    .await;
    assert_eq!(
        code(
            queue(queue_port)
                .await
                .claim(with_token(claim(), Some(&full_queue)))
                .await
        ),
        Ok
    );

    // The CLI's default token, and one from before scopes, read but never write or see tokens.
    let read_registry = cli_token(&[
        "--audience",
        "registry",
        "--subject",
        "support",
        "--ttl",
        "600",
    ])
    .await;
    let read_queue = cli_token(&["--audience", "queue", "--subject", "support"]).await;
    let read_auth = cli_token(&["--audience", "auth", "--subject", "support"]).await;
    for (registry_token, queue_token) in [
        (read_registry, read_queue),
        (older_token("registry"), older_token("queue")),
    ] {
        let (r, q) = (Some(registry_token.as_str()), Some(queue_token.as_str()));
        let listed = registry(registry_port)
            .await
            .list_devices(with_token(list(), r))
            .await
            .expect("a read token lists a host's devices")
            .into_inner();
        assert_eq!(listed.devices.len(), 1);
        assert_eq!(
            code(
                queue(queue_port)
                    .await
                    .get_queue_depth(with_token(queue_pb::GetQueueDepthRequest {}, q))
                    .await
            ),
            Ok
        );
        assert_eq!(
            code(
                queue(queue_port)
                    .await
                    .get_event_outcomes(with_token(outcomes(), q))
                    .await
            ),
            Ok
        );
        assert!(list_services(registry_port, r).await.is_ok(), "reflection");
        // Push tokens are not a read.
        assert_eq!(
            code(
                registry(registry_port)
                    .await
                    .get_devices_for_delivery(with_token(delivery(), r))
                    .await
            ),
            PermissionDenied
        );
        assert_eq!(
            code(
                registry(registry_port)
                    .await
                    .register_device(with_token(register("phone-2"), r))
                    .await
            ),
            PermissionDenied
        );
        assert_eq!(
            code(
                registry(registry_port)
                    .await
                    .delete_device(with_token(
                        registry_pb::DeleteDeviceRequest {
                            host_fingerprint: "D20lU_8MD0R64gLt".into(),
                            registration_id: registration_id.clone(),
                        },
                        r
                    ))
                    .await
            ),
            PermissionDenied
        );
        assert_eq!(
            code(queue(queue_port).await.claim(with_token(claim(), q)).await),
            PermissionDenied
        );
    }
    assert_eq!(
        code(
            auth_pb::auth_service_client::AuthServiceClient::new(channel(auth_port).await)
                .authenticate(with_token(
                    auth_pb::AuthenticateRequest {
                        session_token: "x".repeat(43),
                    },
                    Some(&read_auth)
                ))
                .await
        ),
        PermissionDenied,
        "resolving a bearer is not a read"
    );
    // Nothing a read token was refused happened.
    let listed = registry(registry_port)
        .await
        .list_devices(with_token(list(), Some(&full)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.devices.len(), 1, "{listed:?}");
    let logs = gateway.logs();
    assert!(
        logs.contains("internal call refused") && logs.contains("support"),
        "refusals are logged with the caller"
    );
    assert!(!logs.contains(&full), "a token is never logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_caps_lifetimes_by_scope_and_checks_the_caller() {
    async fn refused(args: &[&str], says: &str) {
        let output = internal_token(&[&["--audience", "queue"], args].concat()).await;
        assert!(!output.status.success(), "{args:?} was minted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    async fn minted(args: &[&str]) -> orca_push_internal_auth::Claims {
        let token = cli_token(&[&["--audience", "queue"], args].concat()).await;
        let key = InternalKey::from_secret(INTERNAL_KEY).unwrap();
        orca_push_internal_auth::verify(&key, &token, "queue").unwrap()
    }
    refused(&["--subject", "sre", "--ttl", "86400"], "28800").await;
    refused(
        &["--subject", "sre", "--scope", "full", "--ttl", "3601"],
        "3600",
    )
    .await;
    refused(&["--subject", "sre team"], "--subject").await;
    refused(&["--subject", ""], "--subject").await;
    refused(&["--subject", "sre", "--scope", "admin"], "--scope").await;
    let read = minted(&["--subject", "sre", "--ttl", "28800"]).await;
    assert_eq!((read.scope, read.exp - read.iat), (Scope::Read, 28_800));
    let full = minted(&["--subject", "sre", "--scope", "full", "--ttl", "3600"]).await;
    assert_eq!((full.scope, full.exp - full.iat), (Scope::Full, 3_600));
    let default = minted(&["--subject", "sre@example.com"]).await;
    assert_eq!(
        (
            default.scope,
            default.exp - default.iat,
            default.sub.as_str()
        ),
        (Scope::Read, 300, "sre@example.com")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_facade_whose_internal_key_is_refused_answers_hosts_dependency_unavailable() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    let raw = orca_push_tests::Raw::new(&gateway);
    let host = orca_push_host::HostKey::generate();
    let session = raw.login(&host, &[]).await;
    let bearer = orca_push_tests::bearer(&session);
    let authorized = [("authorization", bearer.as_str())];
    assert_eq!(raw.get("/v1/devices", &authorized).await.status, 200);
    let unknown = orca_push_tests::bearer(&"A".repeat(43));
    let forged = [("authorization", unknown.as_str())];
    assert_eq!(
        raw.get("/v1/devices", &forged).await.error(),
        Some("invalid_token"),
        "a genuinely unknown bearer is the host's fault"
    );

    // The facade restarts with another key than the services'.
    let facade = gateway.process("facade");
    facade.kill().await;
    facade
        .respawn_with(&[(
            "ORCA_PUSH_INTERNAL_KEY",
            "another-key-entirely-0123456789abcdef-0123456789",
        )])
        .await;
    for _ in 0..3 {
        let answer = raw.get("/v1/devices", &authorized).await;
        assert_eq!(
            (answer.status, answer.error()),
            (503, Some("dependency_unavailable")),
            "the host keeps its session: {answer:?}"
        );
    }
    let (challenge, _) = raw.challenge(&host, &[]).await;
    assert_eq!(
        (challenge.status, challenge.error()),
        (503, Some("dependency_unavailable"))
    );
    assert!(
        gateway.logs().contains("ORCA_PUSH_INTERNAL_KEY"),
        "the operator is told what to check"
    );

    // With the right key again, the same session works: nothing was dropped.
    let facade = gateway.process("facade");
    facade.kill().await;
    facade
        .respawn_with(&[("ORCA_PUSH_INTERNAL_KEY", INTERNAL_KEY)])
        .await;
    assert_eq!(raw.get("/v1/devices", &authorized).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_follows_the_services_and_healthz_only_the_process() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    let raw = orca_push_tests::Raw::new(&gateway);
    assert_eq!(raw.get("/ready", &[]).await.status, 200);
    gateway.process("queue").kill().await;
    // Readiness is cached for a second; then the dead queue shows.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let ready = raw.get("/ready", &[]).await;
    assert_eq!(
        (ready.status, ready.error()),
        (503, Some("dependency_unavailable"))
    );
    assert_eq!(
        raw.get("/healthz", &[]).await.status,
        200,
        "the process itself is alive"
    );
    gateway.process("queue").respawn().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while raw.get("/ready", &[]).await.status != 200 {
        assert!(std::time::Instant::now() < deadline, "never ready again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_healthcheck_asks_http_or_grpc_health() {
    let mut gateway = Gateway::start_split(Backend::Sqlite).await;
    let check = |pairs: Vec<(&'static str, String)>| async move {
        tokio::process::Command::new(orca_push_tests::binary())
            .arg("healthcheck")
            .env_remove("ORCA_PUSH_GRPC_ADDR")
            .envs(pairs)
            .output()
            .await
            .unwrap()
            .status
            .success()
    };
    let facade_port = gateway.base.rsplit(':').next().unwrap().to_owned();
    assert!(
        check(vec![("PORT", facade_port)]).await,
        "the facade answers /healthz"
    );
    let queue = gateway.process("queue").port;
    assert!(
        check(vec![("ORCA_PUSH_GRPC_ADDR", format!("0.0.0.0:{queue}"))]).await,
        "the queue answers gRPC health"
    );
    gateway.process("queue").kill().await;
    assert!(
        !check(vec![("ORCA_PUSH_GRPC_ADDR", format!("0.0.0.0:{queue}"))]).await,
        "a dead queue fails it"
    );
    assert!(
        !check(vec![("PORT", "1".into())]).await,
        "nothing on the port fails it"
    );
}

/// Reflection v1alpha (older grpcurl), listing services.
async fn list_services_v1alpha(
    port: u16,
    token: Option<&str>,
) -> Result<Vec<String>, tonic::Status> {
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    let mut client = ServerReflectionClient::new(channel(port).await);
    let request = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(with_token(tokio_stream::iter(vec![request]), token))
        .await?
        .into_inner();
    let reply = stream.message().await?.expect("a reflection answer");
    match reply.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

/// `orca-push serve` with `ORCA_PUSH_GRPC_ADDR`: one listener for every service, each behind its
/// own tokens, health open, reflection v1 and v1alpha for a token of any service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_all_in_one_listener_serves_every_service_behind_its_tokens() {
    // Port 0, read back from the log: a port probed free and released could be taken by the
    // gateway's own metrics listener before its gRPC listener binds it.
    let gateway = Gateway::start_with(
        Backend::Sqlite,
        &[
            ("ORCA_PUSH_GRPC_ADDR", "127.0.0.1:0"),
            ("ORCA_PUSH_INTERNAL_KEY", INTERNAL_KEY),
        ],
    )
    .await;
    let port = listener_port(&gateway);
    assert_eq!(health(port).await, 1, "health is open and SERVING");
    for service in ["auth", "registry", "queue"] {
        let (bad, good) = tokens(service);
        for (what, token) in &bad {
            let refused = call(service, port, token.as_deref()).await.unwrap();
            assert_eq!(
                refused.err().map(|s| s.code()),
                Some(tonic::Code::Unauthenticated),
                "{service}, {what}"
            );
        }
        call(service, port, Some(&good))
            .await
            .unwrap()
            .unwrap_or_else(|status| panic!("{service} with a good token: {status:?}"));
        // Reflection takes a token of any service, in both versions.
        let listed = list_services(port, Some(&good)).await.unwrap();
        for api in [
            "orca.push.auth.v1.AuthService",
            "orca.push.registry.v1.RegistryService",
            "orca.push.queue.v1.QueueService",
        ] {
            assert!(listed.iter().any(|s| s == api), "{service}: {listed:?}");
        }
        let listed = list_services_v1alpha(port, Some(&good)).await.unwrap();
        assert!(
            listed
                .iter()
                .any(|s| s == "orca.push.queue.v1.QueueService")
        );
    }
    let refused = list_services(port, None).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let refused = list_services_v1alpha(port, None).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
}

/// The port the all-in-one listener logged.
fn listener_port(gateway: &Gateway) -> u16 {
    let logs = gateway.logs();
    logs.lines()
        .find(|line| line.contains("internal gRPC listening"))
        .and_then(|line| line.split("addr=127.0.0.1:").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("the listener's address is logged: {logs}"))
}

/// A full-scope queue caller can name any registration id in `Enqueue`; the queue cannot tell
/// whose it is (the registry owns the phones), so the sender refuses a phone of another host
/// instead of sending it this host's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_enqueue_never_reaches_another_hosts_phone() {
    let w = World::start_with(
        Backend::Sqlite,
        "0",
        &[
            ("ORCA_PUSH_GRPC_ADDR", "127.0.0.1:0"),
            ("ORCA_PUSH_INTERNAL_KEY", INTERNAL_KEY),
        ],
    )
    .await;
    let token = "dd01";
    let id = w.register_ios("iphone", token).await;
    let (_, full) = tokens("queue");
    let mut queue = queue_pb::queue_service_client::QueueServiceClient::new(
        channel(listener_port(&w.gateway)).await,
    );
    let other_host = orca_push_host::HostKey::from_secret([9u8; 32]).fingerprint();
    let enqueue = |host: String, seq: u64| queue_pb::EnqueueRequest {
        host_fingerprint: host,
        notification: Some(queue_pb::Notification {
            notification_id: Some("n-1".into()),
            notification_seq: seq,
            notification_epoch: "epoch".into(),
            source: "terminal-bell".into(),
            title: "Not yours".into(),
            kind: queue_pb::Kind::Alert as i32,
            ..Default::default()
        }),
        recipients: vec![queue_pb::Recipient {
            registration_id: id.clone(),
            silent: false,
            provider: queue_pb::Provider::Apns as i32,
        }],
    };
    let answer = queue
        .enqueue(with_token(enqueue(other_host, 1), Some(&full)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.results[0].status,
        queue_pb::EnqueueStatus::Queued as i32
    );
    w.wait_outcome(&id, "failed").await;
    assert!(w.apns.calls_for(token).is_empty(), "the phone got nothing");
    // The phone's own host still reaches it the same way.
    let own_host = orca_push_host::HostKey::from_secret([7u8; 32]).fingerprint();
    queue
        .enqueue(with_token(enqueue(own_host, 2), Some(&full)))
        .await
        .unwrap();
    w.apns.wait_for(token, 1, WAIT).await;
}

/// Without a configured key nobody could mint a token for the listener: refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_all_in_one_listener_needs_a_known_internal_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = tokio::process::Command::new(orca_push_tests::binary())
        .arg("serve")
        .env("ORCA_PUSH_GRPC_ADDR", format!("127.0.0.1:{}", free_port()))
        .env("ORCA_PUSH_DATA_DIR", dir.path())
        .env("PORT", free_port().to_string())
        .env("ORCA_PUSH_METRICS_ADDR", "127.0.0.1:0")
        .env_remove("ORCA_PUSH_INTERNAL_KEY")
        .env_remove("ORCA_PUSH_DATABASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), out)
        .await
        .expect("it stops at once")
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ORCA_PUSH_GRPC_ADDR"), "{stderr}");
    assert!(
        !dir.path().join("auth.db").exists() && std::fs::read_dir(dir.path()).unwrap().count() == 0,
        "nothing migrated before the refusal"
    );
}

/// Split auth without ORCA_PUSH_PUBLIC_URL used to bind its port and migrate before failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_service_missing_a_setting_binds_and_migrates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let grpc_port = free_port();
    let out = tokio::process::Command::new(orca_push_tests::binary())
        .args(["serve", "--service", "auth"])
        .env("ORCA_PUSH_GRPC_ADDR", format!("127.0.0.1:{grpc_port}"))
        .env("ORCA_PUSH_INTERNAL_KEY", INTERNAL_KEY)
        .env("ORCA_PUSH_REGISTRY_URL", "http://127.0.0.1:9")
        .env("ORCA_PUSH_DATA_DIR", dir.path())
        .env("ORCA_PUSH_METRICS_ADDR", "127.0.0.1:0")
        .env_remove("ORCA_PUSH_PUBLIC_URL")
        .env_remove("ORCA_PUSH_DATABASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), out)
        .await
        .expect("it stops at once")
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ORCA_PUSH_PUBLIC_URL"), "{stderr}");
    assert!(!stderr.contains("listening"), "nothing bound: {stderr}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing migrated"
    );
}
