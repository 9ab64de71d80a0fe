//! The session watch's news: on SQLite this process announces what it mints; on PostgreSQL a
//! replica hears the sessions another replica mints, through the database, and heartbeats that
//! follow them.

use std::sync::Arc;
use std::time::Duration;

use orca_push_auth::{
    Announcer, AnyAuthStore, HostAuth, SessionNews, open_and_migrate, session_watch,
};
use orca_push_host_proof as hp;
use orca_push_storage::ManualClock;
use orca_push_storage::testing::{Backend, fresh};
use tokio::sync::broadcast::Receiver;
use tokio_util::sync::CancellationToken;

const ORIGIN: &str = "https://push.example.test";
const T0: u64 = 1_800_000_000_000;

fn replica(store: AnyAuthStore, announcer: Announcer) -> Arc<HostAuth<AnyAuthStore>> {
    let clock = Arc::new(ManualClock::new(T0));
    Arc::new(HostAuth::new(store, ORIGIN.to_owned(), clock).with_session_watch(announcer))
}

/// Logs a host in through `auth`, as a host does.
async fn log_in(auth: &HostAuth<AnyAuthStore>, seed: u8) -> String {
    let (challenge_id, proof, host) = prove(auth, seed).await;
    auth.create_session(&challenge_id, &proof).await.unwrap();
    host
}

/// A challenge for the host of `seed` and its proof, not yet presented; and the host.
async fn prove(auth: &HostAuth<AnyAuthStore>, seed: u8) -> (String, Vec<u8>, String) {
    let secret = [seed; 32];
    let public = hp::public_key(&secret);
    let issued = auth.issue_challenge(&public).await.unwrap();
    let plaintext = hp::open(
        &issued.ciphertext,
        &issued.nonce,
        &issued.gateway_ephemeral_public_key,
        &secret,
    )
    .unwrap();
    let (transcript, challenge_secret) = hp::parse_challenge_plaintext(&plaintext).unwrap();
    let proof = hp::proof(&challenge_secret, transcript);
    (
        issued.challenge_id,
        proof.to_vec(),
        hp::host_fingerprint(&public),
    )
}

/// A login whose caller goes away while its session waits to commit (a host that hung up, a
/// deadline) still replaces the host's session once the commit goes through: that replacement
/// is announced, or the facades would keep trusting the replaced bearer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_whose_caller_left_mid_commit_is_still_announced() {
    let (config, _guard) = fresh(Backend::Sqlite).await;
    let (auth, shutdown) = announcing_on_sqlite(&config).await;
    let host = log_in(&auth, 3).await;
    let mut news = auth.watch_sessions().unwrap();
    let (challenge_id, proof, _) = prove(&auth, 3).await;
    // Another connection holds the file's write lock: the login's commit waits behind it.
    let orca_push_storage::Pool::Sqlite(other) =
        orca_push_storage::open(&config, &orca_push_auth::STORAGE)
            .await
            .unwrap()
    else {
        unreachable!("a SQLite configuration opens SQLite")
    };
    let mut blocker = other.acquire().await.unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let login = {
        let auth = auth.clone();
        tokio::spawn(async move { auth.create_session(&challenge_id, &proof).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    login.abort();
    assert!(login.await.unwrap_err().is_cancelled());
    sqlx::query("COMMIT").execute(&mut *blocker).await.unwrap();
    assert_eq!(
        next_replacement(&mut news).await,
        SessionNews::Replaced(host)
    );
    shutdown.cancel();
}

/// Auth on the SQLite database of `config`, announcing what it mints, its heartbeat running
/// until the token is cancelled.
async fn announcing_on_sqlite(
    config: &orca_push_storage::DatabaseConfig,
) -> (Arc<HostAuth<AnyAuthStore>>, CancellationToken) {
    let auth = replica(
        AnyAuthStore::new(open_and_migrate(config).await.unwrap()),
        Announcer::ThisProcess,
    );
    let shutdown = CancellationToken::new();
    tokio::spawn(session_watch::heartbeat(
        auth.session_news().unwrap(),
        shutdown.clone(),
    ));
    (auth, shutdown)
}

/// The next news other than a heartbeat, waiting at most 5 s.
async fn next_replacement(news: &mut Receiver<SessionNews>) -> SessionNews {
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match news.recv().await.unwrap() {
                SessionNews::Heard => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("no session news within 5 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_this_process_announces_the_sessions_it_mints() {
    let (config, _guard) = fresh(Backend::Sqlite).await;
    let (auth, shutdown) = announcing_on_sqlite(&config).await;
    let mut news = auth.watch_sessions().unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(1), news.recv()).await;
    assert_eq!(heard.unwrap().unwrap(), SessionNews::Heard);
    let host = log_in(&auth, 3).await;
    assert_eq!(
        next_replacement(&mut news).await,
        SessionNews::Replaced(host)
    );
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_replica_hears_the_sessions_another_mints() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let pool = open_and_migrate(&config).await.unwrap();
    let (watched, minting) = (
        replica(AnyAuthStore::new(pool.clone()), Announcer::TheStore),
        replica(AnyAuthStore::new(pool.clone()), Announcer::TheStore),
    );
    let AnyAuthStore::Postgres(store) = AnyAuthStore::new(pool) else {
        unreachable!("a PostgreSQL pool")
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(session_watch::relay(
        store,
        watched.session_news().unwrap(),
        shutdown.clone(),
    ));
    let mut news = watched.watch_sessions().unwrap();
    // Heartbeats come through the database once the relay listens.
    let heard = tokio::time::timeout(Duration::from_secs(5), news.recv()).await;
    assert_eq!(heard.unwrap().unwrap(), SessionNews::Heard);

    let host = log_in(&minting, 4).await;
    assert_eq!(
        next_replacement(&mut news).await,
        SessionNews::Replaced(host),
        "the other replica's session was not heard"
    );
    // The minting replica does not announce it a second time itself.
    let mut minted_news = minting.watch_sessions().unwrap();
    log_in(&minting, 5).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), minted_news.recv())
            .await
            .is_err(),
        "nothing relays to the minting replica's own watchers here"
    );
    shutdown.cancel();
}
