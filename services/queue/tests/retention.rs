//! Retention at scale: a day and more of finished work at a rate no fixed per-pass cap keeps up
//! with, on a manual clock. The tables settle at what the last 24 hours hold, and the age of the
//! oldest row past retention stays at zero. On SQLite and PostgreSQL.

mod support;

use orca_push_queue::model::RETENTION_MS;
use orca_push_storage::Pool;
use orca_push_storage::testing::Backend;
use support::*;

on_both_backends!(
    a_day_at_the_peak_rate_leaves_the_tables_at_a_steady_size,
    one_pass_clears_a_backlog_far_beyond_one_round,
);

/// Simulated time between cleanup passes, and the finished events each step brings: 2,000 events
/// (and their recipients and batches) per pass, twice what one round of 1,000 rows deletes.
const STEP_MS: i64 = 60 * 60 * 1000;
const PER_STEP: i64 = 2_000;

/// Finished work as admissions and deliveries leave it: `n` events accepted at `at` (ids
/// `prefix-<i>`), one recipient and one sent batch each, and a dismissal fence per event.
async fn finished_history(pool: &Pool, prefix: &str, n: i64, at: i64) {
    const SERIES: &str =
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < $1)";
    let statements = [
        format!(
            "{SERIES} INSERT INTO push_events (event_id, host_fingerprint, kind, notification_epoch, \
             notification_seq, notification_id, content_hash, accepted_at, expires_at) \
             SELECT $2 || '-' || i, 'hostAAAAAAAAAAAA', 'alert', $2, i, 'n', 'h', $3, $3 + 300000 FROM n"
        ),
        format!(
            "{SERIES} INSERT INTO push_event_recipients (event_id, registration_id, batch_id, status, \
             silent, created_at, updated_at) SELECT $2 || '-' || i, 'r1', $2 || '-b' || i, 'sent', 0, $3, $3 FROM n"
        ),
        format!(
            "{SERIES} INSERT INTO push_delivery_batches (batch_id, registration_id, host_fingerprint, \
             kind, state, coalescible, window_ends_at, available_at, member_count, members_bytes, \
             routing_bytes, deadline, silent, attempts, created_at, finished_at) \
             SELECT $2 || '-b' || i, 'r1', 'hostAAAAAAAAAAAA', 'alert', 'sent', 1, $3, $3, 1, 10, 10, \
             $3 + 300000, 0, 1, $3, $3 FROM n"
        ),
        format!(
            "{SERIES} INSERT INTO push_dismissed_events (host_fingerprint, notification_epoch, \
             notification_id, dismissed_seq, created_at) SELECT 'hostAAAAAAAAAAAA', $2, 'n' || i, 1, $3 FROM n"
        ),
    ];
    for sql in &statements {
        match pool {
            Pool::Sqlite(p) => {
                sqlx::query(sql)
                    .bind(n)
                    .bind(prefix)
                    .bind(at)
                    .execute(p)
                    .await
                    .unwrap();
            }
            Pool::Postgres(p) => {
                // PostgreSQL types the recursive column from its first term.
                let sql = sql.replacen("SELECT 1 UNION", "SELECT 1::bigint UNION", 1);
                sqlx::query(&sql)
                    .bind(n)
                    .bind(prefix)
                    .bind(at)
                    .execute(p)
                    .await
                    .unwrap();
            }
        }
    }
}

async fn count(pool: &Pool, table: &str) -> i64 {
    let sql = match table {
        "events" => "SELECT COUNT(*) FROM push_events",
        "recipients" => "SELECT COUNT(*) FROM push_event_recipients",
        "batches" => "SELECT COUNT(*) FROM push_delivery_batches",
        _ => "SELECT COUNT(*) FROM push_dismissed_events",
    };
    match pool {
        Pool::Sqlite(p) => sqlx::query_scalar(sql).fetch_one(p).await.unwrap(),
        Pool::Postgres(p) => sqlx::query_scalar(sql).fetch_one(p).await.unwrap(),
    }
}

