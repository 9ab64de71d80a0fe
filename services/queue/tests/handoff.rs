//! Work due at once goes straight to a waiting claim: the admission writes its batch already
//! leased and answers the claim once the group commits, with no claim transaction after it.

mod support;

use std::time::Duration;

use orca_push_queue::model::Provider;
use orca_push_queue::store::{Outcome, Skip};
use orca_push_storage::testing::Backend;
use support::*;

on_both_backends!(
    a_waiting_claim_is_handed_work_due_at_once,
    a_claim_is_not_handed_its_held_providers_work_nor_windows,
    orphans_given_back_from_a_thread_without_a_runtime_are_due_again,
);

/// Both backends hand off (`HANDS_OFF`; PostgreSQL since round 40). Kept as a switch so that a
/// backend that stops handing off is still checked to claim as before.
fn hands_off(backend: Backend) -> bool {
    matches!(backend, Backend::Sqlite | Backend::Postgres)
}

async fn a_waiting_claim_is_handed_work_due_at_once(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, LEASE, 5_000).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut first = alert(1, &["phone-1", "phone-2"]);
    first.trace_parent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    h.admit(&first).await;
    let claimed = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("answered at the admission's commit, not at the claim's wait")
        .unwrap()
        .unwrap();
    let mut phones: Vec<&str> = claimed.iter().map(|b| b.registration_id.as_str()).collect();
    phones.sort_unstable();
    assert_eq!(phones, vec!["phone-1", "phone-2"]);
    if hands_off(backend) {
        assert_eq!(h.queue.claim_transactions(), 0, "no claim transaction");
        assert_eq!(h.queue.handed_claims(), 1);
    } else {
        assert_eq!(h.queue.claim_transactions(), 1, "claimed as before");
        assert_eq!(h.queue.handed_claims(), 0);
    }
    let batch = &claimed[0];
    assert_eq!(batch.members.len(), 1);
    assert_eq!(batch.members[0].notification_seq, 1);
    assert_eq!(batch.members[0].content.title, "Task 1 done");
    assert_eq!(batch.members[0].trace_parent, first.trace_parent);
    assert_eq!(batch.lease_expires_at, T0 as i64 + LEASE);
    assert_eq!(batch.attempt, 1);
    // Stored under that lease: no other lane claims it, its lease renews, and it reports.
    assert!(h.claim_all().await.is_empty(), "leased, so nothing is due");
    assert!(
        h.queue
            .renew(&batch.batch_id, &batch.lease_token, LEASE)
            .await
            .unwrap()
            .is_some()
    );
    for b in &claimed {
        let done = h
            .queue
            .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "sent", true)
            .await
            .unwrap();
        assert!(done, "reported under the handed lease");
    }
    let record = h
        .queue
        .event_record(HOST, orca_push_queue::model::Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert!(record.recipients.iter().all(|r| r.status == "sent"));
    // A lane that went quiet lets its handed lease lapse like a claimed one: recovered then.
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, LEASE, 5_000).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.admit(&alert(2, &["phone-1"])).await;
    let lost = waiting.await.unwrap().unwrap();
    assert_eq!(lost.len(), 1);
    assert_eq!(
        h.queue.handed_claims(),
        if hands_off(backend) { 2 } else { 0 }
    );
    h.clock.advance(LEASE as u64);
    let recovered = h.claim_all().await;
    assert_eq!(recovered.len(), 1);
    assert_eq!(recovered[0].batch_id, lost[0].batch_id);
    assert!(recovered[0].recovered);
}

