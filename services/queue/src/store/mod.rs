//! The queue's four tables behind one trait. The SQL is written once (`sql`: statements that run on
//! sqlx's transactions and on the SQLite writer's own connection, `direct`) and expanded for each
//! backend; what differs is how a transaction
//! locks (`BEGIN IMMEDIATE` on SQLite; a per-host advisory lock and `FOR UPDATE SKIP LOCKED` on
//! PostgreSQL) and how other replicas are woken (`pg_notify` on PostgreSQL).
//!
//! Each concern's statements are a `macro_rules!` generating `impl $store { ... }` helpers, all
//! expanded at the end of this file for both backends: `admit` (admission one row at a time; the
//! batched path is `crate::admission`), `claims` (claims and leases), `reports` (what lanes report
//! back) and `cleanup` (cleanup and the reads that watch the queue). `backends` holds what differs;
//! `any` the backend chosen at start-up.

mod admit;
mod any;
mod backends;
mod claims;
mod cleanup;
mod direct;
mod gate;
mod quota;
mod records;
mod reports;
mod rounds;
pub(crate) mod sql;

pub use any::AnyQueueStore;
pub use backends::{Backend, PgQueueStore, SqliteQueueStore};
pub use records::{
    ClaimAsk, ClaimedBatch, Cleaned, Completion, Depth, Enqueued, EventRecord, Outcome,
    RecipientRecord, Retry, RetryResult, Round, Skip,
};

// The macros expanded below name most of these: their bodies resolve names here, where expanded.
use std::collections::HashMap;
use std::future::Future;

use base64::Engine as _;
use base64::engine::general_purpose::{self, GeneralPurpose, URL_SAFE_NO_PAD};
use orca_push_storage::Pool;
use rand::RngCore as _;
use sql::{Exec as _, Row as _, Stmt};
use sqlx::Row as _;

use crate::error::QueueError;
use crate::model::{
    Admission, AdmissionRecipient, AdmissionStatus, CLEANUP_BATCH, CLEANUP_BUDGET, Content, Kind,
    MAX_BATCH_MEMBERS, MAX_LIFETIME_MS, Member, PAYLOAD_SWEEP_LAG_MS, PAYLOAD_SWEEP_STEP_MS,
    Provider, QUOTA_PER_KIND, QUOTA_WINDOW_MS, RETENTION_MS, member_bytes, summary_fits,
};
use quota::RoundQuota;
use rounds::Together;

/// Migrations a newer build applied are left alone (`ignore_missing`): the previous build keeps
/// running on a migrated database until traffic moves, and is what a rollback starts again.
static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/queue/sqlite")
};
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/queue/postgres")
};

pub async fn migrate(pool: &Pool) -> Result<(), sqlx::migrate::MigrateError> {
    match pool {
        Pool::Sqlite(p) => SQLITE_MIGRATIONS.run(p).await,
        Pool::Postgres(p) => POSTGRES_MIGRATIONS.run(p).await,
    }
}

/// The channel replicas listen on for newly due work (PostgreSQL).
pub const WAKE_CHANNEL: &str = "orca_push_queue";

/// An unguessable token (a lease's): 18 random bytes, base64url (24 characters). The bytes come
/// from the thread's generator (ChaCha12, seeded and reseeded from the OS), not a system call each.
pub fn random_id() -> String {
    let mut bytes = [0u8; 18];
    rand::thread_rng().fill_bytes(&mut bytes);
    URL_SAFE_NO_PAD.encode(bytes)
}

/// base64url's 64 characters in ASCII order, the order SQLite compares text in, so that an id's
/// text sorts as its bytes do.
const SORTED_ALPHABET: base64::alphabet::Alphabet = match base64::alphabet::Alphabet::new(
    "-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz",
) {
    Ok(alphabet) => alphabet,
    Err(_) => panic!("64 distinct characters"),
};

/// Base64 in `SORTED_ALPHABET`, without padding.
const SORTED: GeneralPurpose = GeneralPurpose::new(&SORTED_ALPHABET, general_purpose::NO_PAD);

/// A new event or batch id: the current Unix millisecond (6 bytes, big-endian), then 12 random
/// bytes, in base64url's characters put in ASCII order (24 characters). An id made later sorts
/// after, so new rows land at the end of the id indexes (the events' and batches' keys, the
/// recipients' key and batch index), where one page takes a round's entries. In base64url's own
/// order ('Z' < 'a' but 'z' > '0') the millisecond's characters wrapped around every 64 ms and a
/// commit wrote some two pages of each such index (docs/benchmarks.md, round 24). 96 random bits
/// keep the ids unguessable; nothing else relies on their order.
pub fn ordered_id() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let mut random = [0u8; 12];
    rand::thread_rng().fill_bytes(&mut random);
    ordered_id_at(ms, random)
}

