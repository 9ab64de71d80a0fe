//! PostgreSQL's side of `super`: rounds that lock their hosts in their `BEGIN`, lanes that plan by
//! key, and notifications that wake other replicas.

use super::Backend;
use crate::error::QueueError;
use crate::model::Admission;
use crate::store::WAKE_CHANNEL;

/// A lane's transaction on PostgreSQL (`PgQueueStore::begin_claim`): it plans by key.
macro_rules! begin_by_key {
    () => {
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; \
         SET LOCAL enable_mergejoin = off; SET LOCAL plan_cache_mode = force_generic_plan"
    };
}

/// `PgQueueStore::LOCK_HOSTS_SQL` up to the hosts' array, then the array and `lock_hosts_tail!`.
macro_rules! lock_hosts_head {
    () => {
        "SELECT \
         set_config('plan_cache_mode', 'force_generic_plan', true), \
         set_config('orca_push.quota_use', 'written', true), \
         set_config('enable_seqscan', 'off', true), \
         set_config('enable_hashjoin', 'off', true), \
         set_config('enable_mergejoin', 'off', true), \
         (SELECT COUNT(pg_advisory_xact_lock(k)) FROM \
          (SELECT DISTINCT hashtextextended('push_events:' || h, 0) AS k \
           FROM UNNEST("
    };
}

macro_rules! lock_hosts_tail {
    () => {
        "::text[]) AS h ORDER BY k) AS keys)"
    };
}

// A report's row locks (the batches', then their events', each in id order, which keep it from
// deadlocking a dismissal or another report) are taken in `push_finish_batches` alone: the
// statements `reports` would send instead take none.
const _: () = assert!(
    PgQueueStore::FINISHES_BY_CALL,
    "PostgreSQL's reports must finish their batches through push_finish_batches"
);

// `PgQueueStore::end_failed_begin` ends an aborted transaction with a `ROLLBACK` on the rounds'
// pool, which reaches the connection that failed only while that pool holds one connection.
const _: () = assert!(
    PgQueueStore::GROUP_WRITERS == 1,
    "end_failed_begin must roll back on the connection that failed"
);

/// The longest host fingerprint written into a round's `BEGIN` as a literal
/// (`begin_locking_hosts`); the contract's are 16 characters.
const INLINE_HOST_AT_MOST: usize = 64;

