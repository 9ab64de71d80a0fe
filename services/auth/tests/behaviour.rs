//! The auth service's behaviour, run unchanged against SQLite and PostgreSQL, with a manual clock.

use std::sync::Arc;

use orca_push_auth::{AnyAuthStore, AuthError, HostAuth, SESSION_TTL_MS, open_and_migrate};
use orca_push_host_proof as hp;
use orca_push_storage::ManualClock;
use orca_push_storage::testing::{Backend, TestDbGuard, fresh};

const ORIGIN: &str = "https://push.example.test";
const T0: u64 = 1_800_000_000_000;

struct Harness {
    auth: Arc<HostAuth<AnyAuthStore>>,
    clock: ManualClock,
    /// The store's own pool, for what a test reads in the database's own terms.
    pool: orca_push_storage::Pool,
    _db: TestDbGuard,
}

async fn harness(backend: Backend) -> Harness {
    let (config, guard) = fresh(backend).await;
    let pool = open_and_migrate(&config).await.expect("open and migrate");
    let clock = ManualClock::new(T0);
    let auth = HostAuth::new(
        AnyAuthStore::new(pool.clone()),
        ORIGIN.to_owned(),
        Arc::new(clock.clone()),
    );
    Harness {
        auth: Arc::new(auth),
        clock,
        pool,
        _db: guard,
    }
}

struct Host {
    secret: [u8; 32],
    public: [u8; 32],
}

impl Host {
    fn new(seed: u8) -> Self {
        let secret = [seed; 32];
        Self {
            secret,
            public: hp::public_key(&secret),
        }
    }

    fn fingerprint(&self) -> String {
        hp::host_fingerprint(&self.public)
    }

    /// Answers a challenge the way a host does, returning the proof and the decoded transcript.
    fn answer(&self, c: &orca_push_auth::IssuedChallenge) -> ([u8; 32], hp::Transcript) {
        let plaintext = hp::open(
            &c.ciphertext,
            &c.nonce,
            &c.gateway_ephemeral_public_key,
            &self.secret,
        )
        .expect("challenge opens with the host key");
        let (transcript, secret) = hp::parse_challenge_plaintext(&plaintext).expect("plaintext");
        let decoded = hp::Transcript::decode(transcript).expect("transcript");
        (hp::proof(&secret, transcript), decoded.transcript)
    }
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

on_both_backends!(
    challenge_transcript_binds_every_field,
    proof_mints_a_session_and_the_bearer_resolves,
    wrong_proof_is_refused_without_consuming_the_challenge,
    replayed_proof_is_refused,
    ttl_is_ten_seconds_and_not_a_millisecond_more,
    expired_challenges_read_as_expired_until_pruned_30s_late,
    racing_proofs_mint_exactly_one_session,
    a_new_session_replaces_the_hosts_old_one,
    racing_logins_of_one_host_leave_one_session,
    expired_session_answers_session_expired,
    last_seen_is_refreshed_at_most_once_a_minute,
    malformed_inputs_are_invalid_requests,
    idle_hosts_without_devices_are_pruned_after_an_hour,
    hosts_kept_for_their_devices_never_hide_the_ones_to_prune,
);

async fn challenge_transcript_binds_every_field(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let issued = h.auth.issue_challenge(&host.public).await.unwrap();
    let (_, t) = host.answer(&issued);
    assert_eq!(t.gateway_origin, ORIGIN);
    assert_eq!(
        t.gateway_ephemeral_public_key,
        issued.gateway_ephemeral_public_key
    );
    assert_eq!(t.challenge_nonce, issued.nonce);
    assert_eq!(t.challenge_id, issued.challenge_id);
    assert_eq!(t.issued_at_ms, T0);
    assert_eq!(t.expires_at_ms, T0 + 10_000);
    assert_eq!(issued.expires_at_ms, T0 + 10_000);
    assert_eq!(t.host_fingerprint, host.fingerprint());
    assert_eq!(t.host_public_key, host.public);
    // Issuing a challenge writes no host row.
    assert_eq!(
        h.auth
            .store()
            .host_last_seen_for_test(&host.fingerprint())
            .await,
        None
    );
    // Each challenge has its own ephemeral key, nonce and id.
    let again = h.auth.issue_challenge(&host.public).await.unwrap();
    assert_ne!(again.challenge_id, issued.challenge_id);
    assert_ne!(again.nonce, issued.nonce);
    assert_ne!(
        again.gateway_ephemeral_public_key,
        issued.gateway_ephemeral_public_key
    );
}

async fn proof_mints_a_session_and_the_bearer_resolves(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let issued = h.auth.issue_challenge(&host.public).await.unwrap();
    let (proof, _) = host.answer(&issued);
    h.clock.advance(1_000);
    let session = h
        .auth
        .create_session(&issued.challenge_id, &proof)
        .await
        .unwrap();
    assert_eq!(session.token.len(), 43);
    assert!(
        session
            .token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    );
    assert_eq!(session.host_fingerprint, host.fingerprint());
    assert_eq!(session.expires_at_ms, T0 + 1_000 + SESSION_TTL_MS);
    let who = h.auth.authenticate(&session.token).await.unwrap();
    assert_eq!(who.host_fingerprint, host.fingerprint());
    assert_eq!(
        h.auth
            .store()
            .host_last_seen_for_test(&host.fingerprint())
            .await,
        Some(T0 + 1_000)
    );
}

async fn wrong_proof_is_refused_without_consuming_the_challenge(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let issued = h.auth.issue_challenge(&host.public).await.unwrap();
    let (proof, _) = host.answer(&issued);
    let mut wrong = proof;
    wrong[0] ^= 1;
    let err = h
        .auth
        .create_session(&issued.challenge_id, &wrong)
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidProof(_)), "{err:?}");
    // A proof from another host's key does not open this challenge either.
    let other = Host::new(8);
    let other_issued = h.auth.issue_challenge(&other.public).await.unwrap();
    let (other_proof, _) = other.answer(&other_issued);
    let err = h
        .auth
        .create_session(&issued.challenge_id, &other_proof)
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidProof(_)), "{err:?}");
    h.auth
        .create_session(&issued.challenge_id, &proof)
        .await
        .expect("still usable");
}