fn ordered_id_at(ms: u128, random: [u8; 12]) -> String {
    let mut bytes = [0u8; 18];
    bytes[..6].copy_from_slice(&ms.to_be_bytes()[10..]);
    bytes[6..].copy_from_slice(&random);
    SORTED.encode(bytes)
}

pub trait QueueStore: Clone + Send + Sync + 'static {
    /// Admits `group` in one transaction (one commit for all); one result per admission, in order.
    /// If any of them fails, that transaction is rolled back and each is admitted again in its
    /// own, so one bad admission never fails its neighbours.
    /// New batches due at once may be written leased to claims waiting in `handoff`, and handed
    /// to them once their transaction commits.
    fn enqueue_group(
        &self,
        group: &[&Admission],
        now: i64,
        coalesce_ms: i64,
        handoff: Option<&crate::handoff::Handoff>,
    ) -> impl Future<Output = Vec<Result<Enqueued, QueueError>>> + Send;
    /// `claim` (for each of `claims`, in order), `enqueue_group` and `complete` in one
    /// transaction: the claims first take what is due in the table, then the group's new work due
    /// at once as a hand-off would (`handoff`: none, none). One result per admission, in order,
    /// the reports' flags and the claims' batches. If the transaction fails, each is done apart,
    /// as those three would.
    fn write_round(
        &self,
        group: &[&Admission],
        reports: &[Completion],
        claims: &[ClaimAsk],
        now: i64,
        coalesce_ms: i64,
        handoff: Option<&crate::handoff::Handoff>,
    ) -> impl Future<Output = Round> + Send;
    /// Whether reports go through the admission writers' rounds (`write_round`) rather than a
    /// transaction of their own.
    fn reports_in_rounds(&self) -> bool;
    /// Whether lanes' claims go through the admission writers' rounds (`write_round`) rather than
    /// a transaction of their own.
    fn claims_in_rounds(&self) -> bool {
        false
    }
    /// Whether admissions hand new work due at once to waiting claims (`crate::handoff`).
    fn hands_off(&self) -> bool;
    /// How many groups a process may admit at once. One on both backends (SQLite has one writer;
    /// PostgreSQL's one writer on its own thread made larger rounds than several, round 33); its
    /// per-host locks would let several commit side by side, as other replicas' writers do.
    fn group_writers(&self) -> usize;
    /// Whether the writers get a thread of their own (see `group_commit`).
    fn writer_thread(&self) -> bool;
    /// Whether that thread drives its writers' sockets (their connections are opened there).
    fn writer_io(&self) -> bool {
        false
    }
    /// Whether the writers are busy: while they are, a round may keep for the next what it
    /// would otherwise give back (on SQLite the pool's writer connection, `direct`); told they
    /// are not, it gives that back.
    fn writers_busy(&self, _busy: bool) {}
    /// Whether a round may keep anything for the next (`writers_busy`).
    fn keeps_between_rounds(&self) -> bool {
        false
    }
    /// Where a writer's round commits without waiting for the disk, what syncs it before the
    /// round is answered (`orca_push_storage::wal_sync`).
    fn wal_sync(&self) -> Option<&orca_push_storage::WalSync> {
        None
    }
    fn claim(
        &self,
        lane: &str,
        max: i64,
        lease_ms: i64,
        now: i64,
        skip: Skip,
    ) -> impl Future<Output = Result<Vec<ClaimedBatch>, QueueError>> + Send;
    fn next_available_at(
        &self,
        skip: Skip,
    ) -> impl Future<Output = Result<Option<i64>, QueueError>> + Send;
    fn renew(
        &self,
        batch_id: &str,
        token: &str,
        until: i64,
    ) -> impl Future<Output = Result<bool, QueueError>> + Send;
    /// Finishes every batch whose lease still holds, in one transaction; one flag per completion,
    /// in order (false where the lease was lost, and nothing written for it).
    fn complete(
        &self,
        completions: &[Completion],
        now: i64,
    ) -> impl Future<Output = Result<Vec<bool>, QueueError>> + Send;
    #[allow(clippy::too_many_arguments)]
    fn retry(
        &self,
        batch_id: &str,
        token: &str,
        at: i64,
        reason: &str,
        how: Retry,
        now: i64,
    ) -> impl Future<Output = Result<RetryResult, QueueError>> + Send;
    /// Returns once no transaction begun before it holds a lock of `hosts` (every admission round
    /// holds its hosts' locks until it ends) or a row lock of `batches` (a claim holds its
    /// batches'): a round or claim whose commit's answer was lost while the server was still
    /// committing has then ended, and what it wrote can be seen (a statement that looked sooner
    /// would see the rows as they were before, and pass them by). SQLite's one writer has nothing
    /// to wait for: a commit that failed there did not happen.
    fn settle(
        &self,
        hosts: &[&str],
        batches: &[&str],
    ) -> impl Future<Output = Result<(), QueueError>> + Send;
    /// Moves the pending batches of `provider` due before `due_before` to `until`; how many it
    /// moved. Batches already held further out are not written again.
    fn hold(
        &self,
        provider: Provider,
        until: i64,
        due_before: i64,
    ) -> impl Future<Output = Result<u64, QueueError>> + Send;
    /// Makes at most `limit` held batches of `provider` due again, earliest deadline first (not
    /// before their own retry time).
    fn release(
        &self,
        provider: Provider,
        now: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, QueueError>> + Send;
    fn event_record(
        &self,
        host: &str,
        kind: Kind,
        epoch: &str,
        seq: i64,
    ) -> impl Future<Output = Result<Option<EventRecord>, QueueError>> + Send;
    fn depth(&self, now: i64) -> impl Future<Output = Result<Depth, QueueError>> + Send;
    fn cleanup(&self, now: i64) -> impl Future<Output = Result<Cleaned, QueueError>> + Send;
}