/// A claim that skips a held provider is not handed that provider's work, and a coalescing window
/// is not due at once: both stay for claims, as before.
async fn a_claim_is_not_handed_its_held_providers_work_nor_windows(backend: Backend) {
    let h = harness(backend).await;
    let queue = h.queue.clone();
    let apns_held = Skip::of([Provider::Apns]);
    let waiting = tokio::spawn(async move {
        queue
            .claim_skipping("lane-wait", 64, LEASE, 600, apns_held)
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut no_window = alert(1, &["phone-apns"]);
    no_window.content.notification_id = None;
    h.admit(&no_window).await;
    let mut windowed = alert(2, &["phone-fcm"]);
    windowed.recipients[0].provider = Provider::Fcm;
    h.admit(&windowed).await;
    assert!(waiting.await.unwrap().unwrap().is_empty());
    assert_eq!(h.queue.handed_claims(), 0);
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1, "the APNs alert is due, for a claim");
    assert_eq!(claimed[0].registration_id, "phone-apns");
    h.clock.advance(WINDOW);
    assert_eq!(h.claim_all().await.len(), 1, "the window, once it ends");
}

/// Orphans are handed back on the runtime the queue was built on, whatever thread gives them:
/// a group commits on the writer's own thread, whose runtime serves its rounds only.
async fn orphans_given_back_from_a_thread_without_a_runtime_are_due_again(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["phone-1"])).await;
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1);
    assert!(h.claim_all().await.is_empty(), "leased");
    let orphans = orca_push_queue::handoff::give_back(
        h.queue.store().clone(),
        std::sync::Arc::new(h.clock.clone()),
        h.wake.clone(),
    );
    std::thread::spawn(move || orphans(claimed))
        .join()
        .expect("given back from a thread with no runtime");
    let again = tokio::time::timeout(
        Duration::from_secs(5),
        h.queue.claim("lane-again", 64, LEASE, 5_000),
    )
    .await
    .expect("claimed within the wait")
    .unwrap();
    let phones: Vec<&str> = again.iter().map(|b| b.registration_id.as_str()).collect();
    assert_eq!(
        phones,
        ["phone-1"],
        "due again at once, not when the lease lapses"
    );
    assert_eq!(
        (again[0].attempt, again[0].recovered),
        (1, false),
        "untried"
    );
}

/// A hand-back that cannot wait for its hosts' locks (the operator's `lock_timeout` ends every
/// wait while another session holds them) still gives back on its last try, rather than leave
/// the batch leased to no lane until its lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hand_back_that_cannot_wait_for_its_hosts_gives_back_on_its_last_try_postgres() {
    use orca_push_storage::DatabaseConfig;
    use sqlx::Connection as _;

    let (_, guard, url) = fresh_postgres().await;
    let impatient = DatabaseConfig::Postgres {
        url: format!("{url}?options=-c%20lock_timeout%3D100").into(),
    };
    let h = harness_on(impatient, guard, 0).await;
    h.admit(&alert(1, &["phone-1"])).await;
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1);
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(hashtextextended('push_events:' || $1, 0))")
        .bind(HOST)
        .execute(&mut holder)
        .await
        .unwrap();
    let now = i64::try_from(T0).unwrap();
    orca_push_queue::handoff::hand_back(h.queue.store(), &h.wake, &claimed, now).await;
    holder.close().await.unwrap();
    let phones: Vec<String> = h
        .claim_all()
        .await
        .into_iter()
        .map(|b| b.registration_id)
        .collect();
    assert_eq!(phones, ["phone-1"], "given back, due again at once");
}