async fn replayed_proof_is_refused(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let issued = h.auth.issue_challenge(&host.public).await.unwrap();
    let (proof, _) = host.answer(&issued);
    h.auth
        .create_session(&issued.challenge_id, &proof)
        .await
        .unwrap();
    let err = h
        .auth
        .create_session(&issued.challenge_id, &proof)
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidProof(_)), "{err:?}");
}

async fn ttl_is_ten_seconds_and_not_a_millisecond_more(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let on_time = h.auth.issue_challenge(&host.public).await.unwrap();
    let late = h.auth.issue_challenge(&host.public).await.unwrap();
    h.clock.advance(9_999);
    let (proof, _) = host.answer(&on_time);
    h.auth
        .create_session(&on_time.challenge_id, &proof)
        .await
        .expect("at 9.999 s");
    h.clock.advance(1);
    let (proof, _) = host.answer(&late);
    let err = h
        .auth
        .create_session(&late.challenge_id, &proof)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AuthError::InvalidProof(_)),
        "at 10.000 s: {err:?}"
    );
}

async fn expired_challenges_read_as_expired_until_pruned_30s_late(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let issued = h.auth.issue_challenge(&host.public).await.unwrap();
    let (proof, _) = host.answer(&issued);
    h.clock.set(issued.expires_at_ms + 30_000);
    h.auth.prune().await.unwrap();
    let err = h
        .auth
        .create_session(&issued.challenge_id, &proof)
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidProof(_)), "{err:?}");
    h.clock.advance(1);
    h.auth.prune().await.unwrap();
    let err = h
        .auth
        .create_session(&issued.challenge_id, &proof)
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidChallenge), "{err:?}");
    let err = h
        .auth
        .create_session("no-such-challenge", &proof)
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidChallenge), "{err:?}");
}

