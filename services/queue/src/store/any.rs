//! `AnyQueueStore`: the backend chosen at start-up, each call traced as a database span.

use super::*;

/// Either backend, chosen at start-up.
#[derive(Debug, Clone)]
pub enum AnyQueueStore {
    Sqlite(SqliteQueueStore),
    Postgres(PgQueueStore),
}

impl AnyQueueStore {
    pub fn new(pool: Pool) -> Self {
        match pool {
            Pool::Sqlite(p) => Self::Sqlite(SqliteQueueStore::new(p)),
            Pool::Postgres(p) => Self::Postgres(PgQueueStore::new(p)),
        }
    }

    /// The connection pools behind this store, for the pool gauges.
    pub fn pools(&self) -> orca_push_storage::StorePools {
        match self {
            Self::Sqlite(s) => orca_push_storage::StorePools::sqlite(&s.pool, &s.readers),
            Self::Postgres(s) => {
                orca_push_storage::StorePools::postgres(&s.pool).with_postgres("rounds", &s.rounds)
            }
        }
    }

    /// PostgreSQL: the pool the admission writers' rounds run on (`PgQueueStore::rounds`).
    pub fn rounds_pool(&self) -> Option<&sqlx::PgPool> {
        match self {
            Self::Sqlite(_) => None,
            Self::Postgres(s) => Some(&s.rounds),
        }
    }

