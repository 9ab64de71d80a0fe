//! Internal gRPC calls carry a short-lived HS256 token naming the caller (`sub`), the service
//! called (`aud`) and what it may call (`scope`). Every service refuses a call without one, with
//! another audience, expired, living longer than its scope allows, or naming no well-formed caller,
//! with UNAUTHENTICATED; a read-only token calling a method that is not a read
//! ([`orca_push_proto::access`]) is refused with PERMISSION_DENIED. Only gRPC health checks are
//! open, because probes need them.
//!
//! Services mint full-scope tokens for each other; `orca-push internal-token` mints read-only ones
//! unless told `--scope full`. A token without a scope claim (minted before scopes existed) is
//! read-only.
//!
//! The key is `ORCA_PUSH_INTERNAL_KEY` (required in split mode) or generated per process when all
//! in one. Never log a token or the key.

use std::time::Duration;

mod client;
mod listener;
pub mod news;
mod server;
mod token;
mod transport;

pub use client::{AttachToken, InternalChannel, channel, channel_to, retry_unavailable};
pub use listener::serve_services;
pub use server::{
    Caller, ENDS_WITH_CALLER, RequireToken, RequireTokenService, RunToCompletion,
    RunToCompletionService, incoming, serve_routes, service_routes,
};
pub use token::{
    Claims, InternalKey, KeyError, Refusal, Scope, mint, mint_between, valid_subject, verify,
    verify_any,
};
pub use transport::{CALL_TIMEOUT, LocalCaller, LocalServer, Target, Transport};