/// `BEGIN` and `PgQueueStore::LOCK_HOSTS_SQL` as one simple query, with `hosts` written in it as
/// literals: one round trip where the two statements took two. `None` unless every host is made
/// only of the characters of a base64url fingerprint (letters, digits, `-`, `_`), which can
/// neither end a literal nor escape from one; the round then binds them as before.
fn begin_locking_hosts(hosts: &[&str]) -> Option<String> {
    let safe = |host: &str| {
        !host.is_empty()
            && host.len() <= INLINE_HOST_AT_MOST
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if hosts.is_empty() || !hosts.iter().all(|host| safe(host)) {
        return None;
    }
    let mut sql = String::with_capacity(420 + hosts.len() * (INLINE_HOST_AT_MOST + 3));
    sql.push_str(concat!("BEGIN; ", lock_hosts_head!(), "ARRAY["));
    for (i, host) in hosts.iter().enumerate() {
        if i > 0 {
            sql.push(',');
        }
        sql.push('\'');
        sql.push_str(host);
        sql.push('\'');
    }
    sql.push(']');
    sql.push_str(lock_hosts_tail!());
    Some(sql)
}

/// Wakes every replica's waiting lanes once the transaction it runs in commits (PostgreSQL).
const NOTIFY_SQL: &str = "SELECT pg_notify($1, $2)";

/// PostgreSQL (READ COMMITTED), shared by every replica: admissions of one host serialise on a
/// transaction advisory lock, claims skip rows another replica has locked, and a commit that makes
/// work due notifies every replica's waiting lanes.
#[derive(Debug, Clone)]
pub struct PgQueueStore {
    pub(in crate::store) pool: sqlx::PgPool,
    /// The admission writer's connection (one per writer, at most `pool`'s bound), opened by the
    /// writer on its own thread (`WRITER_THREAD`), so that thread's runtime drives its socket.
    /// Beside `pool`, not out of it.
    pub(in crate::store) rounds: sqlx::PgPool,
    pub(in crate::store) readers: sqlx::PgPool,
    pub(in crate::store) row_by_row: bool,
    /// Groups admitted on the batched path (see `AnyQueueStore::batched_groups`).
    pub(in crate::store) batched_groups: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Signs this replica's notifications, so that its listener skips their echo
    /// (`crate::wake::payload_from`).
    pub(in crate::store) origin: std::sync::Arc<str>,
    /// What its rounds have told other replicas (`crate::wake::Told`).
    pub(in crate::store) told: std::sync::Arc<std::sync::Mutex<crate::wake::Told>>,
    /// Where the clean-up's payload sweep ended.
    pub(in crate::store) payload_sweep: std::sync::Arc<crate::store::cleanup::PayloadSweep>,
}

impl Backend for PgQueueStore {
    type Db = sqlx::Postgres;
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;
}

impl PgQueueStore {
    /// A claim of the work `skip` takes (`claims::claim_sql`): `available_at >= 0` opens
    /// `push_delivery_batches_due` (queue migrations 0007 and 0009), and each provider's read
    /// locks its rows, skipping those another replica's claim holds.
    pub(in crate::store) fn claim_sql(skip: crate::store::Skip) -> &'static str {
        static CLAIMS: std::sync::LazyLock<crate::store::claims::PerSkip> =
            std::sync::LazyLock::new(|| {
                crate::store::claims::PerSkip::new(|skip| {
                    crate::store::claims::claim_sql(
                        skip,
                        " AND available_at >= 0",
                        " FOR UPDATE SKIP LOCKED",
                    )
                })
            });
        CLAIMS.get(skip)
    }
    /// Row locks taken by a reading statement.
    pub(in crate::store) const FOR_UPDATE: &'static str = " FOR UPDATE";
    /// A kept statement's generic plan is made once per connection, often on small tables: reads
    /// that must find their rows by key run in a transaction that plans so (`begin_claim`).
    pub(in crate::store) const PLANS_KEPT: bool = true;
    /// Built statements' parameters are `$N` (`sql::Stmt`).
    pub(in crate::store) const NUMBERED: bool = true;
    /// PostgreSQL has no conflict clause: a failed statement fails its transaction.
    pub(in crate::store) const OR_FAIL: &'static str = "";
    /// After the quota count's window start: the condition that opens `push_events_quota` to it
    /// (queue migration 0008), always true of a time.
    pub(in crate::store) const QUOTA_BY_TIME: &'static str = " AND q.accepted_at >= 0";
    /// Each host's quota use is kept in `push_quota_use` (queue migration 0010): a round writes
    /// its hosts' rows with their events, the table's trigger those of any other insert, and the
    /// clean-up deletes the rows no admission reads any more. Counting a host's events in the
    /// window instead visited each in the heap: a third of the admission writer's server time at 64
    /// connections (round 51, docs/benchmarks.md).
    pub(in crate::store) const QUOTA_USE_ROWS: bool = true;
    /// Final answers in one call of `push_finish_batches` (queue migration 0011,
    /// `crate::store::reports::call`): a report flush is one round trip, not seven.
    pub(in crate::store) const FINISHES_BY_CALL: bool = true;

    pub fn new(pool: sqlx::PgPool) -> Self {
        let readers = orca_push_storage::ReadPool::readers(&pool);
        // Lazy: a connection is opened by the first round that needs it, on the writers' thread.
        let rounds = orca_push_storage::postgres_pool_options()
            .max_connections(
                u32::try_from(Self::GROUP_WRITERS)
                    .unwrap_or(u32::MAX)
                    .min(pool.options().get_max_connections()),
            )
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with((*pool.connect_options()).clone());
        Self {
            pool,
            rounds,
            readers,
            row_by_row: false,
            batched_groups: Default::default(),
            origin: crate::store::random_id().into(),
            told: std::sync::Arc::default(),
            payload_sweep: std::sync::Arc::default(),
        }
    }

    /// A round's quota counts: its statements count them, under the hosts' locks.
    pub(in crate::store) fn round_quota(&self) -> crate::store::RoundQuota {
        crate::store::RoundQuota::Sql {
            by_time: Self::QUOTA_BY_TIME,
        }
    }

    /// What signs this replica's notifications (`crate::wake::payload_from`).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// What this replica's rounds have told other replicas, for the next round to tell only news.
    pub(in crate::store) fn told(&self) -> crate::wake::Told {
        *self
            .told
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A round that told `told` has committed.
    pub(in crate::store) fn heard_told(&self, told: &[(crate::model::Provider, i64)]) {
        if !told.is_empty() {
            self.told
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .heard(told);
        }
    }

    /// Where reads outside a transaction go.
    pub(in crate::store) fn reader(&self) -> &sqlx::PgPool {
        &self.readers
    }

    pub fn pool(&self) -> &sqlx::PgPool {
        &self.pool
    }

    /// A group's statements bind more than a few rows as arrays (`Stmt::push_values`,
    /// `Stmt::push_in`, `sql::TUPLES_UP_TO`), so each has at most five texts: every one is kept
    /// prepared (sqlx keeps the 100 most recently used per connection), and the group's
    /// transaction plans each once (`LOCK_HOSTS_SQL`). Profiled at 8 connections, the
    /// server planned the seen read on every call, 0.22 ms of planning against 0.03 ms of
    /// executing. While each number of rows was a text of its own, only those of up to 8 rows
    /// were kept (sqlx keeps 100 statements per connection and closes the least recently used
    /// past that), and the rest were parsed and planned on every run: at 100 end-to-end flows,
    /// planning was a fifth of the server's CPU (round 30, docs/benchmarks.md).
    pub(in crate::store) const KEEP_ROWS_AT_MOST: Option<usize> = Some(usize::MAX);
    /// A batched round's recipients' insert also notifies other replicas (`wake_replicas`'s
    /// `pg_notify`, sent with the commit all the same): one round trip fewer a round.
    pub(in crate::store) const WAKES_IN_WRITES: bool = true;
    /// Other replicas share the database and are told of new work (`wake_replicas`).
    pub(in crate::store) const TELLS_REPLICAS: bool = true;
    /// One, on a thread of its own (`WRITER_THREAD`): its rounds follow each other, each taking
    /// everything waiting (up to `MAX_GROUP`), so every admission pays a share of one round's
    /// round trips. Other replicas' writers still commit beside it; a host's admissions serialise
    /// on its lock. Four writers side by side on that thread split the load into rounds a third the
    /// size (19 admissions a round against 55 at 1,000 end-to-end flows), each paying the server
    /// its round trips, and 1,000-flow deliveries fell 5%. One against two, four runs each: 14% /
    /// 25% / 24% more admissions at 8 / 32 / 64 connections, 7% more deliveries at 1,000 flows,
    /// even at 100 (docs/benchmarks.md, round 33). Before the thread there were four, and rounds
    /// of fewer than 8 gathered while another committed (`crate::group_commit`).
    pub(in crate::store) const GROUP_WRITERS: usize = 1;
    /// Reports keep transactions of their own: in a round they would take batch row locks after
    /// the round's host locks and a dismissal's batch locks, an order two rounds could each hold
    /// half of (every replica has a writer); and reports run beside the rounds.
    pub(in crate::store) const REPORTS_IN_ROUNDS: bool = false;
    /// Claims run beside the admissions on connections of their own, as reports do.
    pub(in crate::store) const CLAIMS_IN_ROUNDS: bool = false;
    /// New work due at once goes to waiting claims (`crate::handoff`): +4.4% APNs deliveries at
    /// 100 flows and +6.4% in split mode in round 40, even at 1,000 flows (docs/benchmarks.md;
    /// rounds 7, 31, 34 and 35 had measured it even, 39 +3-8%). What PostgreSQL adds to it: a
    /// commit whose answer is lost with its connection may have committed (or still be committing)
    /// batches leased to claims that will never hear of them, so a failed commit gives them back
    /// under their tokens once their hosts' locks are free (`rounds`, `crate::handoff::hand_back`);
    /// orphans are given back on the
    /// queue's runtime, not the writer's (`crate::handoff::give_back`); and an admission whose work
    /// was all handed wakes no one (`crate::admission::Plan::leave_handed_undue`).
    pub(in crate::store) const HANDS_OFF: bool = true;
    /// The writers run on a thread of their own, over connections of their own opened there
    /// (`rounds`), so a statement's answer wakes that thread rather than waiting for the main
    /// runtime to reach the writer's task behind every ready request. A round is some eight round
    /// trips: on the main runtime, at 100 end-to-end flows, an admission took 10-12 ms to answer
    /// at the median, 7.5-8.5 ms on the thread (docs/benchmarks.md, round 33).
    pub(in crate::store) const WRITER_THREAD: bool = true;
    /// The writers' thread drives the sockets of their connections (`rounds`).
    pub(in crate::store) const WRITER_IO: bool = true;
    pub(in crate::store) const KEEPS_BETWEEN_ROUNDS: bool = false;

    /// A round keeps nothing for the next.
    pub(in crate::store) fn keep_between_rounds(&self, _keep: bool) {}

    /// The pool for a write outside the rounds.
    pub(in crate::store) fn writes(&self) -> &sqlx::PgPool {
        &self.pool
    }
    /// Every host's transaction lock, in one order (the lock keys'), so two groups naming the same
    /// hosts never each hold what the other waits for. In the same round trip, the rest of the
    /// transaction uses generic plans: a kept statement is then planned once per connection, where
    /// PostgreSQL's own choice re-planned the group's reads on every call (its generic estimate
    /// for a list of rows is worse than the custom plan for one row).
    ///
    /// A plan made once lasts as long as the connection (or until an `ANALYZE` of its tables), so
    /// it must not depend on how full the tables were when it was made. Made on new, nearly empty
    /// tables (a fresh deployment, every benchmark run), the seen read's plan scanned the whole
    /// of `push_events` into a hash for every group, some 2.8 ms a call at 64 connections once the
    /// table held a few thousand events (round 28, docs/benchmarks.md). A round's statements find
    /// their rows through indexes (by key, or a host's or phone's range), so its transaction plans
    /// without sequential scans, hash joins or merge joins: the batched statements become a loop
    /// over the group's rows with an index probe per row, however the tables grow.
    /// `set_config(.., true)` lasts until the transaction ends, so transactions begun otherwise
    /// on the same connection (claims, clean-up, reports outside the writer's rounds) plan as
    /// before.
    ///
    /// It also tells `push_quota_use`'s trigger (queue migration 0010) that the round writes its
    /// hosts' rows itself, with its events (`crate::admission::QUOTA_USE_HEAD`,
    /// `crate::admission::QUOTA_USE_ROW_HEAD`): the trigger writes them for any other insert.
    const LOCK_HOSTS_SQL: &'static str = concat!(lock_hosts_head!(), "$1", lock_hosts_tail!());

    /// A round's transaction, its hosts locked (`LOCK_HOSTS_SQL`). Fingerprints as the contract
    /// makes them go in `BEGIN`'s own round trip (`begin_locking_hosts`): a round is a chain of
    /// round trips that each admission in it waits for, one after another.
    pub(in crate::store) async fn begin_group_write(
        &self,
        group: &[&Admission],
    ) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        let hosts: Vec<&str> = group.iter().map(|a| a.host_fingerprint.as_str()).collect();
        let inline = begin_locking_hosts(&hosts);
        let locked = inline.is_some();
        let began = match inline {
            Some(begin) => self.rounds.begin_with(begin).await,
            None => self.rounds.begin().await,
        };
        let mut tx = match began {
            Ok(tx) => tx,
            Err(error) => {
                if matches!(error, sqlx::Error::Database(_))
                    && !crate::error::connection_lost(&error)
                {
                    self.end_failed_begin().await;
                }
                return Err(error);
            }
        };
        if locked {
            return Ok(tx);
        }
        sqlx::query(Self::LOCK_HOSTS_SQL)
            .bind(hosts)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    /// `QueueStore::settle`: takes the batches' rows shared (`SHARE_BATCHES_SQL`), then the
    /// hosts' locks (`LOCK_HOSTS_SQL`), each in a transaction of its own that waits for whatever
    /// holds them and lets them go; nothing is written. Apart, so that a wait for a claim's rows
    /// (which a transaction whose client is gone may hold for long) never holds hosts' locks that
    /// admissions need; and each wait ends on the server too (`lock_timeout`), not only on the
    /// caller's side, as `handoff::hand_back` gives up.
    pub(in crate::store) async fn wait_for_locks(
        &self,
        hosts: &[&str],
        batches: &[&str],
    ) -> Result<(), QueueError> {
        for (sql, keys) in [
            (Self::SHARE_BATCHES_SQL, batches),
            (Self::LOCK_HOSTS_SQL, hosts),
        ] {
            if keys.is_empty() {
                continue;
            }
            let mut tx = self.pool.begin().await?;
            sqlx::query(Self::SETTLE_LOCK_TIMEOUT_SQL)
                .execute(&mut *tx)
                .await?;
            sqlx::query(sql).bind(keys).execute(&mut *tx).await?;
            tx.rollback().await?;
        }
        Ok(())
    }

    /// Waits for the transactions that hold the batches' rows (a claim's), then holds them
    /// shared until the caller's transaction ends.
    const SHARE_BATCHES_SQL: &'static str =
        "SELECT 1 FROM push_delivery_batches WHERE batch_id = ANY($1) FOR SHARE";

    /// A settling wait's limit on the server (`handoff::SETTLE_AT_MOST`, 30 s), unless the
    /// operator set one (which may be shorter).
    const SETTLE_LOCK_TIMEOUT_SQL: &'static str = "SELECT set_config('lock_timeout', '30s', true) \
         WHERE current_setting('lock_timeout') = '0'";

    /// After a round's `BEGIN` that the server refused on a live connection: its locks failed (a
    /// `lock_timeout` or `statement_timeout` the operator set, a cancelled wait), or an earlier
    /// such failure left the connection in an aborted transaction. sqlx, whose `BEGIN` failed,
    /// holds no transaction and gave the connection back as it was, where every later round
    /// would fail on it ("current transaction is aborted"). A `ROLLBACK` on the rounds' pool ends
    /// it: that pool holds one connection, the one writer's (asserted beside `begin_locking_hosts`),
    /// the one that failed. Best effort: if it fails, the next round's `BEGIN` fails and comes here again.
    /// Not after a lost connection: the pool closes that one, and a `ROLLBACK` would wait for a
    /// new connection to a server that may still be down.
    async fn end_failed_begin(&self) {
        if let Err(error) = sqlx::raw_sql("ROLLBACK").execute(&self.rounds).await {
            tracing::warn!(%error, "could not end a round's failed transaction");
        }
    }

    /// A lane's transaction (a claim, a retry, a provider's hold, a report flush naming a batch
    /// twice; other flushes are one call of `push_finish_batches`, whose own settings plan as
    /// these do):
    /// `BEGIN`, in the same round trip planning as a group's transaction does (`LOCK_HOSTS_SQL`),
    /// without sequential scans, hash joins or merge joins. Its statements find their rows by key
    /// (a batch, its recipients, their events), but PostgreSQL's own plan choice, made on the
    /// nearly empty tables of a fresh deployment and kept, scanned them whole: at 100 end-to-end
    /// flows a 3 s run read 1.2 million recipient rows in 724 sequential scans of a table of
    /// 3,556 (the payload clean-up's `NOT EXISTS`, 1.3-5 ms a call; round 29, docs/benchmarks.md).
    pub(in crate::store) async fn begin_claim(&self) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        self.pool.begin_with(Self::BEGIN_BY_KEY_SQL).await
    }

    /// A lane's claim: `begin_claim`'s transaction, whose commit does not wait for the WAL to
    /// reach the disk, nor for a synchronous standby (`synchronous_commit` off for it alone). A
    /// lease needs no sync: lost in a crash or a fail-over, its batch is due again and is claimed
    /// again, at worst delivered twice, as on SQLite, whose writer answers claims at the commit,
    /// before the sync. What else a claim writes follows from the time and the table (a batch past
    /// its deadline expired, a fenced member cancelled, their payloads cleared): lost, the next
    /// claim writes it again, though a status read in between shows it pending again. The next
    /// synchronous commit (a round, a delivery's report) flushes the WAL up to and past it, so a
    /// report on disk never outlives its lease. Sampled at 100 end-to-end flows, waiting for a WAL
    /// flush at `COMMIT` was what the server's busy connections did most; a claim's is in the path
    /// from a send's commit to its provider request. Unsynced leases gave 7-12% more deliveries at
    /// 1,000 flows, where claims are most numerous, and 2% at 100 (round 34, docs/benchmarks.md).
    pub(in crate::store) async fn begin_lease(&self) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        self.pool.begin_with(Self::BEGIN_LEASE_SQL).await
    }

    /// `SET LOCAL` lasts until the transaction ends. One simple query, so one round trip, as a
    /// plain `BEGIN` is. Generic plans, as a group's transaction makes (`LOCK_HOSTS_SQL`): each
    /// kept statement is then planned once per connection, where PostgreSQL's own choice planned
    /// the claims' and reports' statements again on most runs.
    const BEGIN_BY_KEY_SQL: &'static str = begin_by_key!();

    /// `BEGIN_BY_KEY_SQL`, committed without waiting for the disk (`begin_lease`).
    const BEGIN_LEASE_SQL: &'static str =
        concat!(begin_by_key!(), "; SET LOCAL synchronous_commit = off");

    /// `providers`: the payload naming whose work (`crate::wake::payload_naming`; empty: anyone's).
    pub(in crate::store) async fn wake_replicas(
        tx: &mut <Self as Backend>::Tx,
        providers: &str,
    ) -> Result<(), sqlx::Error> {
        use crate::store::sql::Exec as _;
        tx.run(
            crate::store::sql::Stmt::new(NOTIFY_SQL)
                .bind(WAKE_CHANNEL)
                .bind(providers),
        )
        .await?;
        Ok(())
    }

    /// `wake_replicas` for a write that committed on its own.
    /// After a write that committed on its own: a failure here is logged, not returned, since
    /// the write stands (its caller would otherwise take a committed retry for a failed one);
    /// other replicas then find the work at their next look, within a claim's wait.
    pub(in crate::store) async fn wake_replicas_after_commit(pool: &sqlx::PgPool) {
        if let Err(error) = sqlx::query(NOTIFY_SQL)
            .bind(WAKE_CHANNEL)
            .bind("")
            .execute(pool)
            .await
        {
            tracing::warn!(%error, "could not tell the other replicas of work due");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::begin_locking_hosts;

    #[test]
    fn fingerprints_go_in_the_begin_as_literals() {
        let sql = begin_locking_hosts(&["hostAAAA-_09zZ", "b"]).unwrap();
        assert!(sql.starts_with("BEGIN; SELECT"), "{sql}");
        assert!(
            sql.contains("UNNEST(ARRAY['hostAAAA-_09zZ','b']::text[])"),
            "{sql}"
        );
        assert!(sql.contains("pg_advisory_xact_lock(k)"), "{sql}");
    }

    #[test]
    fn a_host_no_literal_may_hold_is_left_to_a_bound_parameter() {
        for odd in [
            "it's",
            "back\\slash",
            "two words",
            "é",
            "",
            "a;b",
            &"x".repeat(65),
        ] {
            assert_eq!(begin_locking_hosts(&["hostAAAA", odd]), None, "{odd:?}");
        }
        assert_eq!(begin_locking_hosts(&[]), None);
        assert!(begin_locking_hosts(&[&"x".repeat(64)]).is_some());
    }
}