/// A round whose `COMMIT` reaches PostgreSQL only after its connection failed on the gateway's
/// side (the answer lost, the commit still under way when the writer hears of the failure) gives
/// back what it handed to a waiting claim once the commit has ended: the batch is due again at
/// once, not leased to no lane until its lease lapses (on the manual clock, never in this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_whose_answer_is_lost_gives_back_what_it_handed_postgres() {
    use orca_push_queue::model::AdmissionStatus;

    let (h, cutter) = harness_behind_a_commit_cutter().await;
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, LEASE, 10_000).await });
    for _ in 0..100 {
        if h.queue.waiting_claims() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        h.queue.waiting_claims(),
        1,
        "the lane waits to be handed work"
    );
    cutter.arm();
    let statuses = h.admit(&alert(1, &["phone-1"])).await;
    assert_eq!(
        statuses,
        [AdmissionStatus::Queued],
        "admitted again, found stored"
    );
    assert_eq!(
        cutter.cuts(),
        1,
        "the round's commit was answered to no one"
    );
    assert_eq!(
        h.queue.given_back_batches(),
        1,
        "the handed batch was given back"
    );
    let claimed = tokio::time::timeout(Duration::from_secs(8), waiting)
        .await
        .expect("the claim ends within its wait")
        .unwrap()
        .unwrap();
    let phones: Vec<&str> = claimed.iter().map(|b| b.registration_id.as_str()).collect();
    assert_eq!(phones, ["phone-1"], "given back, due again at once");
    assert_eq!(claimed[0].members.len(), 1);
    assert_eq!(
        h.queue.handed_claims(),
        0,
        "the hand-off never reached the lane"
    );
    let record = h
        .queue
        .event_record(HOST, orca_push_queue::model::Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients.len(), 1, "stored once");
}

/// A claim's own `COMMIT` (PostgreSQL: a claim runs in a transaction of its own) that reaches the
/// server only after the connection failed: the lane hears an error and will never send what the
/// claim leased, so the batch is given back, due again at once, rather than leased to no lane
/// until its lease lapses (on the manual clock, never in this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_whose_commit_answer_is_lost_gives_back_what_it_leased_postgres() {
    let (h, cutter) = harness_behind_a_commit_cutter().await;
    h.admit(&alert(1, &["phone-1"])).await;
    cutter.arm();
    let answer = h.queue.claim("lane-a", 64, LEASE, 0).await;
    assert!(answer.is_err(), "the lane heard a failure: {answer:?}");
    assert_eq!(
        cutter.cuts(),
        1,
        "the claim's commit was answered to no one"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    let claimed = loop {
        let claimed = h.queue.claim("lane-b", 64, LEASE, 1_000).await.unwrap();
        if !claimed.is_empty() {
            break claimed;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the batch stays leased to a lane that never heard of it"
        );
    };
    let phones: Vec<&str> = claimed.iter().map(|b| b.registration_id.as_str()).collect();
    assert_eq!(phones, ["phone-1"], "given back, due again at once");
}

/// A hand-back that waits for a claim's rows (a transaction whose client is gone can hold them for
/// long) holds none of the hosts' locks meanwhile: the host's admissions go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hand_back_waiting_for_a_claims_rows_keeps_no_admission_waiting_postgres() {
    use sqlx::Connection as _;

    let (config, guard, url) = fresh_postgres().await;
    let h = harness_on(config.clone(), guard, 0).await;
    h.admit(&alert(1, &["phone-1"])).await;
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1);
    // A claim's transaction still open on the server, its row locked.
    let mut zombie = sqlx::PgConnection::connect(&url).await.unwrap();
    let schema = orca_push_queue::STORAGE.postgres_schema;
    sqlx::query(&format!("SET search_path TO {schema}"))
        .execute(&mut zombie)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut zombie).await.unwrap();
    sqlx::query("SELECT 1 FROM push_delivery_batches WHERE batch_id = $1 FOR UPDATE")
        .bind(&claimed[0].batch_id)
        .execute(&mut zombie)
        .await
        .unwrap();
    let giving = {
        let queue = h.queue.clone();
        let wake = h.wake.clone();
        let claimed = claimed.clone();
        tokio::spawn(async move {
            let now = i64::try_from(T0).unwrap();
            orca_push_queue::handoff::hand_back(queue.store(), &wake, &claimed, now).await;
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let admitted = tokio::time::timeout(Duration::from_secs(5), h.admit(&alert(2, &["phone-2"])))
        .await
        .expect("the host's admission waited for the hand-back");
    assert_eq!(admitted, [orca_push_queue::model::AdmissionStatus::Queued]);
    sqlx::query("ROLLBACK").execute(&mut zombie).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), giving)
        .await
        .expect("the hand-back ends once the rows are free")
        .unwrap();
    let phones: Vec<String> = h
        .claim_all()
        .await
        .into_iter()
        .map(|b| b.registration_id)
        .collect();
    assert!(phones.contains(&"phone-1".to_owned()), "{phones:?}");
}