/// Tokens services mint for each other live this long, and are re-minted a minute before.
pub const SERVICE_TOKEN_TTL: Duration = Duration::from_secs(300);
const REMINT_BEFORE: Duration = Duration::from_secs(60);
/// How often replica addresses are resolved again (and failed ones offered back to the balancer).
const RESOLVE_EVERY: Duration = Duration::from_secs(10);
/// Health checks are the one open method.
const OPEN_PREFIX: &str = "/grpc.health.v1.Health/";
/// The longest a read-only token may live (a working shift).
pub const MAX_READ_TTL: Duration = Duration::from_secs(8 * 3600);
/// The longest a full-scope token may live.
pub const MAX_FULL_TTL: Duration = Duration::from_secs(3600);
/// How far the minting machine's clock may run ahead of the checking one.
const CLOCK_SKEW: Duration = Duration::from_secs(300);
/// The longest caller name (`sub`).
const MAX_SUBJECT_LEN: usize = 64;

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    use serde::Serialize;

    use super::*;
    use crate::server::{MAX_VERIFIED_TOKENS, VerifiedTokens};
    use crate::token::now_s;

    /// A replica that does not accept connections is not balanced over: every call reaches the
    /// one that does. (tonic's balancer keeps a lazy connection that failed, ready, failing each
    /// call it is given at once.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_that_is_down_gets_no_calls() {
        let (_reporter, health) = tonic_health::server::health_reporter();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = listener.local_addr().unwrap().port();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let down = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let key = InternalKey::generate();
        let url = format!("http://127.0.0.1:{down},http://127.0.0.1:{up}");
        let channel = channel(&url, &key, "facade", "auth").unwrap();
        let calls = (0..40).map(|_| {
            let mut client = tonic_health::pb::health_client::HealthClient::new(channel.clone());
            async move {
                client
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await
                    .map(drop)
            }
        });
        let failed = futures::future::join_all(calls)
            .await
            .into_iter()
            .filter(Result::is_err)
            .count();
        assert_eq!(failed, 0);
    }

    /// A replica that died is routed around, however long the call waited first; a call that ran
    /// out its time is not made again.
    #[tokio::test(start_paused = true)]
    async fn a_call_is_retried_unless_it_ran_out_its_time() {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let failing_after = |after: std::time::Duration, status: tonic::Status| {
            let calls = &calls;
            move || {
                let status = status.clone();
                async move {
                    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(after).await;
                    Err::<(), _>(status)
                }
            }
        };
        let died = tonic::Status::cancelled("h2 protocol error: connection reset");
        let ms = std::time::Duration::from_millis;
        // A connection that died, at once or after the call waited its turn for 2 s.
        for after in [ms(5), ms(2_000)] {
            let _ = retry_unavailable(failing_after(after, died.clone())).await;
            assert_eq!(calls.swap(0, std::sync::atomic::Ordering::SeqCst), 4);
        }
        let timeout = tonic::Status::cancelled("Timeout expired");
        let _ = retry_unavailable(failing_after(ms(40_000), timeout)).await;
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn a_verified_token_is_remembered_until_it_expires_and_a_refused_one_never() {
        let key = InternalKey::generate();
        let verified = VerifiedTokens::default();
        let now = now_s();
        let token = mint_between(&key, "facade", "queue", Scope::Full, now, now + 60);
        let claims = verified.check(&key, &token, &["queue"], now).unwrap();
        assert_eq!(claims.sub, "facade");
        // Remembered: another key cannot have made it, so only a kept verdict accepts it now.
        let other = InternalKey::generate();
        assert_eq!(verified.check(&other, &token, &["queue"], now), Ok(claims));
        assert_eq!(
            verified
                .check(&key, &token, &["queue"], now + 60)
                .map(|c| c.sub),
            Ok("facade".to_owned())
        );
        assert_eq!(
            verified.check(&key, &token, &["queue"], now + 61),
            Err(Refusal::Expired)
        );
        // Refused tokens are not kept: a forged one stays refused, and a token for another
        // audience too.
        let forged = mint_between(&other, "facade", "queue", Scope::Full, now, now + 60);
        let registry = mint_between(&key, "facade", "registry", Scope::Full, now, now + 60);
        for _ in 0..2 {
            assert_eq!(
                verified.check(&key, &forged, &["queue"], now),
                Err(Refusal::Invalid)
            );
            assert_eq!(
                verified.check(&key, &registry, &["queue"], now),
                Err(Refusal::WrongAudience)
            );
        }
        assert_eq!(verified.kept().len(), 1);
    }

    #[test]
    fn remembered_tokens_are_bounded() {
        let key = InternalKey::generate();
        let verified = VerifiedTokens::default();
        let now = now_s();
        for i in 0..MAX_VERIFIED_TOKENS as u64 + 10 {
            let token = mint_between(&key, "facade", "queue", Scope::Full, now, now + 60 + i);
            verified.check(&key, &token, &["queue"], now).unwrap();
            assert!(verified.kept().len() <= MAX_VERIFIED_TOKENS);
        }
    }

    /// A write runs to its end on a task of its own when its caller goes; a call of
    /// [`ENDS_WITH_CALLER`] (here a read) runs on the caller's task and stops with it.
    #[tokio::test]
    async fn only_calls_that_leave_nothing_half_done_end_with_their_caller() {
        use tower::{Layer as _, Service as _};
        let finished = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = finished.clone();
        let inner = tower::service_fn(move |request: http::Request<()>| {
            let seen = seen.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                seen.lock().unwrap().push(request.uri().path().to_owned());
                Ok::<_, std::convert::Infallible>(http::Response::new(()))
            }
        });
        let mut service = RunToCompletion.layer(inner);
        let write = "/orca.push.registry.v1.RegistryService/RegisterDevice";
        let read = "/orca.push.registry.v1.RegistryService/ResolveRegistrations";
        assert!(!ENDS_WITH_CALLER.contains(&write) && ENDS_WITH_CALLER.contains(&read));
        for path in [write, read] {
            let call = service.call(http::Request::get(path).body(()).unwrap());
            // The caller gives up before the handler is done.
            assert!(
                tokio::time::timeout(Duration::from_millis(5), call)
                    .await
                    .is_err()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(*finished.lock().unwrap(), [write]);
    }

    #[test]
    fn a_token_is_good_for_its_audience_only_until_it_expires() {
        let key = InternalKey::generate();
        let token = mint(
            &key,
            "support",
            "queue",
            Scope::Read,
            Duration::from_secs(60),
        );
        let claims = verify(&key, &token, "queue").unwrap();
        assert_eq!(
            (claims.sub.as_str(), claims.scope),
            ("support", Scope::Read)
        );
        assert_eq!(
            verify(&key, &token, "registry"),
            Err(Refusal::WrongAudience)
        );
        let now = now_s();
        let expired = mint_between(&key, "support", "queue", Scope::Read, now - 120, now - 60);
        assert_eq!(verify(&key, &expired, "queue"), Err(Refusal::Expired));
        assert_eq!(
            verify(&InternalKey::generate(), &token, "queue"),
            Err(Refusal::Invalid)
        );
        assert_eq!(verify(&key, "not-a-token", "queue"), Err(Refusal::Invalid));
        let mut tampered = token.clone();
        tampered.insert(tampered.len() - 5, 'x');
        assert!(verify(&key, &tampered, "queue").is_err());
    }

    /// Signs arbitrary claims, as a token minted by an older version or another tool would be.
    fn sign<T: Serialize>(key: &InternalKey, claims: &T) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(secrecy::ExposeSecret::expose_secret(&*key.0)),
        )
        .unwrap()
    }

    #[derive(Serialize)]
    struct OlderClaims<'a> {
        sub: &'a str,
        aud: &'a str,
        iat: u64,
        exp: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        scope: Option<&'a str>,
    }

    #[test]
    fn a_token_without_a_scope_is_read_only_and_an_unknown_scope_is_invalid() {
        let key = InternalKey::generate();
        let now = now_s();
        let older = OlderClaims {
            sub: "support",
            aud: "queue",
            iat: now,
            exp: now + 60,
            scope: None,
        };
        let claims = verify(&key, &sign(&key, &older), "queue").unwrap();
        assert_eq!(claims.scope, Scope::Read);
        let admin = OlderClaims {
            scope: Some("admin"),
            ..older
        };
        assert_eq!(
            verify(&key, &sign(&key, &admin), "queue"),
            Err(Refusal::Invalid)
        );
        let full = OlderClaims {
            scope: Some("full"),
            ..admin
        };
        assert_eq!(
            verify(&key, &sign(&key, &full), "queue").unwrap().scope,
            Scope::Full
        );
    }

    #[test]
    fn the_caller_must_be_named_plainly() {
        let key = InternalKey::generate();
        let ttl = Duration::from_secs(60);
        for good in [
            "facade",
            "sre-oncall",
            "team.support_2",
            "alice@example.com",
        ] {
            let token = mint(&key, good, "queue", Scope::Read, ttl);
            assert!(verify(&key, &token, "queue").is_ok(), "{good}");
        }
        let long = "x".repeat(65);
        for bad in [
            "",
            " ",
            "sre team",
            "evil\nINFO forged line",
            "é",
            long.as_str(),
        ] {
            let token = mint(&key, bad, "queue", Scope::Full, ttl);
            assert_eq!(
                verify(&key, &token, "queue"),
                Err(Refusal::BadSubject),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_token_may_not_outlive_its_scope() {
        let key = InternalKey::generate();
        let hours = |h: u64| Duration::from_secs(h * 3600);
        let read = mint(&key, "support", "queue", Scope::Read, hours(8));
        assert!(verify(&key, &read, "queue").is_ok());
        let read = mint(&key, "support", "queue", Scope::Read, hours(24));
        assert_eq!(verify(&key, &read, "queue"), Err(Refusal::TooLong));
        let full = mint(&key, "sre", "queue", Scope::Full, hours(1));
        assert!(verify(&key, &full, "queue").is_ok());
        let full = mint(&key, "sre", "queue", Scope::Full, hours(2));
        assert_eq!(verify(&key, &full, "queue"), Err(Refusal::TooLong));
        // Older tokens (no scope) are held to the read-only limit: a 24 h one is refused.
        let now = now_s();
        let older = OlderClaims {
            sub: "support",
            aud: "queue",
            iat: now,
            exp: now + 86_400,
            scope: None,
        };
        assert_eq!(
            verify(&key, &sign(&key, &older), "queue"),
            Err(Refusal::TooLong)
        );
        // A read token minted for 30 days is refused in its last hours too, and one dated in
        // the future as well.
        let day = 86_400;
        let late = mint_between(
            &key,
            "support",
            "queue",
            Scope::Read,
            now - 29 * day,
            now + 3_600,
        );
        assert_eq!(verify(&key, &late, "queue"), Err(Refusal::TooLong));
        let ahead = mint_between(
            &key,
            "support",
            "queue",
            Scope::Read,
            now + day,
            now + 3_600,
        );
        assert_eq!(verify(&key, &ahead, "queue"), Err(Refusal::TooLong));
        let started = mint_between(
            &key,
            "support",
            "queue",
            Scope::Read,
            now - 3_600,
            now + 3_600,
        );
        assert!(verify(&key, &started, "queue").is_ok());
    }

    /// Runs one call with `token` through the server layer in front of a service that answers OK:
    /// the gRPC code answered, and the caller the service saw (None: it was not reached, or saw no
    /// caller).
    async fn answer(key: &InternalKey, path: &str, token: Option<&str>) -> (tonic::Code, String) {
        use tower::{Layer as _, ServiceExt as _};
        let inner = tower::service_fn(|request: http::Request<()>| async move {
            let caller = request
                .extensions()
                .get::<Caller>()
                .map_or("nobody".to_owned(), |c| c.0.clone());
            let mut response = http::Response::new(());
            response
                .headers_mut()
                .insert("x-test-caller", caller.parse().unwrap());
            Ok::<_, std::convert::Infallible>(response)
        });
        let service = RequireToken::new(key.clone(), "registry").layer(inner);
        let mut request = http::Request::builder().uri(format!("http://registry{path}"));
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let response = service.oneshot(request.body(()).unwrap()).await.unwrap();
        let code = tonic::Status::from_header_map(response.headers())
            .map_or(tonic::Code::Ok, |status| status.code());
        let caller = response
            .headers()
            .get("x-test-caller")
            .map_or("not reached", |v| v.to_str().unwrap())
            .to_owned();
        (code, caller)
    }

    #[tokio::test]
    async fn a_read_only_token_calls_reads_only_and_a_full_one_everything() {
        let key = InternalKey::generate();
        let ttl = Duration::from_secs(60);
        let read = mint(&key, "support", "registry", Scope::Read, ttl);
        let full = mint(&key, "sender", "registry", Scope::Full, ttl);
        let ok = |caller: &str| (tonic::Code::Ok, caller.to_owned());
        let refused = |code| (code, "not reached".to_owned());
        let list = "/orca.push.registry.v1.RegistryService/ListDevices";
        let reflection = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
        for read_method in [list, reflection] {
            assert_eq!(answer(&key, read_method, Some(&read)).await, ok("support"));
            assert_eq!(answer(&key, read_method, Some(&full)).await, ok("sender"));
        }
        for write in [
            "/orca.push.registry.v1.RegistryService/GetDevicesForDelivery",
            "/orca.push.registry.v1.RegistryService/MarkDead",
            "/orca.push.registry.v1.RegistryService/DropEverything",
        ] {
            assert_eq!(
                answer(&key, write, Some(&read)).await,
                refused(tonic::Code::PermissionDenied),
                "{write}"
            );
            assert_eq!(answer(&key, write, Some(&full)).await, ok("sender"));
        }
        assert_eq!(
            answer(&key, list, None).await,
            refused(tonic::Code::Unauthenticated)
        );
        // Health stays open: reached with no token, and no caller.
        assert_eq!(
            answer(&key, "/grpc.health.v1.Health/Check", None).await,
            ok("nobody")
        );
    }

    #[tokio::test]
    async fn accepted_grpc_connections_send_small_writes_at_once() {
        use tokio_stream::StreamExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let server_side = accepted.next().await.unwrap().unwrap();
        assert!(
            server_side.nodelay().unwrap(),
            "without TCP_NODELAY every gRPC answer can wait 40 ms for a delayed ACK"
        );
    }

    #[test]
    fn configured_keys_must_be_long_enough() {
        assert_eq!(
            InternalKey::from_secret("short").unwrap_err(),
            KeyError::TooShort
        );
        assert!(InternalKey::from_secret(&"k".repeat(32)).is_ok());
        let key = InternalKey::from_secret(&"k".repeat(40)).unwrap();
        let shown = format!("{key:?}");
        assert!(
            shown.contains("REDACTED") && !shown.contains("kkkk"),
            "{shown}"
        );
    }
}