async fn racing_proofs_mint_exactly_one_session(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let issued = h.auth.issue_challenge(&host.public).await.unwrap();
    let (proof, _) = host.answer(&issued);
    let attempts = (0..16).map(|_| {
        let auth = h.auth.clone();
        let id = issued.challenge_id.clone();
        tokio::spawn(async move { auth.create_session(&id, &proof).await })
    });
    let results = futures::future::join_all(attempts).await;
    let mut sessions = Vec::new();
    for result in results {
        match result.unwrap() {
            Ok(session) => sessions.push(session),
            Err(AuthError::InvalidProof(_)) => {}
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(sessions.len(), 1, "exactly one racing proof wins");
    h.auth.authenticate(&sessions[0].token).await.unwrap();
}

async fn login(h: &Harness, host: &Host) -> orca_push_auth::Session {
    let issued = h.auth.issue_challenge(&host.public).await.unwrap();
    let (proof, _) = host.answer(&issued);
    h.auth
        .create_session(&issued.challenge_id, &proof)
        .await
        .unwrap()
}

async fn a_new_session_replaces_the_hosts_old_one(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let other = Host::new(9);
    let first = login(&h, &host).await;
    let others = login(&h, &other).await;
    let second = login(&h, &host).await;
    assert!(matches!(
        h.auth.authenticate(&first.token).await,
        Err(AuthError::InvalidToken)
    ));
    assert_eq!(
        h.auth
            .authenticate(&second.token)
            .await
            .unwrap()
            .host_fingerprint,
        host.fingerprint()
    );
    // Another host's session is untouched.
    assert_eq!(
        h.auth
            .authenticate(&others.token)
            .await
            .unwrap()
            .host_fingerprint,
        other.fingerprint()
    );
}

async fn racing_logins_of_one_host_leave_one_session(backend: Backend) {
    let h = harness(backend).await;
    let host = Arc::new(Host::new(7));
    let mut answered = Vec::new();
    for _ in 0..8 {
        let issued = h.auth.issue_challenge(&host.public).await.unwrap();
        let (proof, _) = host.answer(&issued);
        answered.push((issued.challenge_id, proof));
    }
    let logins = answered.into_iter().map(|(id, proof)| {
        let auth = h.auth.clone();
        tokio::spawn(async move { auth.create_session(&id, &proof).await })
    });
    let sessions: Vec<_> = futures::future::join_all(logins)
        .await
        .into_iter()
        .map(|r| r.unwrap().expect("every login succeeds"))
        .collect();
    let mut valid = 0;
    for session in &sessions {
        if h.auth.authenticate(&session.token).await.is_ok() {
            valid += 1;
        }
    }
    assert_eq!(valid, 1, "one session per host survives a race");
}

async fn expired_session_answers_session_expired(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let session = login(&h, &host).await;
    h.clock.set(session.expires_at_ms - 1);
    h.auth
        .authenticate(&session.token)
        .await
        .expect("valid until the last millisecond");
    h.clock.set(session.expires_at_ms);
    assert!(matches!(
        h.auth.authenticate(&session.token).await,
        Err(AuthError::SessionExpired)
    ));
    // Still recognised as expired (not unknown) through a day of pruning grace.
    h.clock.advance(23 * 60 * 60 * 1000);
    h.auth.prune().await.unwrap();
    assert!(matches!(
        h.auth.authenticate(&session.token).await,
        Err(AuthError::SessionExpired)
    ));
}

async fn last_seen_is_refreshed_at_most_once_a_minute(backend: Backend) {
    let h = harness(backend).await;
    let host = Host::new(7);
    let session = login(&h, &host).await;
    let fp = host.fingerprint();
    h.clock.advance(59_999);
    h.auth.authenticate(&session.token).await.unwrap();
    assert_eq!(h.auth.store().host_last_seen_for_test(&fp).await, Some(T0));
    h.clock.advance(1);
    h.auth.authenticate(&session.token).await.unwrap();
    assert_eq!(
        h.auth.store().host_last_seen_for_test(&fp).await,
        Some(T0 + 60_000)
    );
}

async fn malformed_inputs_are_invalid_requests(backend: Backend) {
    let h = harness(backend).await;
    let err = h.auth.issue_challenge(&[1u8; 31]).await.unwrap_err();
    assert!(matches!(err, AuthError::InvalidRequest(_)), "{err:?}");
    // Keys of small order: the challenge would be open to anyone.
    let mut one = [0u8; 32];
    one[0] = 1;
    for key in [[0u8; 32], one] {
        let err = h.auth.issue_challenge(&key).await.unwrap_err();
        assert!(matches!(err, AuthError::InvalidRequest(_)), "{err:?}");
    }
    let err = h.auth.create_session("", &[0u8; 32]).await.unwrap_err();
    assert!(matches!(err, AuthError::InvalidRequest(_)), "{err:?}");
    let err = h
        .auth
        .create_session(&"x".repeat(129), &[0u8; 32])
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidRequest(_)), "{err:?}");
    // NUL never reaches SQL (PostgreSQL would fail the query rather than find nothing).
    let issued = h.auth.issue_challenge(&[7u8; 32]).await.unwrap();
    let with_nul = format!("{}\0", issued.challenge_id);
    let err = h
        .auth
        .create_session(&with_nul, &[0u8; 32])
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::InvalidRequest(_)), "{err:?}");
    let err = h.auth.create_session("id", &[0u8; 31]).await.unwrap_err();
    assert!(matches!(err, AuthError::InvalidRequest(_)), "{err:?}");
    for token in [
        "",
        "short",
        &"a".repeat(44),
        &format!("{}!", "a".repeat(42)),
    ] {
        assert!(
            matches!(
                h.auth.authenticate(token).await,
                Err(AuthError::InvalidToken)
            ),
            "{token}"
        );
    }
    // Well-formed but unknown.
    assert!(matches!(
        h.auth.authenticate(&"A".repeat(43)).await,
        Err(AuthError::InvalidToken)
    ));
}