async fn a_day_at_the_peak_rate_leaves_the_tables_at_a_steady_size(backend: Backend) {
    let h = harness(backend).await;
    let pool = orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap();
    let steps_per_day = RETENTION_MS / STEP_MS;
    let mut sizes = Vec::new();
    // 28 hours: the first 24 fill the retention window, the last four must not grow it.
    for step in 0..steps_per_day + 4 {
        let at = T0 as i64 + step * STEP_MS;
        h.clock.set(at as u64);
        finished_history(&pool, &format!("s{step}"), PER_STEP, at).await;
        let cleaned = h.queue.cleanup().await.unwrap();
        assert_eq!(
            cleaned.past_retention_ms, 0,
            "step {step}: cleanup fell behind"
        );
        sizes.push(count(&pool, "events").await);
    }
    // Everything accepted in the last 24 hours (the boundary step included), nothing older.
    let steady = (steps_per_day + 1) * PER_STEP;
    assert_eq!(
        &sizes[sizes.len() - 3..],
        [steady, steady, steady],
        "{sizes:?}"
    );
    for table in ["recipients", "batches", "fences"] {
        assert_eq!(count(&pool, table).await, steady, "{table}");
    }
}

async fn one_pass_clears_a_backlog_far_beyond_one_round(backend: Backend) {
    let h = harness(backend).await;
    let pool = orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap();
    // A backlog left by a day of cleanup falling behind, and a day's worth still within retention.
    finished_history(&pool, "old", 20_000, T0 as i64).await;
    finished_history(&pool, "new", 1_000, T0 as i64 + RETENTION_MS).await;
    h.clock.set(T0 + RETENTION_MS as u64 + 60_000);
    let cleaned = h.queue.cleanup().await.unwrap();
    assert_eq!(cleaned.deleted_events, 20_000);
    assert_eq!(cleaned.deleted_batches, 20_000);
    assert_eq!(cleaned.deleted_fences, 20_000);
    assert_eq!(cleaned.past_retention_ms, 0);
    for table in ["events", "recipients", "batches", "fences"] {
        assert_eq!(count(&pool, table).await, 1_000, "{table}");
    }
}

/// PostgreSQL: a fence raised again (a later dismissal of the same notification) while cleanup's
/// delete of it, picked when it was old, waits for its row lock survives: its new `created_at`
/// is checked again, and later alerts of that notification stay fenced for another 24 hours.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fence_raised_again_while_cleanup_deletes_it_is_kept_postgres() {
    let h = harness(Backend::Postgres).await;
    let pool = orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap();
    let Pool::Postgres(pg) = &pool else {
        unreachable!("a PostgreSQL pool")
    };
    let old = T0 as i64;
    sqlx::query(
        "INSERT INTO push_dismissed_events (host_fingerprint, notification_epoch, \
         notification_id, dismissed_seq, created_at) VALUES ('hostAAAAAAAAAAAA', 'e', 'n', 5, $1)",
    )
    .bind(old)
    .execute(pg)
    .await
    .unwrap();
    let now = old + RETENTION_MS + 60_000;
    h.clock.set(now as u64);
    // The later dismissal's round, not yet committed, holds the fence's row.
    let mut raising = pg.begin().await.unwrap();
    sqlx::query(
        "UPDATE push_dismissed_events SET dismissed_seq = 9, created_at = $1 \
         WHERE host_fingerprint = 'hostAAAAAAAAAAAA'",
    )
    .bind(now)
    .execute(&mut *raising)
    .await
    .unwrap();
    let queue = h.queue.clone();
    let cleaning = tokio::spawn(async move { queue.cleanup().await });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    raising.commit().await.unwrap();
    cleaning.await.unwrap().unwrap();
    let kept: Vec<(i64, i64)> =
        sqlx::query_as("SELECT dismissed_seq, created_at FROM push_dismissed_events")
            .fetch_all(pg)
            .await
            .unwrap();
    assert_eq!(kept, [(9, now)], "the fence raised again is kept");
}
