//! SQLite's side of `super`: one writer, on its own connection and thread.

use super::Backend;
use crate::error::QueueError;
use crate::model::Admission;

/// SQLite: one writer at a time. `BEGIN IMMEDIATE` takes the write lock before the first read, so
/// the quota count and the insert that follows it cannot interleave with another admission.
#[derive(Debug, Clone)]
pub struct SqliteQueueStore {
    pub(in crate::store) pool: sqlx::SqlitePool,
    pub(in crate::store) readers: sqlx::SqlitePool,
    pub(in crate::store) row_by_row: bool,
    /// Groups admitted on the batched path (see `AnyQueueStore::batched_groups`).
    pub(in crate::store) batched_groups: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Syncs the WAL for a writer that commits at NORMAL under full durability: a round is
    /// answered after the sync that covers it, while the next one is written.
    pub(in crate::store) wal_sync: Option<std::sync::Arc<orca_push_storage::WalSync>>,
    /// The writer's own connection for its rounds (`crate::store::direct`).
    pub(in crate::store) direct: std::sync::Arc<crate::store::direct::Direct>,
    /// Where the clean-up's payload sweep ended.
    pub(in crate::store) payload_sweep: std::sync::Arc<crate::store::cleanup::PayloadSweep>,
    /// The quota window's events, counted by the writer (`crate::store::quota`).
    pub(in crate::store) quota: std::sync::Arc<crate::store::quota::Ledger>,
}

impl Backend for SqliteQueueStore {
    type Db = sqlx::Sqlite;
    type Tx = crate::store::direct::SqliteTx;
}

