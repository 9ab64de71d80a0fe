//! A proof that comes back to the replica that issued its challenge is checked without reading
//! the challenge back; a proof that reaches another replica reads it from the store; either way a
//! challenge redeems once. On SQLite and PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use orca_push_auth::store::{ChallengeRow, NewChallenge, NewSession, Pruned, SessionRow};
use orca_push_auth::{AnyAuthStore, AuthError, AuthStore, HostAuth, open_and_migrate};
use orca_push_host_proof as hp;
use orca_push_storage::ManualClock;
use orca_push_storage::testing::{Backend, fresh};

const ORIGIN: &str = "https://push.example.test";
const T0: u64 = 1_800_000_000_000;

/// A store that counts its challenge reads.
#[derive(Clone)]
struct Counted {
    store: AnyAuthStore,
    challenge_reads: Arc<AtomicU64>,
}

impl Counted {
    fn reads(&self) -> u64 {
        self.challenge_reads.load(Ordering::Relaxed)
    }
}

impl AuthStore for Counted {
    async fn session_key(
        &self,
        candidate: &[u8],
        legacy_until_ms: u64,
        now_ms: u64,
    ) -> Result<(Vec<u8>, u64), sqlx::Error> {
        self.store
            .session_key(candidate, legacy_until_ms, now_ms)
            .await
    }
    async fn insert_challenge(&self, c: &NewChallenge<'_>) -> Result<(), sqlx::Error> {
        self.store.insert_challenge(c).await
    }
    async fn find_challenge(&self, id: &str) -> Result<Option<ChallengeRow>, sqlx::Error> {
        self.challenge_reads.fetch_add(1, Ordering::Relaxed);
        self.store.find_challenge(id).await
    }
    async fn redeem_challenge(&self, s: &NewSession<'_>) -> Result<bool, sqlx::Error> {
        self.store.redeem_challenge(s).await
    }
    async fn find_session(&self, token_hash: &str) -> Result<Option<SessionRow>, sqlx::Error> {
        self.store.find_session(token_hash).await
    }
    async fn host_last_seen(&self, fp: &str) -> Result<Option<u64>, sqlx::Error> {
        self.store.host_last_seen(fp).await
    }
    async fn touch_host(&self, fp: &str, now: u64, stale: u64) -> Result<(), sqlx::Error> {
        self.store.touch_host(fp, now, stale).await
    }
    async fn stale_hosts(
        &self,
        before_ms: u64,
        after: &str,
        limit: i64,
    ) -> Result<Vec<String>, sqlx::Error> {
        self.store.stale_hosts(before_ms, after, limit).await
    }
    async fn delete_stale_hosts(&self, hosts: &[String], before: u64) -> Result<u64, sqlx::Error> {
        self.store.delete_stale_hosts(hosts, before).await
    }
    async fn prune(&self, challenges: u64, sessions: u64) -> Result<Pruned, sqlx::Error> {
        self.store.prune(challenges, sessions).await
    }
}

/// The host's proof for `issued`.
fn prove(secret: &[u8; 32], issued: &orca_push_auth::IssuedChallenge) -> [u8; 32] {
    let plaintext = hp::open(
        &issued.ciphertext,
        &issued.nonce,
        &issued.gateway_ephemeral_public_key,
        secret,
    )
    .expect("challenge opens with the host key");
    let (transcript, challenge_secret) =
        hp::parse_challenge_plaintext(&plaintext).expect("plaintext");
    hp::proof(&challenge_secret, transcript)
}

macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                super::$name(orca_push_storage::testing::Backend::Sqlite).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                super::$name(orca_push_storage::testing::Backend::Postgres).await;
            }
        }
    )*};
}

on_both_backends!(proofs_read_their_challenge_only_where_it_was_not_issued);

async fn proofs_read_their_challenge_only_where_it_was_not_issued(backend: Backend) {
    let (config, _db) = fresh(backend).await;
    let pool = open_and_migrate(&config).await.expect("open and migrate");
    let clock = ManualClock::new(T0);
    let replica = || {
        let store = Counted {
            store: AnyAuthStore::new(pool.clone()),
            challenge_reads: Arc::default(),
        };
        let auth = HostAuth::new(store.clone(), ORIGIN.to_owned(), Arc::new(clock.clone()));
        (auth, store)
    };
    let ((a, a_store), (b, b_store)) = (replica(), replica());
    let secret = [9u8; 32];
    let public = hp::public_key(&secret);

    // Back to the replica that issued it: no read, and the session stands.
    let issued = a.issue_challenge(&public).await.unwrap();
    let wrong = a.create_session(&issued.challenge_id, &[0; 32]).await;
    assert!(
        matches!(wrong, Err(AuthError::InvalidProof(_))),
        "{wrong:?}"
    );
    let proof = prove(&secret, &issued);
    let session = a
        .create_session(&issued.challenge_id, &proof)
        .await
        .unwrap();
    assert_eq!(a_store.reads(), 0, "the issuing replica read its challenge");
    a.authenticate(&session.token).await.unwrap();

    // A replay, there or elsewhere, reads the store and is refused.
    let replayed = a.create_session(&issued.challenge_id, &proof).await;
    assert!(
        matches!(replayed, Err(AuthError::InvalidProof(_))),
        "{replayed:?}"
    );
    let replayed = b.create_session(&issued.challenge_id, &proof).await;
    assert!(
        matches!(replayed, Err(AuthError::InvalidProof(_))),
        "{replayed:?}"
    );
    assert_eq!((a_store.reads(), b_store.reads()), (1, 1));

    // Proved at another replica: read from the store there; the issuer, which still holds it,
    // then fails at the redemption.
    let issued = a.issue_challenge(&public).await.unwrap();
    let proof = prove(&secret, &issued);
    b.create_session(&issued.challenge_id, &proof)
        .await
        .unwrap();
    assert_eq!(b_store.reads(), 2);
    let late = a.create_session(&issued.challenge_id, &proof).await;
    assert!(matches!(late, Err(AuthError::InvalidProof(_))), "{late:?}");
    assert_eq!(
        a_store.reads(),
        1,
        "held, so not read; refused by the redemption"
    );

    // Expired: read from the store, which tells expired from pruned.
    let issued = a.issue_challenge(&public).await.unwrap();
    clock.advance(hp::CHALLENGE_TTL_MS);
    let expired = a
        .create_session(&issued.challenge_id, &prove(&secret, &issued))
        .await;
    assert!(
        matches!(expired, Err(AuthError::InvalidProof(_))),
        "{expired:?}"
    );
    assert_eq!(a_store.reads(), 2);
}