trait LastSeen {
    async fn host_last_seen_for_test(&self, fp: &str) -> Option<u64>;
}

impl LastSeen for AnyAuthStore {
    async fn host_last_seen_for_test(&self, fp: &str) -> Option<u64> {
        use orca_push_auth::AuthStore as _;
        self.host_last_seen(fp).await.expect("read host")
    }
}

/// The registry as auth sees it: these hosts still have registrations.
struct Directory(Vec<String>);

impl orca_push_auth::DeviceDirectory for Directory {
    async fn hosts_still_registered(
        &self,
        hosts: Vec<String>,
    ) -> Result<Vec<String>, tonic::Status> {
        Ok(hosts.into_iter().filter(|h| self.0.contains(h)).collect())
    }
}

async fn idle_hosts_without_devices_are_pruned_after_an_hour(backend: Backend) {
    let h = harness(backend).await;
    let idle = Host::new(1);
    let with_devices = Host::new(2);
    let recent = Host::new(3);
    login(&h, &idle).await;
    login(&h, &with_devices).await;
    h.clock.advance(orca_push_auth::HOST_IDLE_MS - 1);
    let recent_session = login(&h, &recent).await;
    let directory = Directory(vec![with_devices.fingerprint()]);
    // Not yet an hour for anyone.
    assert_eq!(h.auth.prune_hosts(&directory).await.unwrap(), 0);
    h.clock.advance(1);
    assert_eq!(h.auth.prune_hosts(&directory).await.unwrap(), 1);
    let seen = |fp: String| {
        let auth = h.auth.clone();
        async move { auth.store().host_last_seen_for_test(&fp).await }
    };
    assert_eq!(seen(idle.fingerprint()).await, None);
    assert!(seen(with_devices.fingerprint()).await.is_some());
    assert!(seen(recent.fingerprint()).await.is_some());
    // A recent host stays while it keeps in touch.
    h.clock.advance(orca_push_auth::HOST_IDLE_MS - 2);
    h.auth.authenticate(&recent_session.token).await.unwrap();
    h.clock.advance(2);
    assert_eq!(h.auth.prune_hosts(&directory).await.unwrap(), 0);
}

/// Keeps every host but one.
struct KeepAllBut(String);

impl orca_push_auth::DeviceDirectory for KeepAllBut {
    async fn hosts_still_registered(
        &self,
        hosts: Vec<String>,
    ) -> Result<Vec<String>, tonic::Status> {
        Ok(hosts.into_iter().filter(|h| *h != self.0).collect())
    }
}

/// The host that sorts last in the database's own order (PostgreSQL's collation may not be byte
/// order): the pruner pages through hosts in that order.
async fn last_host(pool: &orca_push_storage::Pool) -> String {
    const LAST: &str =
        "SELECT host_fingerprint FROM push_hosts ORDER BY host_fingerprint DESC LIMIT 1";
    match pool {
        orca_push_storage::Pool::Sqlite(p) => sqlx::query_scalar(LAST).fetch_one(p).await,
        orca_push_storage::Pool::Postgres(p) => sqlx::query_scalar(LAST).fetch_one(p).await,
    }
    .unwrap()
}

async fn hosts_kept_for_their_devices_never_hide_the_ones_to_prune(backend: Backend) {
    let h = harness(backend).await;
    // More than one page (500) of hosts.
    let hosts: Vec<Host> = (0..520u16)
        .map(|i| {
            let mut secret = [1u8; 32];
            secret[..2].copy_from_slice(&i.to_be_bytes());
            Host {
                secret,
                public: hp::public_key(&secret),
            }
        })
        .collect();
    for host in &hosts {
        login(&h, host).await;
    }
    // The one host without devices sorts last, behind a full page of hosts that are kept.
    let doomed = last_host(&h.pool).await;
    assert!(hosts.iter().any(|host| host.fingerprint() == doomed));
    h.clock.advance(orca_push_auth::HOST_IDLE_MS);
    assert_eq!(
        h.auth
            .prune_hosts(&KeepAllBut(doomed.clone()))
            .await
            .unwrap(),
        1
    );
    assert_eq!(h.auth.store().host_last_seen_for_test(&doomed).await, None);
}
