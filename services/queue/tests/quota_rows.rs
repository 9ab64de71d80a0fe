//! PostgreSQL's quota use per host and kind (`push_quota_use`, queue migration 0010): each row
//! says how many of its host's events of its kind were accepted after its start, whichever path
//! wrote them, and admission counts the quota from it. (SQLite counts in its writer's memory,
//! `store::quota`; the quota's behaviour on both backends is `behaviour.rs`'s.)

use orca_push_queue::model::{AdmissionStatus, QUOTA_WINDOW_MS};
use orca_push_queue::store::QueueStore as _;
use orca_push_queue::{AnyQueueStore, STORAGE, open_and_migrate};
use orca_push_storage::testing::Backend;

mod support;

use support::*;

const MINUTE: u64 = 60 * 1000;

async fn postgres(h: &Harness) -> sqlx::PgPool {
    match orca_push_storage::open(&h.config, &STORAGE).await.unwrap() {
        orca_push_storage::Pool::Postgres(pg) => pg,
        orca_push_storage::Pool::Sqlite(_) => unreachable!("a PostgreSQL harness"),
    }
}

/// The rows, and those whose `used` is not the number of their events accepted after their start.
async fn rows_and_untrue(pg: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT COUNT(*), COUNT(*) FILTER (WHERE u.used <> (SELECT COUNT(*) FROM push_events e \
           WHERE e.host_fingerprint = u.host_fingerprint AND e.kind = u.kind \
           AND e.accepted_at > u.counted_after)) \
         FROM push_quota_use u",
    )
    .fetch_one(pg)
    .await
    .unwrap()
}

/// The use the table's one row holds.
async fn the_one_rows_use(pg: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT used FROM push_quota_use")
        .fetch_one(pg)
        .await
        .unwrap()
}

async fn assert_rows_true(pg: &sqlx::PgPool, rows: i64, when: &str) {
    assert_eq!(rows_and_untrue(pg).await, (rows, 0), "{when}");
}

/// An alert of `host` inserted as a replica of an older version does, knowing nothing of the rows.
async fn event_by_hand(pg: &sqlx::PgPool, host: &str, seq: i64, accepted_at: u64) {
    sqlx::query(
        "INSERT INTO push_events (event_id, host_fingerprint, kind, notification_epoch, \
         notification_seq, content_hash, accepted_at, expires_at) \
         VALUES ($1, $2, 'alert', 'epoch-by-hand', $3, 'hash', $4, $4 + 60000)",
    )
    .bind(format!("by-hand-{host}-{seq}"))
    .bind(host)
    .bind(seq)
    .bind(accepted_at as i64)
    .execute(pg)
    .await
    .unwrap();
}

/// Every path that writes a host's events keeps its row true: the batched rounds (several of one
/// host's admissions in one), admission one at a time (a retry's or a dismissal's path), an older
/// replica's insert (the table's trigger), and a clock that goes on, past the window, and back. A
/// host gets a row from its 32nd event in the window (`admission::QUOTA_ROW_FROM`), or from an
/// insert by the trigger.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgresql_quota_rows_stay_true_on_every_path() {
    let h = harness(Backend::Postgres).await;
    let pg = postgres(&h).await;
    let admitted = futures::future::join_all((0..40).map(|seq| {
        let queue = h.queue.clone();
        async move { queue.enqueue(&alert(seq, &["r1"])).await.unwrap() }
    }))
    .await;
    assert!(
        admitted
            .iter()
            .all(|e| e.statuses[0].1 == AdmissionStatus::Queued)
    );
    assert_rows_true(&pg, 1, "batched rounds").await;
    assert_eq!(the_one_rows_use(&pg).await, 40);

    let one_at_a_time = AnyQueueStore::new(open_and_migrate(&h.config).await.unwrap()).row_by_row();
    let group: Vec<_> = (40..45).map(|seq| alert(seq, &["r2"])).collect();
    let refs: Vec<_> = group.iter().collect();
    for result in one_at_a_time
        .enqueue_group(&refs, T0 as i64 + 10, WINDOW as i64, None)
        .await
    {
        result.unwrap();
    }
    assert_eq!(
        h.admit(&dismiss(&alert(0, &["r1"]), 100, &["r1"])).await,
        [AdmissionStatus::Queued]
    );
    assert_rows_true(&pg, 1, "one at a time, and a dismissal (one, so no row)").await;

    event_by_hand(&pg, HOST, 1000, T0 + 20).await;
    assert_rows_true(&pg, 1, "an older replica's insert").await;
    event_by_hand(&pg, "hostBBBBBBBBBBBB", 1, T0 + 20).await;
    assert_rows_true(&pg, 2, "an older replica's insert for a host with no row").await;

    for (at, seq) in [
        (T0 + 10 * MINUTE, 2000),
        (T0 + 16 * MINUTE, 2001),
        (T0 + 40 * MINUTE, 2002),
        (T0 + 5 * MINUTE, 2003),
    ] {
        h.clock.set(at);
        assert_eq!(
            h.admit(&alert(seq, &["r1"])).await,
            [AdmissionStatus::Queued]
        );
        // One at a time too: at T0 + 40 minutes the host has a row and a few events in the window.
        let one = alert(seq + 100, &["r2"]);
        let result = one_at_a_time
            .enqueue_group(&[&one], at as i64, WINDOW as i64, None)
            .await;
        assert!(result[0].is_ok());
        event_by_hand(&pg, HOST, seq + 1000, at).await;
        assert_rows_true(&pg, 2, &format!("at T0 + {} ms", at - T0)).await;
    }
}

