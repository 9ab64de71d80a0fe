//! Internal security over real split-mode processes: every service refuses gRPC calls without a
//! valid token for it (missing, expired, another audience), answers health without one, and lists
//! its API through reflection to a caller with a token.

use std::time::Duration;

use orca_push_internal_auth::{InternalKey, mint, mint_between};
use orca_push_proto::auth::v1 as auth_pb;
use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use orca_push_tests::{Backend, Gateway, INTERNAL_KEY};
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
            Some(mint_between(&key, "support", audience, now - 600, now - 1)),
        ),
        (
            "wrong audience",
            Some(mint(&key, "support", other, Duration::from_secs(60))),
        ),
        (
            "wrong key",
            Some(mint(
                &InternalKey::generate(),
                "support",
                audience,
                Duration::from_secs(60),
            )),
        ),
    ];
    (
        bad,
        mint(&key, "support", audience, Duration::from_secs(60)),
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