fn flag(value: bool) -> i32 {
    i32::from(value)
}

/// The SQL of every operation, expanded once per backend. `$store` provides `begin_group_write`,
/// `begin_claim`, `wake_replicas` and `claim_sql`.
///
/// This is the trait's side: each operation is a helper that `admit`, `claims`, `reports` or
/// `cleanup` generates for `$store`; `backends` defines what `$store` provides.
macro_rules! queue_store {
    ($store:ident) => {
        impl QueueStore for $store {
            async fn enqueue_group(
                &self,
                group: &[&Admission],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&crate::handoff::Handoff>,
            ) -> Vec<Result<Enqueued, QueueError>> {
                self.admit_group(group, now, coalesce_ms, handoff).await.0
            }
            async fn write_round(
                &self,
                group: &[&Admission],
                reports: &[Completion],
                claims: &[ClaimAsk],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&crate::handoff::Handoff>,
            ) -> Round {
                self.admit_and_report(group, reports, claims, now, coalesce_ms, handoff)
                    .await
            }
            fn reports_in_rounds(&self) -> bool {
                Self::REPORTS_IN_ROUNDS
            }
            fn claims_in_rounds(&self) -> bool {
                Self::CLAIMS_IN_ROUNDS
            }
            fn hands_off(&self) -> bool {
                Self::HANDS_OFF
            }
            fn group_writers(&self) -> usize {
                Self::GROUP_WRITERS
            }
            fn writer_thread(&self) -> bool {
                Self::WRITER_THREAD
            }
            fn writer_io(&self) -> bool {
                Self::WRITER_IO
            }
            fn writers_busy(&self, busy: bool) {
                self.keep_between_rounds(busy);
            }
            fn keeps_between_rounds(&self) -> bool {
                Self::KEEPS_BETWEEN_ROUNDS
            }
            async fn claim(
                &self,
                lane: &str,
                max: i64,
                lease_ms: i64,
                now: i64,
                skip: Skip,
            ) -> Result<Vec<ClaimedBatch>, QueueError> {
                self.claim_due(lane, max, lease_ms, now, skip).await
            }
            async fn next_available_at(&self, skip: Skip) -> Result<Option<i64>, QueueError> {
                self.next_due(skip).await
            }
            async fn renew(
                &self,
                batch_id: &str,
                token: &str,
                until: i64,
            ) -> Result<bool, QueueError> {
                self.renew_lease(batch_id, token, until).await
            }
            async fn complete(
                &self,
                completions: &[Completion],
                now: i64,
            ) -> Result<Vec<bool>, QueueError> {
                self.complete_leased(completions, now).await
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
                self.retry_leased(batch_id, token, at, reason, how, now)
                    .await
            }
            async fn settle(&self, hosts: &[&str], batches: &[&str]) -> Result<(), QueueError> {
                self.wait_for_locks(hosts, batches).await
            }
            async fn hold(
                &self,
                provider: Provider,
                until: i64,
                due_before: i64,
            ) -> Result<u64, QueueError> {
                self.hold_provider(provider, until, due_before).await
            }
            async fn release(
                &self,
                provider: Provider,
                now: i64,
                limit: i64,
            ) -> Result<u64, QueueError> {
                self.release_provider(provider, now, limit).await
            }
            async fn event_record(
                &self,
                host: &str,
                kind: Kind,
                epoch: &str,
                seq: i64,
            ) -> Result<Option<EventRecord>, QueueError> {
                self.find_event_record(host, kind, epoch, seq).await
            }
            async fn depth(&self, now: i64) -> Result<Depth, QueueError> {
                self.count_depth(now).await
            }
            async fn cleanup(&self, now: i64) -> Result<Cleaned, QueueError> {
                self.cleanup_pass(now).await
            }
        }
    };
}

