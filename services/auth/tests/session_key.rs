//! The session key behind tagged tokens, on SQLite and PostgreSQL: created once, the same for every
//! replica and restart, and untagged tokens honoured only when sessions predate the key.

use std::sync::Arc;

use orca_push_auth::{
    AnyAuthStore, AuthError, HostAuth, LEGACY_WINDOW_MS, SESSION_TTL_MS, SessionKey, Tag,
    open_and_migrate, session_token,
};
use orca_push_storage::testing::{Backend, fresh};
use orca_push_storage::{ManualClock, Pool};

const ORIGIN: &str = "https://push.example.test";
const T0: u64 = 1_800_000_000_000;

macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$name(orca_push_storage::testing::Backend::Sqlite).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$name(orca_push_storage::testing::Backend::Postgres).await;
            }
        }
    )*};
}

on_both_backends!(
    one_key_for_every_replica_and_restart_and_no_legacy_window_on_a_fresh_database,
    untagged_sessions_from_before_the_key_are_honoured_for_the_legacy_window_only,
);

fn auth(pool: Pool, clock: &ManualClock) -> HostAuth<AnyAuthStore> {
    HostAuth::new(
        AnyAuthStore::new(pool),
        ORIGIN.to_owned(),
        Arc::new(clock.clone()),
    )
}

async fn one_key_for_every_replica_and_restart_and_no_legacy_window_on_a_fresh_database(
    backend: Backend,
) {
    let (config, _guard) = fresh(backend).await;
    let clock = ManualClock::new(T0);
    let first = auth(open_and_migrate(&config).await.unwrap(), &clock);
    let second = auth(open_and_migrate(&config).await.unwrap(), &clock);
    // Two replicas asking at once agree on one key.
    let (a, b) = tokio::join!(first.session_tagging(), second.session_tagging());
    let (a, b) = (a.unwrap().clone(), b.unwrap().clone());
    assert_eq!(a, b);
    assert_eq!(a.legacy_until_ms, 0, "nothing predates the key");
    // A restart (a new process over the same database) reads the same key back.
    let restarted = auth(open_and_migrate(&config).await.unwrap(), &clock);
    assert_eq!(restarted.session_tagging().await.unwrap(), &a);
    // With no legacy window, a well-formed token without the tag is refused.
    assert!(matches!(
        restarted.authenticate(&"A".repeat(43)).await,
        Err(AuthError::InvalidToken)
    ));
    assert_eq!(a.key.check(&a.key.mint().unwrap()), Tag::Valid);
}

async fn untagged_sessions_from_before_the_key_are_honoured_for_the_legacy_window_only(
    backend: Backend,
) {
    let (config, _guard) = fresh(backend).await;
    let pool = open_and_migrate(&config).await.unwrap();
    // A session minted by the previous version: 32 random bytes, no tag.
    let old_token = "q".repeat(43);
    let hash = hex(&session_token::token_hash(&old_token));
    // Its expiry is moved far out so only the window, not the TTL, can end it.
    let expires = (T0 + 3 * SESSION_TTL_MS) as i64;
    let insert = "INSERT INTO push_sessions (token_hash, host_fingerprint, expires_at, created_at) \
                  VALUES ($1, 'fp-legacy-host00', $2, $3)";
    match &pool {
        Pool::Sqlite(p) => {
            sqlx::query(insert)
                .bind(&hash)
                .bind(expires)
                .bind(T0 as i64)
                .execute(p)
                .await
                .unwrap();
        }
        Pool::Postgres(p) => {
            sqlx::query(insert)
                .bind(&hash)
                .bind(expires)
                .bind(T0 as i64)
                .execute(p)
                .await
                .unwrap();
        }
    }
    let clock = ManualClock::new(T0);
    let auth = auth(pool, &clock);
    let tagging = auth.session_tagging().await.unwrap().clone();
    assert_eq!(tagging.legacy_until_ms, T0 + LEGACY_WINDOW_MS);
    assert_eq!(tagging.check(&old_token, T0), Tag::Legacy);
    let host = auth.authenticate(&old_token).await.expect("legacy session");
    assert_eq!(host.host_fingerprint, "fp-legacy-host00");
    // A token under another key is still no session at all.
    assert!(matches!(
        auth.authenticate(&SessionKey::generate().mint().unwrap())
            .await,
        Err(AuthError::InvalidToken)
    ));
    clock.set(T0 + LEGACY_WINDOW_MS);
    assert!(matches!(
        auth.authenticate(&old_token).await,
        Err(AuthError::InvalidToken)
    ));
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
