//! A lapsed lease is counted by the claim that takes it over, whether or not that claim's caller is
//! still there. The count is read from the process's own recorder (the claim may run on the SQLite
//! writer's thread, which a thread-local recorder would not see), so this file is a test binary of
//! its own and its tests take turns.

mod support;

use orca_push_storage::testing::Backend;
use support::*;

static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `orca_push_lease_expiries_total` as this process has counted it so far.
fn expiries() -> f64 {
    static RECORDER: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    let handle = RECORDER.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder in this test binary")
    });
    handle
        .render()
        .lines()
        .find_map(|l| {
            l.strip_prefix("orca_push_lease_expiries_total ")?
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0)
}

/// A claim whose caller goes away while its transaction runs (an all-in-one lane stopping, a
/// sender whose call was cut): the lapsed lease it took over is still counted, and the batch is
/// due again at once rather than leased to nobody for another lease.
async fn a_claim_left_by_its_caller_counts_its_lapsed_lease_and_gives_the_work_back(
    backend: Backend,
) {
    // One test at a time reads the process's counter.
    let _alone = ALONE.lock().await;
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1"])).await;
    let first = h.claim_all().await.pop().unwrap();
    h.clock.advance(LEASE as u64 + 1);
    let before = h.queue.claim_transactions();
    let counted_before = expiries();
    // SQLite: the writer's thread runs the claim's round as soon as it is queued, so the file's
    // write lock is held elsewhere until the caller has left, and the round answers nobody.
    let held = match backend {
        Backend::Sqlite => match orca_push_queue::open_and_migrate(&h.config).await.unwrap() {
            orca_push_storage::Pool::Sqlite(pool) => {
                let mut lock = pool.acquire().await.unwrap();
                sqlx::query("BEGIN IMMEDIATE")
                    .execute(&mut *lock)
                    .await
                    .unwrap();
                Some(lock)
            }
            orca_push_storage::Pool::Postgres(_) => unreachable!("a SQLite harness"),
        },
        Backend::Postgres => None,
    };
    let mut claim = Box::pin(h.queue.claim("lane-gone", 64, LEASE, 0));
    // Polled until its claim has gone to the writer (SQLite: a place in its next round, which
    // waits for the lock above) or begun on a task of its own (PostgreSQL: one thread, so it
    // cannot run before this one yields), then dropped before it is answered.
    loop {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(claim.as_mut().poll(cx)));
        if let std::task::Poll::Ready(ended) = polled.await {
            panic!("the claim ended before its caller left: {ended:?}");
        }
        if h.queue.claim_transactions() != before {
            break;
        }
        tokio::task::yield_now().await;
    }
    drop(claim);
    if let Some(mut lock) = held {
        sqlx::query("ROLLBACK").execute(&mut *lock).await.unwrap();
    }
    async fn within<T>(what: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(std::time::Duration::from_secs(5), what)
            .await
            .expect("within 5 s")
    }
    // The claim ran on after its caller left, and counted the lease it took over.
    within(async {
        while expiries() == counted_before {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(
        expiries() - counted_before,
        1.0,
        "the lapsed lease is counted once"
    );
    // And gave the batch back, due now, under no lease.
    let again = within(async {
        loop {
            if let Some(batch) = h.claim_all().await.pop() {
                return batch;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(again.batch_id, first.batch_id);
    assert!(!again.recovered, "handed back, not lapsed again");
    assert_eq!(expiries() - counted_before, 1.0);
}

mod a_claim_left_by_its_caller {
    // One thread: the claim's own task cannot run before the test drops its caller.
    #[tokio::test]
    async fn sqlite() {
        super::a_claim_left_by_its_caller_counts_its_lapsed_lease_and_gives_the_work_back(
            orca_push_storage::testing::Backend::Sqlite,
        )
        .await;
    }
    #[tokio::test]
    async fn postgres() {
        super::a_claim_left_by_its_caller_counts_its_lapsed_lease_and_gives_the_work_back(
            orca_push_storage::testing::Backend::Postgres,
        )
        .await;
    }
}