// Every macro is expanded here, so the helpers each generates (private inherent methods of the
// two stores) can call one another, and the names their bodies use resolve in this module.
queue_store!(SqliteQueueStore);
queue_store!(PgQueueStore);
admit::row_by_row_admission!(SqliteQueueStore);
admit::row_by_row_admission!(PgQueueStore);
rounds::round_statements!(SqliteQueueStore);
rounds::round_statements!(PgQueueStore);
crate::admission::batched_admission!(SqliteQueueStore);
crate::admission::batched_admission!(PgQueueStore);
claims::claim_statements!(SqliteQueueStore);
claims::claim_statements!(PgQueueStore);
reports::report_statements!(SqliteQueueStore);
reports::report_statements!(PgQueueStore);
cleanup::cleanup_statements!(SqliteQueueStore);
cleanup::cleanup_statements!(PgQueueStore);

#[cfg(test)]
mod tests {
    use super::*;

    fn millis_of(id: &str) -> u64 {
        let bytes = SORTED.decode(id).unwrap();
        bytes[..6].iter().fold(0, |ms, b| ms << 8 | u64::from(*b))
    }

    #[test]
    fn an_id_starts_with_its_millisecond_and_ends_with_random_bytes() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let (a, b) = (ordered_id(), ordered_id());
        assert_eq!((a.len(), b.len()), (24, 24));
        for id in [&a, &b] {
            assert!(millis_of(id).abs_diff(now) < 5_000, "{id}");
            assert!(
                id.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
            );
        }
        // The 16 characters after the 8 of the millisecond are the random bytes.
        assert_ne!(a[8..], b[8..]);
        assert_eq!(random_id().len(), 24);
    }

    /// An id of a later millisecond sorts after any id of an earlier one, whatever their random
    /// bytes, as SQLite compares them (bytewise): in base64url's own alphabet the ids of this
    /// range fall back to a lower place each time a character wraps from 'z' to '0'.
    #[test]
    fn an_id_of_a_later_millisecond_sorts_after() {
        let start: u128 = 1_796_000_000_000;
        let mut last = ordered_id_at(start, [0xff; 12]);
        for ms in (start + 1)..(start + 300_000) {
            let low = ordered_id_at(ms, [0; 12]);
            assert!(low > last, "{ms}: {low} <= {last}");
            last = ordered_id_at(ms, [0xff; 12]);
        }
    }

    /// An in-memory SQLite database with the queue's migrations.
    async fn migrated_sqlite() -> sqlx::SqlitePool {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        SQLITE_MIGRATIONS.run(&pool).await.unwrap();
        pool
    }

    /// The rows of `EXPLAIN QUERY PLAN` (`plan`) or `EXPLAIN` (the program) of `sql`, each of its
    /// parameters (`$N` or `?`) bound to NULL.
    async fn explain(
        pool: &sqlx::SqlitePool,
        sql: &str,
        plan: bool,
    ) -> Vec<sqlx::sqlite::SqliteRow> {
        let explain = format!("EXPLAIN{} {sql}", if plan { " QUERY PLAN" } else { "" });
        let params =
            (1..=8).filter(|n| sql.contains(&format!("${n}"))).count() + sql.matches('?').count();
        let mut query = sqlx::query(&explain);
        for _ in 0..params {
            query = query.bind(None::<String>);
        }
        query.fetch_all(pool).await.unwrap()
    }

    /// The steps of `sql`'s plan that read `push_delivery_batches`, and the whole plan.
    async fn batch_steps(pool: &sqlx::SqlitePool, sql: &str) -> (Vec<String>, Vec<String>) {
        let plan: Vec<String> = explain(pool, sql, true)
            .await
            .iter()
            .map(|row| row.get("detail"))
            .collect();
        let batches = plan
            .iter()
            .filter(|step| step.contains(" push_delivery_batches"))
            .cloned()
            .collect();
        (batches, plan)
    }

    /// The quota ledger's reads (`quota`) seek into `push_events_accepted` from the window's
    /// start: they run inside the writer's round, which must not read the day's events. The index
    /// the ledger replaced is gone.
    #[tokio::test]
    async fn sqlite_reads_the_quota_window_by_acceptance_time() {
        let pool = migrated_sqlite().await;
        for sql in [quota::LOAD_SQL, quota::COUNT_SQL] {
            let plan: Vec<String> = explain(&pool, sql, true)
                .await
                .iter()
                .map(|row| row.get("detail"))
                .collect();
            assert!(
                plan.iter()
                    .any(|step| step.contains("INDEX push_events_accepted (accepted_at>?)")),
                "{sql}\n{plan:#?}"
            );
        }
        let quota_index: Option<String> =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE name = 'push_events_quota'")
                .fetch_optional(&pool)
                .await
                .unwrap();
        assert_eq!(quota_index, None);
    }

    /// Every statement that finds batches by registration reads the index of live batches:
    /// SQLite takes a partial index only for a query that states the index's condition word for
    /// word, so a statement that names fewer states would scan the table instead.
    #[tokio::test]
    async fn statements_finding_batches_by_registration_use_the_live_batches_index() {
        use crate::admission as batch;
        let pool = migrated_sqlite().await;
        let windows = format!(
            "{}0{}32{} IN ('r')",
            batch::READ_WINDOWS_HEAD,
            batch::READ_WINDOWS_FULL,
            batch::READ_WINDOWS_LIST
        );
        let lock = format!(
            "{} IN ('r') ORDER BY batch_id",
            admit::LOCK_ACTIVE_BATCHES_HEAD
        );
        for sql in [
            admit::OPEN_WINDOW_SQL,
            &windows,
            &lock,
            admit::CANCEL_COVERED_SQL,
            admit::RECOUNT_MEMBERS_SQL,
            admit::CANCEL_EMPTY_SQL,
        ] {
            let (batches, plan) = batch_steps(&pool, sql).await;
            assert!(
                !batches.is_empty()
                    && batches
                        .iter()
                        .all(|step| step.contains("USING INDEX push_delivery_batches_live")),
                "{sql}\n{plan:#?}"
            );
        }
    }

    /// The statements that look for live batches by provider or deadline (a provider's hold and
    /// release, the clean-up's overdue read) read an index of live batches: naming only some of
    /// the live states, SQLite read every batch kept for the day, in its one writer's rounds.
    #[tokio::test]
    async fn sqlite_reads_live_batches_by_provider_or_deadline_from_an_index() {
        let pool = migrated_sqlite().await;
        for sql in [
            reports::HOLD_SQL,
            reports::RELEASE_SQL,
            cleanup::OVERDUE_SQL,
        ] {
            let (batches, plan) = batch_steps(&pool, sql).await;
            assert!(
                !batches.is_empty() && batches.iter().all(|step| step.contains("USING INDEX")),
                "{sql}\n{plan:#?}"
            );
        }
    }

    /// A claim and the earliest-due read seek each provider they take in the due index (provider,
    /// then time): keyed by time alone, a lane leaving a held provider alone read every due batch
    /// of it to reach another's (round 47, docs/benchmarks.md).
    #[tokio::test]
    async fn sqlite_reads_each_providers_due_batches_by_seek() {
        let pool = migrated_sqlite().await;
        for apns in [false, true] {
            for fcm in [false, true] {
                let skip = Skip { apns, fcm };
                let taken = Provider::ALL.iter().filter(|p| skip.takes(**p)).count();
                let next_due = claims::next_due_sql(skip);
                for sql in [SqliteQueueStore::claim_sql(skip), next_due.as_str()] {
                    let (batches, plan) = batch_steps(&pool, sql).await;
                    assert_eq!(batches.len(), taken, "{sql}\n{plan:#?}");
                    assert!(
                        batches.iter().all(|step| step.contains(
                            "USING INDEX push_delivery_batches_due (provider=? AND available_at"
                        )),
                        "{sql}\n{plan:#?}"
                    );
                }
            }
        }
    }
}