/// A fresh PostgreSQL database: its configuration, its guard and its URL.
async fn fresh_postgres() -> (
    orca_push_storage::DatabaseConfig,
    orca_push_storage::testing::TestDbGuard,
    String,
) {
    use secrecy::ExposeSecret as _;
    let (config, guard) = orca_push_storage::testing::fresh(Backend::Postgres).await;
    let orca_push_storage::DatabaseConfig::Postgres { url } = &config else {
        unreachable!("a PostgreSQL database")
    };
    let url = url.expose_secret().to_owned();
    (config, guard, url)
}

/// A queue on a fresh PostgreSQL database, reached through a [`CommitCutter`] (not yet armed).
async fn harness_behind_a_commit_cutter() -> (Harness, CommitCutter) {
    use orca_push_storage::DatabaseConfig;

    let (_, guard, url) = fresh_postgres().await;
    let cutter = CommitCutter::start(&url).await;
    let proxied = DatabaseConfig::Postgres {
        url: cutter.url.clone().into(),
    };
    (harness_on(proxied, guard, 0).await, cutter)
}

/// A TCP proxy in front of PostgreSQL that, once armed, cuts the connection of the next client
/// to send a `COMMIT`: it closes the client's side at once, sends the `COMMIT` on to the server
/// `COMMIT_LATE` later, and waits for the server's word that it committed, which it keeps. The
/// commit stands, and its client heard only a broken connection, before the server had begun it.
struct CommitCutter {
    url: String,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cuts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// A simple-protocol `COMMIT` (sqlx's), and the server's `CommandComplete` for it.
const COMMIT_QUERY: &[u8] = b"Q\0\0\0\x0bCOMMIT\0";
const COMMITTED: &[u8] = b"C\0\0\0\x0bCOMMIT\0";
const COMMIT_LATE: Duration = Duration::from_millis(300);

impl CommitCutter {
    /// A proxy for `url` (`postgres://user@host:port/db`); `self.url` reaches the same database
    /// through it.
    async fn start(url: &str) -> Self {
        let (head, tail) = url.rsplit_once('@').expect("a URL with a user");
        let (address, database) = tail.split_once('/').expect("a URL with a database");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cutter = Self {
            url: format!("{head}@127.0.0.1:{port}/{database}"),
            armed: Default::default(),
            cuts: Default::default(),
        };
        let (armed, cuts) = (cutter.armed.clone(), cutter.cuts.clone());
        let upstream = address.to_owned();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(pipe(client, server, armed.clone(), cuts.clone()));
            }
        });
        cutter
    }

    fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn cuts(&self) -> usize {
        self.cuts.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn pipe(
    mut client: tokio::net::TcpStream,
    mut server: tokio::net::TcpStream,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cuts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let holds = |bytes: &[u8], part: &[u8]| bytes.windows(part.len()).any(|w| w == part);
    let (mut up, mut down) = (vec![0_u8; 65_536], vec![0_u8; 65_536]);
    loop {
        tokio::select! {
            read = client.read(&mut up) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                if holds(&up[..n], COMMIT_QUERY)
                    && armed.swap(false, std::sync::atomic::Ordering::SeqCst)
                {
                    drop(client);
                    cuts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(COMMIT_LATE).await;
                    if server.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                    let mut heard = Vec::new();
                    while !holds(&heard, COMMITTED) {
                        let read = tokio::time::timeout(
                            Duration::from_secs(5),
                            server.read(&mut down),
                        )
                        .await;
                        match read {
                            Ok(Ok(n)) if n > 0 => heard.extend_from_slice(&down[..n]),
                            _ => return,
                        }
                    }
                    return;
                }
                if server.write_all(&up[..n]).await.is_err() {
                    return;
                }
            }
            read = server.read(&mut down) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                if client.write_all(&down[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}