/// An older replica's events count: 299 admitted, one inserted by hand, and the next is refused.
#[tokio::test]
async fn postgresql_quota_counts_an_older_replicas_events() {
    let h = harness(Backend::Postgres).await;
    let pg = postgres(&h).await;
    for seq in 0..299 {
        assert_eq!(
            h.admit(&alert(seq, &["r1"])).await,
            [AdmissionStatus::Queued],
            "{seq}"
        );
        h.clock.advance(1);
    }
    event_by_hand(&pg, HOST, 299, T0 + 299).await;
    assert_eq!(
        h.admit(&alert(300, &["r1"])).await,
        [AdmissionStatus::RateLimited]
    );
}

/// 32 alerts of `HOST` from `seq` on, each queued.
async fn give_a_row(h: &Harness, seq: i64) {
    for seq in seq..seq + 32 {
        assert_eq!(
            h.admit(&alert(seq, &["r1"])).await,
            [AdmissionStatus::Queued]
        );
    }
}

/// The clean-up deletes rows no admission reads any more (their start two windows old), and the
/// quota is counted whole, then kept again, after.
#[tokio::test]
async fn postgresql_cleanup_deletes_quota_rows_no_read_takes() {
    let h = harness(Backend::Postgres).await;
    let pg = postgres(&h).await;
    give_a_row(&h, 0).await;
    assert_rows_true(&pg, 1, "32 in the window").await;
    h.clock.set(T0 + MINUTE);
    assert_eq!(h.queue.cleanup().await.unwrap().deleted_quota_rows, 0);
    assert_rows_true(&pg, 1, "a minute on").await;
    // The row starts a window before T0: two windows later it is past reading.
    h.clock.set(T0 + QUOTA_WINDOW_MS as u64 + 1);
    assert_eq!(h.queue.cleanup().await.unwrap().deleted_quota_rows, 1);
    assert_rows_true(&pg, 0, "after the clean-up").await;
    give_a_row(&h, 100).await;
    assert_rows_true(&pg, 1, "written again").await;
}

/// A session of its own on the test database, on the server's default search path (not the
/// queue's schema, as the gateway's connections are): an operator's psql, say.
async fn plain_session(h: &Harness) -> sqlx::PgPool {
    let orca_push_storage::DatabaseConfig::Postgres { url } = &h.config else {
        unreachable!("a PostgreSQL harness")
    };
    use secrecy::ExposeSecret as _;
    sqlx::PgPool::connect(url.expose_secret()).await.unwrap()
}

const HAND_INSERT: &str = "INSERT INTO push_queue.push_events (event_id, host_fingerprint, kind, \
     notification_epoch, notification_seq, content_hash, accepted_at, expires_at) \
     VALUES ('by-hand', $1, 'alert', 'epoch-by-hand', 1, 'hash', $2, $2 + 60000)";

/// An insert by hand, from a session whose search path does not name the queue's schema, runs the
/// trigger in that schema, and waits for the host's lock: a round of that host that has read its
/// row commits first, so the trigger counts from what the round wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_an_insert_by_hand_keeps_the_rows_true_and_waits_for_the_hosts_round() {
    let h = harness(Backend::Postgres).await;
    let pg = postgres(&h).await;
    give_a_row(&h, 0).await;
    let mut round = pg.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('push_events:' || $1, 0))")
        .bind(HOST)
        .execute(&mut *round)
        .await
        .unwrap();
    let session = plain_session(&h).await;
    let by_hand = tokio::spawn(async move {
        sqlx::query(HAND_INSERT)
            .bind(HOST)
            .bind(T0 as i64)
            .execute(&session)
            .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        !by_hand.is_finished(),
        "the insert waits for the host's lock"
    );
    round.commit().await.unwrap();
    by_hand.await.unwrap().unwrap();
    assert_rows_true(&pg, 1, "after the insert by hand").await;
    assert_eq!(the_one_rows_use(&pg).await, 33);
}

/// The clean-up skips an old row that a round or an insert holds (it would otherwise wait, and,
/// taking two such rows in the other order, could deadlock the round), and deletes it next pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_cleanup_skips_quota_rows_a_round_holds() {
    let h = harness(Backend::Postgres).await;
    let pg = postgres(&h).await;
    give_a_row(&h, 0).await;
    h.clock.set(T0 + QUOTA_WINDOW_MS as u64 + 1);
    let mut round = pg.begin().await.unwrap();
    sqlx::query("SELECT used FROM push_quota_use FOR UPDATE")
        .fetch_all(&mut *round)
        .await
        .unwrap();
    let cleaned = tokio::time::timeout(std::time::Duration::from_secs(5), h.queue.cleanup())
        .await
        .expect("the clean-up does not wait for a held row")
        .unwrap();
    assert_eq!(cleaned.deleted_quota_rows, 0);
    round.commit().await.unwrap();
    assert_eq!(h.queue.cleanup().await.unwrap().deleted_quota_rows, 1);
}