    /// Groups admitted on the batched path of `crate::admission` so far.
    pub fn batched_groups(&self) -> u64 {
        let counter = match self {
            Self::Sqlite(s) => &s.batched_groups,
            Self::Postgres(s) => &s.batched_groups,
        };
        counter.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Syncs the WAL of a SQLite writer that commits at NORMAL with `sync` (tests hold or fail it
    /// there); nothing on PostgreSQL, whose commits are synced as they are made.
    pub fn with_wal_sync(self, sync: orca_push_storage::WalSync) -> Self {
        match self {
            Self::Sqlite(mut s) => {
                s.wal_sync = Some(std::sync::Arc::new(sync));
                Self::Sqlite(s)
            }
            postgres => postgres,
        }
    }

    /// Admits every group one statement at a time, never on the batched path of
    /// `crate::admission`: the path the batched one must agree with, kept for the tests that
    /// compare the two and to measure against.
    pub fn row_by_row(self) -> Self {
        match self {
            Self::Sqlite(mut s) => {
                s.row_by_row = true;
                Self::Sqlite(s)
            }
            Self::Postgres(mut s) => {
                s.row_by_row = true;
                Self::Postgres(s)
            }
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $target:ident . $method:ident ( $($arg:expr),* )) => {{
        use tracing::Instrument as _;
        match $self {
            AnyQueueStore::Sqlite($s) => $target.$method($($arg),*)
                .instrument(orca_push_storage::db_span("sqlite", stringify!($method)))
                .await,
            AnyQueueStore::Postgres($s) => $target.$method($($arg),*)
                .instrument(orca_push_storage::db_span("postgresql", stringify!($method)))
                .await,
        }
    }};
}

impl QueueStore for AnyQueueStore {
    async fn enqueue_group(
        &self,
        group: &[&Admission],
        now: i64,
        coalesce_ms: i64,
        handoff: Option<&crate::handoff::Handoff>,
    ) -> Vec<Result<Enqueued, QueueError>> {
        delegate!(self, s => s.enqueue_group(group, now, coalesce_ms, handoff))
    }
    fn writer_thread(&self) -> bool {
        match self {
            Self::Sqlite(s) => s.writer_thread(),
            Self::Postgres(s) => s.writer_thread(),
        }
    }
    fn writer_io(&self) -> bool {
        match self {
            Self::Sqlite(s) => s.writer_io(),
            Self::Postgres(s) => s.writer_io(),
        }
    }
    fn keeps_between_rounds(&self) -> bool {
        match self {
            Self::Sqlite(s) => s.keeps_between_rounds(),
            Self::Postgres(s) => s.keeps_between_rounds(),
        }
    }
    fn writers_busy(&self, busy: bool) {
        match self {
            Self::Sqlite(s) => s.writers_busy(busy),
            Self::Postgres(s) => s.writers_busy(busy),
        }
    }
    fn wal_sync(&self) -> Option<&orca_push_storage::WalSync> {
        match self {
            Self::Sqlite(s) => s.wal_sync.as_deref(),
            Self::Postgres(_) => None,
        }
    }
    async fn write_round(
        &self,
        group: &[&Admission],
        reports: &[Completion],
        claims: &[super::ClaimAsk],
        now: i64,
        coalesce_ms: i64,
        handoff: Option<&crate::handoff::Handoff>,
    ) -> Round {
        delegate!(self, s => s.write_round(group, reports, claims, now, coalesce_ms, handoff))
    }
    fn reports_in_rounds(&self) -> bool {
        match self {
            Self::Sqlite(s) => s.reports_in_rounds(),
            Self::Postgres(s) => s.reports_in_rounds(),
        }
    }
    fn claims_in_rounds(&self) -> bool {
        match self {
            Self::Sqlite(s) => s.claims_in_rounds(),
            Self::Postgres(s) => s.claims_in_rounds(),
        }
    }
    fn hands_off(&self) -> bool {
        match self {
            Self::Sqlite(s) => s.hands_off(),
            Self::Postgres(s) => s.hands_off(),
        }
    }
    fn group_writers(&self) -> usize {
        match self {
            Self::Sqlite(s) => s.group_writers(),
            Self::Postgres(s) => s.group_writers(),
        }
    }
    async fn claim(
        &self,
        lane: &str,
        max: i64,
        lease_ms: i64,
        now: i64,
        skip: Skip,
    ) -> Result<Vec<ClaimedBatch>, QueueError> {
        delegate!(self, s => s.claim(lane, max, lease_ms, now, skip))
    }
    async fn next_available_at(&self, skip: Skip) -> Result<Option<i64>, QueueError> {
        delegate!(self, s => s.next_available_at(skip))
    }
    async fn renew(&self, batch_id: &str, token: &str, until: i64) -> Result<bool, QueueError> {
        delegate!(self, s => s.renew(batch_id, token, until))
    }
    async fn complete(
        &self,
        completions: &[Completion],
        now: i64,
    ) -> Result<Vec<bool>, QueueError> {
        delegate!(self, s => s.complete(completions, now))
    }
    async fn retry(
        &self,
        batch_id: &str,
        token: &str,
        at: i64,
        reason: &str,
        how: Retry,
        now: i64,
    ) -> Result<RetryResult, QueueError> {
        delegate!(self, s => s.retry(batch_id, token, at, reason, how, now))
    }
    async fn settle(&self, hosts: &[&str], batches: &[&str]) -> Result<(), QueueError> {
        delegate!(self, s => s.settle(hosts, batches))
    }
    async fn hold(
        &self,
        provider: Provider,
        until: i64,
        due_before: i64,
    ) -> Result<u64, QueueError> {
        delegate!(self, s => s.hold(provider, until, due_before))
    }
    async fn release(&self, provider: Provider, now: i64, limit: i64) -> Result<u64, QueueError> {
        delegate!(self, s => s.release(provider, now, limit))
    }
    async fn event_record(
        &self,
        host: &str,
        kind: Kind,
        epoch: &str,
        seq: i64,
    ) -> Result<Option<EventRecord>, QueueError> {
        delegate!(self, s => s.event_record(host, kind, epoch, seq))
    }
    async fn depth(&self, now: i64) -> Result<Depth, QueueError> {
        delegate!(self, s => s.depth(now))
    }
    async fn cleanup(&self, now: i64) -> Result<Cleaned, QueueError> {
        delegate!(self, s => s.cleanup(now))
    }
}
