//! PostgreSQL's final answers in one call (`push_finish_batches`, queue migration 0011), where a
//! report flush was a transaction of five statements. What a report does is `behaviour.rs`'s, on
//! both backends; this shows the call is what does it on PostgreSQL. (That a flush is then one
//! round trip is the benchmark's count, docs/benchmarks.md round 52.)

use std::time::Duration;

use orca_push_queue::STORAGE;
use orca_push_queue::store::Outcome;
use orca_push_storage::testing::Backend;

mod support;

use support::*;

async fn postgres(h: &Harness) -> sqlx::PgPool {
    match orca_push_storage::open(&h.config, &STORAGE).await.unwrap() {
        orca_push_storage::Pool::Postgres(pg) => pg,
        orca_push_storage::Pool::Sqlite(_) => unreachable!("a PostgreSQL harness"),
    }
}

/// The calls of `push_finish_batches` the server has counted. A session sends its counts to the
/// server's statistics at the latest when it ends (an idle one within 10 s since PostgreSQL 15,
/// not at all before), so every other session of the database is ended first, the queue's
/// connections with them: the test's last look.
async fn calls_counted(h: &Harness, at_least: i64) -> i64 {
    let mut own = postgres(h).await.acquire().await.unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(&mut *own)
    .await
    .unwrap();
    let mut calls = 0;
    for _ in 0..300 {
        calls = sqlx::query_scalar(
            "SELECT COALESCE(SUM(calls), 0)::int8 FROM pg_stat_user_functions \
             WHERE funcname = 'push_finish_batches'",
        )
        .fetch_one(&mut *own)
        .await
        .unwrap();
        if calls >= at_least {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    calls
}

/// A lane's reports, and an expiry found by a claim, end their batches through the one call: the
/// server counts its calls, the batches are finished and the payload no recipient waits for is
/// cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgresql_finishes_batches_in_one_call() {
    let h = harness_with(Backend::Postgres, 0).await;
    let pg = postgres(&h).await;
    // Sessions opened from here on count the calls of PL/pgSQL functions.
    sqlx::query(
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET track_functions = %L', \
         current_database(), 'pl'); END $$",
    )
    .execute(&pg)
    .await
    .unwrap();
    let h = h.reopened().await;
    let pg = postgres(&h).await;

    h.admit(&alert(1, &["r1", "r2"])).await;
    // The reopened queue coalesces for `WINDOW`.
    h.clock.advance(WINDOW);
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 2);
    for b in &claimed {
        assert!(
            h.queue
                .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "200", true)
                .await
                .unwrap()
        );
    }
    let (finished, payloads): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM push_delivery_batches WHERE state = 'sent'), \
         (SELECT COUNT(*) FROM push_events WHERE payload_json IS NOT NULL)",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!((finished, payloads), (2, 0));

    // A claim that finds a batch past its deadline expires it through the call too.
    let mut late = alert(2, &["r1"]);
    late.expires_at_ms = Some((T0 + WINDOW) as i64 + 1_000);
    h.admit(&late).await;
    h.clock.advance(WINDOW);
    assert!(h.claim_all().await.is_empty());
    let expired: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM push_delivery_batches WHERE state = 'expired'")
            .fetch_one(&pg)
            .await
            .unwrap();
    assert_eq!(expired, 1);
    assert_eq!(
        calls_counted(&h, 3).await,
        3,
        "a call a report, and the expiry's"
    );
}
