//! Two queue replicas on one PostgreSQL database, as split mode runs them: they share windows, and
//! a lane waiting on one replica is woken by work another replica admits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use orca_push_queue::model::{Admission, AdmissionRecipient, Content, Kind, Provider, delivery_of};
use orca_push_queue::{AnyQueueStore, DeliveryQueue, delivery_queue, open_and_migrate};
use orca_push_storage::testing::{Backend, fresh};
use orca_push_storage::{DatabaseConfig, SystemClock};
use tokio_util::sync::CancellationToken;

fn alert(seq: i64, registration: &str) -> Admission {
    Admission {
        host_fingerprint: "hostAAAAAAAAAAAA".into(),
        kind: Kind::Alert,
        notification_epoch: "epoch".into(),
        notification_seq: seq,
        content: Content {
            notification_id: Some(format!("n-{seq}")),
            source: "plugin".into(),
            agent_state: None,
            title: "t".into(),
            body: "b".into(),
            worktree_id: None,
        },
        expires_at_ms: None,
        recipients: vec![AdmissionRecipient {
            registration_id: registration.into(),
            silent: false,
            provider: Provider::Fcm,
        }],
        trace_parent: None,
    }
}

/// Waits until `done` holds, for at most `seconds`.
async fn eventually(seconds: u64, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while !done() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A replica: its own pool and process-local waker, on the shared database.
async fn replica(
    config: &DatabaseConfig,
    window_ms: u64,
    shutdown: &CancellationToken,
) -> Arc<DeliveryQueue<AnyQueueStore>> {
    let pool = open_and_migrate(config).await.unwrap();
    delivery_queue(pool, Arc::new(SystemClock), window_ms, shutdown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_receiving_halves_of_a_burst_produce_one_summary() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let shutdown = CancellationToken::new();
    let a = replica(&config, 1_000, &shutdown).await;
    let b = replica(&config, 1_000, &shutdown).await;
    let sends = (0..10).map(|seq| {
        let queue = if seq % 2 == 0 { a.clone() } else { b.clone() };
        tokio::spawn(async move { queue.enqueue(&alert(seq, "phone")).await.unwrap() })
    });
    futures::future::join_all(sends).await;
    // Either replica may hand it out, once the window ends.
    let claimed = b.claim("lane", 64, 30_000, 5_000).await.unwrap();
    assert_eq!(claimed.len(), 1, "one batch for the burst");
    let summary = delivery_of("hostAAAAAAAAAAAA", &claimed[0].members).unwrap();
    assert_eq!(summary.coalesced_count, 10);
    assert_eq!(summary.body, "10 updates");
    assert!(a.claim("lane", 64, 30_000, 0).await.unwrap().is_empty());
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_lane_is_handed_due_work_from_another_replica_at_once() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let shutdown = CancellationToken::new();
    let admitting = replica(&config, 0, &shutdown).await;
    let delivering = replica(&config, 0, &shutdown).await;
    // Let the listener connect before measuring.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut handoffs = Vec::new();
    for seq in 0..40 {
        let lane = {
            let delivering = delivering.clone();
            tokio::spawn(async move {
                let claimed = delivering.claim("lane", 1, 30_000, 10_000).await.unwrap();
                (Instant::now(), claimed)
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        admitting.enqueue(&alert(seq, "phone")).await.unwrap();
        let admitted = Instant::now();
        let (claimed_at, claimed) = lane.await.unwrap();
        assert_eq!(claimed.len(), 1, "woken, not timed out");
        handoffs.push(claimed_at.saturating_duration_since(admitted));
        let batch = &claimed[0];
        delivering
            .complete(
                &batch.batch_id,
                &batch.lease_token,
                orca_push_queue::store::Outcome::Sent,
                "200",
                true,
            )
            .await
            .unwrap();
    }
    handoffs.sort();
    let p99 = handoffs[handoffs.len() * 99 / 100 - 1];
    println!(
        "cross-replica hand-off: p50 {:?}, p99 {:?}, max {:?}",
        handoffs[handoffs.len() / 2],
        p99,
        handoffs.last().unwrap()
    );
    // The lane would otherwise sleep 10 s: any hand-off well under that was a wake-up, not a poll.
    assert!(*handoffs.last().unwrap() < Duration::from_secs(2));
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_waits_for_the_window_without_polling_and_takes_the_batch_when_due() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let (config, _guard) = fresh(backend).await;
        let shutdown = CancellationToken::new();
        let queue = replica(&config, 300, &shutdown).await;
        // The window is counted from the admission, inside `enqueue`: timed from before it, so
        // that a slow admission (a loaded machine) does not look like a claim that came early.
        let started = Instant::now();
        queue.enqueue(&alert(1, "phone")).await.unwrap();
        let claimed = queue.claim("lane", 8, 30_000, 10_000).await.unwrap();
        let waited = started.elapsed();
        assert_eq!(claimed.len(), 1);
        assert!(
            waited >= Duration::from_millis(250) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        shutdown.cancel();
    }
}

/// A replica acts on the notifications of the others' commits, not on the echo of its own: it
/// woke its own lanes as it committed, and the echo woke them again a few milliseconds later, when
/// the first wake's claim had taken the work (under load, half the claims came back empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_hears_the_others_commits_not_the_echo_of_its_own() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let shutdown = CancellationToken::new();
    let admitting = replica(&config, 0, &shutdown).await;
    let other = replica(&config, 0, &shutdown).await;
    // Both replicas listen before the first commit.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for seq in 1..=3 {
        admitting
            .enqueue(&alert(seq, &format!("phone-{seq}")))
            .await
            .unwrap();
    }
    eventually(5, || other.replica_news() >= 3).await;
    assert_eq!(other.replica_news(), 3, "one notification per commit");
    // The echoes were sent to both listeners at once.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(admitting.replica_news(), 0, "its own commits are not news");
    let claimed = admitting.claim("lane", 64, 30_000, 1_000).await.unwrap();
    assert_eq!(claimed.len(), 3, "its own lanes still find the work");
    shutdown.cancel();
}

/// A replica's notification says when its new work is due, so a lane on another replica asleep
/// until an earlier window's end sleeps through windows that end later (without the time, every
/// admission group woke every other replica's lanes to read the same due time again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lane_sleeps_through_another_replicas_later_windows() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let shutdown = CancellationToken::new();
    let admitting = replica(&config, 2_000, &shutdown).await;
    let waiting = replica(&config, 2_000, &shutdown).await;
    let lane = tokio::spawn({
        let waiting = waiting.clone();
        async move { waiting.claim("lane", 64, 30_000, 3_000).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = waiting.due_reads();
    admitting.enqueue(&alert(1, "phone-1")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = waiting.due_reads() - before;
    assert!(first >= 1, "the first window is news to the lane");
    for seq in 2..=10 {
        admitting
            .enqueue(&alert(seq, &format!("phone-{seq}")))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        waiting.due_reads() - before,
        first,
        "nine later windows, no read"
    );
    shutdown.cancel();
    lane.abort();
}

/// A replica tells the others of work due later only when it is news: once it has told them of a
/// window ending at some time, windows ending later need no notification (the others' claims are
/// awake by then and read them). Work due sooner, or once that time comes near, is told again.
/// Every notification was one more commit holding the server's notification lock through its flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_tells_the_others_of_later_windows_only_once_the_first_has_ended() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let shutdown = CancellationToken::new();
    let admitting = replica(&config, 3_000, &shutdown).await;
    let other = replica(&config, 3_000, &shutdown).await;
    // Both replicas listen before the first commit.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A claim on the other replica waits from before the first window: woken by its news, it
    // takes that window's batch once due, well before its own 10 s wait ends.
    let waiting = tokio::spawn({
        let other = other.clone();
        async move {
            let claimed = other.claim("lane", 64, 30_000, 10_000).await.unwrap();
            (Instant::now(), claimed.len())
        }
    });
    admitting.enqueue(&alert(1, "phone-1")).await.unwrap();
    // The first window ends 3 s after its round's time, which is before this.
    let first_told = Instant::now();
    for seq in 2..=10 {
        admitting
            .enqueue(&alert(seq, &format!("phone-{seq}")))
            .await
            .unwrap();
    }
    assert!(
        first_told.elapsed() < Duration::from_millis(1_500),
        "all while the first window's end is more than wake::TOLD_AHEAD_MS away"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        other.replica_news(),
        1,
        "nine windows ending later are no news"
    );
    // Once the first window's end is near, a new window is news again.
    tokio::time::sleep(Duration::from_millis(2_200).saturating_sub(first_told.elapsed())).await;
    admitting.enqueue(&alert(11, "phone-11")).await.unwrap();
    eventually(5, || other.replica_news() >= 2).await;
    assert_eq!(other.replica_news(), 2);
    let (claimed_at, mut claimed) = waiting.await.unwrap();
    assert!(claimed >= 1, "woken, not timed out");
    assert!(
        claimed_at.saturating_duration_since(first_told) < Duration::from_millis(4_500),
        "taken when its window ended"
    );
    // The other replica's claims take the rest too.
    let deadline = Instant::now() + Duration::from_secs(10);
    while claimed < 11 && Instant::now() < deadline {
        claimed += other.claim("lane", 64, 30_000, 5_000).await.unwrap().len();
    }
    assert_eq!(claimed, 11);
    shutdown.cancel();
}

/// A replica whose listener's connection is lost and made again cannot know what was told
/// meanwhile (and other replicas tell a time only once): its claims look again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_look_again_when_the_listener_has_reconnected() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let shutdown = CancellationToken::new();
    let queue = replica(&config, 0, &shutdown).await;
    let lane = tokio::spawn({
        let queue = queue.clone();
        async move { queue.claim("lane", 64, 30_000, 10_000).await }
    });
    // The listener is in place, and the claim asleep with nothing due.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = queue.due_reads();
    let pool = open_and_migrate(&config).await.unwrap();
    let orca_push_storage::Pool::Postgres(pg) = pool else {
        panic!("a PostgreSQL pool");
    };
    let ended: i64 = sqlx::query_scalar(
        "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(ended, 1, "the listener's connection");
    eventually(5, || queue.due_reads() != before).await;
    assert!(queue.due_reads() > before, "the claim looked again");
    shutdown.cancel();
    lane.abort();
}