impl SqliteQueueStore {
    /// A claim of the work `skip` takes (`claims::claim_sql`).
    pub(in crate::store) fn claim_sql(skip: crate::store::Skip) -> &'static str {
        static CLAIMS: std::sync::LazyLock<crate::store::claims::PerSkip> =
            std::sync::LazyLock::new(|| {
                crate::store::claims::PerSkip::new(|skip| {
                    crate::store::claims::claim_sql(skip, "", "")
                })
            });
        CLAIMS.get(skip)
    }
    /// One writer at a time: nothing to lock.
    pub(in crate::store) const FOR_UPDATE: &'static str = "";
    /// SQLite plans a statement when it prepares it, preferring an index where one applies: a
    /// clean-up read runs beside the writer (`reader`).
    pub(in crate::store) const PLANS_KEPT: bool = false;
    /// Built statements' parameters are `?` (`sql::Stmt`).
    pub(in crate::store) const NUMBERED: bool = false;
    /// How a round's multi-row inserts and updates meet a constraint they break: the statement
    /// stops with an error and keeps the rows it changed, where SQLite's default (`ABORT`) undoes
    /// them. Nothing here goes on in a transaction after a statement fails (the round is rolled
    /// back and its work done apart), so the two end the same; but only `ABORT` needs each such
    /// statement to copy every page it changes into a statement journal first, which was 2.8% of
    /// the gateway's samples at 1,000 end-to-end flows. The recipients' insert keeps `ABORT`: its
    /// foreign key (checked at the statement's end) needs the journal either way.
    pub(in crate::store) const OR_FAIL: &'static str = " OR FAIL";

    pub fn new(pool: sqlx::SqlitePool) -> Self {
        let readers = orca_push_storage::ReadPool::readers(&pool);
        let wal_sync = orca_push_storage::wal_sync::for_writer(&pool).map(std::sync::Arc::new);
        let direct = std::sync::Arc::default();
        Self {
            pool,
            readers,
            row_by_row: false,
            batched_groups: Default::default(),
            wal_sync,
            direct,
            payload_sweep: std::sync::Arc::default(),
            quota: std::sync::Arc::default(),
        }
    }

    /// A round's quota counts: the one writer keeps them (`crate::store::quota`).
    pub(in crate::store) fn round_quota(&self) -> crate::store::RoundQuota {
        crate::store::RoundQuota::ledger(self.quota.clone())
    }

    /// Where reads outside a transaction go.
    pub(in crate::store) fn reader(&self) -> &sqlx::SqlitePool {
        &self.readers
    }

    /// A group's multi-row statements of up to this many rows stay prepared on the writer (whose
    /// cache holds `orca_push_storage::SQLITE_WRITER_STATEMENTS`): preparing them again each round
    /// was 7% of the queue writer's time. Larger ones are not kept: a group of 128 sends to 20
    /// phones each inserts up to 1,000 recipients in one statement (some 500 KB compiled), and a
    /// cache of those could hold hundreds of megabytes. A group's writes are one joined text
    /// (`crate::admission::Writes`), kept per mix of row counts up to 128 rows in all: at some
    /// 550 bytes compiled per row, the 1,024 texts the cache holds stay under about 70 MB however
    /// the mixes vary (the benchmark's peak RSS rose by 2-5 MiB when they were joined).
    pub(in crate::store) const KEEP_ROWS_AT_MOST: Option<usize> = Some(128);
    /// No other replica to wake (`wake_replicas`).
    pub(in crate::store) const WAKES_IN_WRITES: bool = false;
    /// One process owns a SQLite queue: no other replica to tell (`wake_replicas`).
    pub(in crate::store) const TELLS_REPLICAS: bool = false;
    /// The writer counts the quota in memory (`crate::store::quota`): no `push_quota_use`.
    pub(in crate::store) const QUOTA_USE_ROWS: bool = false;
    /// Final answers as the statements they are (no functions in SQLite): the writer's rounds
    /// carry them, joined into one query (`finish_batches_joined`).
    pub(in crate::store) const FINISHES_BY_CALL: bool = false;
    /// One writer: a second group could only wait for it.
    pub(in crate::store) const GROUP_WRITERS: usize = 1;
    /// Reports share the admission writer's rounds: one transaction and one sync for both, and
    /// their statements sent from the writer's own thread. Measured at 100 end-to-end flows, report
    /// transactions of their own were 300/s and a third of the writer connection's time.
    pub(in crate::store) const REPORTS_IN_ROUNDS: bool = true;
    /// Claims share them too: a claim first takes what waited in the table, then the round's new
    /// work due at once, written already leased to it (as a waiting claim's hand-off), so that
    /// work is never read back. Measured at 1,000 end-to-end flows, claims of their own were a
    /// quarter of the writer connection's statement time, and each waited for the writer behind
    /// the rounds (docs/benchmarks.md, round 17).
    pub(in crate::store) const CLAIMS_IN_ROUNDS: bool = true;
    /// New work due at once goes to waiting claims (`crate::handoff`): a claim transaction per
    /// such batch was a fifth of the one writer connection's time at 100 end-to-end flows.
    pub(in crate::store) const HANDS_OFF: bool = true;
    /// Its rounds run their statements on their own connection, on the writer's thread
    /// (`crate::store::direct`), and wait there for the disk rather than on a runtime serving requests
    /// (only if that thread's runtime cannot be built does the writer share the main one).
    pub(in crate::store) const WRITER_THREAD: bool = true;
    /// Nothing on the writer's thread does I/O.
    pub(in crate::store) const WRITER_IO: bool = false;
    /// Its rounds keep the pool's writer connection from one to the next (`crate::store::direct`).
    pub(in crate::store) const KEEPS_BETWEEN_ROUNDS: bool = true;

    /// One writer, whose failed commit did not happen: nothing to wait for
    /// (`QueueStore::settle_hosts`).
    pub(in crate::store) async fn wait_for_locks(
        &self,
        _hosts: &[&str],
        _batches: &[&str],
    ) -> Result<(), QueueError> {
        Ok(())
    }

    /// A writer's round: on the writer's own connection where there is one.
    pub(in crate::store) async fn begin_group_write(
        &self,
        _group: &[&Admission],
    ) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        if let Some(tx) = self.direct.begin(&self.pool).await? {
            return Ok(crate::store::direct::SqliteTx::Direct(tx));
        }
        self.begin_claim().await
    }

    /// While the writer is busy its rounds keep the pool's writer connection from one to the
    /// next (`crate::store::direct`).
    pub(in crate::store) fn keep_between_rounds(&self, keep: bool) {
        self.direct.keep(keep);
    }

    /// The pool for a write outside the rounds. The writer may keep the pool's writer connection
    /// between rounds (`crate::store::direct`): asked for it, a round gives it back at its end (on the
    /// writer's own thread, a failed round's work done apart would otherwise wait for itself).
    pub(in crate::store) fn writes(&self) -> &sqlx::SqlitePool {
        self.direct.release();
        &self.pool
    }

    pub(in crate::store) async fn begin_claim(&self) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        Ok(crate::store::direct::SqliteTx::Pool(
            self.writes().begin_with("BEGIN IMMEDIATE").await?,
        ))
    }

    /// A claim outside the writer's rounds: a claim's transaction (the queue's other writes are
    /// not synced on their own here either).
    pub(in crate::store) async fn begin_lease(&self) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        self.begin_claim().await
    }

    /// Nothing is notified (`wake_replicas`), so nothing is signed.
    pub(in crate::store) fn origin(&self) -> &str {
        ""
    }

    /// Nothing is notified, so everything would be news.
    pub(in crate::store) fn told(&self) -> crate::wake::Told {
        crate::wake::Told::default()
    }

    pub(in crate::store) fn heard_told(&self, _told: &[(crate::model::Provider, i64)]) {}

    /// One process owns a SQLite queue: the in-process waker is enough.
    pub(in crate::store) async fn wake_replicas(
        _tx: &mut <Self as Backend>::Tx,
        _providers: &str,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }

    pub(in crate::store) async fn wake_replicas_after_commit(_pool: &sqlx::SqlitePool) {}
}
