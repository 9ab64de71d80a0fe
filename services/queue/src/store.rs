//! The queue's four tables behind one trait. The SQL is written once (`$N` parameters bind the same
//! way on SQLite and PostgreSQL) and expanded for each backend; what differs is how a transaction
//! locks (`BEGIN IMMEDIATE` on SQLite; a per-host advisory lock and `FOR UPDATE SKIP LOCKED` on
//! PostgreSQL) and how other replicas are woken (`pg_notify` on PostgreSQL).

use std::collections::HashMap;
use std::future::Future;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use orca_push_storage::Pool;
use rand::RngCore as _;
use sqlx::Row as _;

use crate::error::QueueError;
use crate::model::{
    Admission, AdmissionRecipient, AdmissionStatus, CLEANUP_BATCH, CLEANUP_BUDGET,
    CLEANUP_PAYLOAD_ROUNDS, Content, Kind, MAX_BATCH_MEMBERS, MAX_LIFETIME_MS, Member, Provider,
    QUOTA_PER_KIND, QUOTA_WINDOW_MS, RETENTION_MS, member_bytes, summary_fits,
};

static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/queue/sqlite");
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator =
    sqlx::migrate!("../../migrations/queue/postgres");

pub async fn migrate(pool: &Pool) -> Result<(), sqlx::migrate::MigrateError> {
    match pool {
        Pool::Sqlite(p) => SQLITE_MIGRATIONS.run(p).await,
        Pool::Postgres(p) => POSTGRES_MIGRATIONS.run(p).await,
    }
}

/// The channel replicas listen on for newly due work (PostgreSQL).
pub const WAKE_CHANNEL: &str = "orca_push_queue";

pub fn random_id() -> String {
    let mut bytes = [0u8; 18];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    URL_SAFE_NO_PAD.encode(bytes)
}

/// What an admission did.
#[derive(Debug, Clone)]
pub struct Enqueued {
    /// One status per requested recipient, in request order.
    pub statuses: Vec<(String, AdmissionStatus)>,
    /// The earliest time a batch this admission touched becomes claimable.
    pub next_due_at: Option<i64>,
}

/// A batch handed to a lane under a lease.
#[derive(Debug, Clone)]
pub struct ClaimedBatch {
    pub batch_id: String,
    pub lease_token: String,
    pub lease_expires_at: i64,
    pub registration_id: String,
    pub host_fingerprint: String,
    pub kind: Kind,
    /// Provider answers so far, plus one.
    pub attempt: u32,
    /// Retries scheduled so far: the backoff grows with it.
    pub retries: u32,
    /// The earliest deadline of the members being sent: none is sent past its own.
    pub deadline: i64,
    pub silent: bool,
    pub provider: Provider,
    /// The lease of a lane that stopped answering had lapsed: this is a recovery.
    pub recovered: bool,
    pub members: Vec<Member>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Sent,
    Dead,
    Failed,
    Expired,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Dead => "dead",
            Self::Failed => "failed",
            Self::Expired => "expired",
        }
    }
}

/// A lane's final answer for one batch it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub batch_id: String,
    pub lease_token: String,
    pub outcome: Outcome,
    pub reason: String,
    /// The provider answered this attempt: it counts as one.
    pub answered: bool,
}

/// How a lane gives a batch back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The provider answered: an attempt, and a retry.
    Answered,
    /// The provider was not reached (connection, registry, token endpoint): a retry only.
    Unanswered,
    /// Untried (a stopping lane, a provider on hold): neither.
    HandBack,
}

impl Retry {
    fn counts(self) -> (i32, i32) {
        match self {
            Self::Answered => (1, 1),
            Self::Unanswered => (0, 1),
            Self::HandBack => (0, 0),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryResult {
    Scheduled,
    /// The retry would land past the deadline: the batch expired instead.
    Expired,
    LeaseLost,
}

#[derive(Debug, Clone)]
pub struct RecipientRecord {
    pub registration_id: String,
    pub status: String,
    pub updated_at: i64,
    pub attempts: u32,
}

#[derive(Debug, Clone)]
pub struct EventRecord {
    pub accepted_at: i64,
    pub deadline: i64,
    pub recipients: Vec<RecipientRecord>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Depth {
    pub waiting: u64,
    pub due: u64,
    pub leased: u64,
    pub oldest_due_age_ms: i64,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Cleaned {
    pub expired_batches: u64,
    pub cleared_payloads: u64,
    pub deleted_events: u64,
    pub deleted_batches: u64,
    pub deleted_fences: u64,
    /// How far past retention the oldest row still kept is (0 when cleanup is keeping up).
    pub past_retention_ms: i64,
}

/// Providers whose work a claim leaves alone: their sender's breaker is holding it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Skip {
    pub apns: bool,
    pub fcm: bool,
}

impl Skip {
    /// Matches no provider (`Provider::Unknown` is stored as '').
    const NONE: &'static str = "-";

    pub fn of(providers: impl IntoIterator<Item = Provider>) -> Self {
        providers
            .into_iter()
            .fold(Self::default(), |skip, provider| match provider {
                Provider::Apns => Self { apns: true, ..skip },
                Provider::Fcm => Self { fcm: true, ..skip },
                Provider::Unknown => skip,
            })
    }

    /// The two provider names `provider <> $a AND provider <> $b` excludes.
    fn binds(self) -> (&'static str, &'static str) {
        (
            if self.apns {
                Provider::Apns.as_str()
            } else {
                Self::NONE
            },
            if self.fcm {
                Provider::Fcm.as_str()
            } else {
                Self::NONE
            },
        )
    }
}

pub trait QueueStore: Clone + Send + Sync + 'static {
    /// Admits `group` in one transaction (one commit for all); one result per admission, in order.
    /// If any of them fails, that transaction is rolled back and each is admitted again in its
    /// own, so one bad admission never fails its neighbours.
    fn enqueue_group(
        &self,
        group: &[&Admission],
        now: i64,
        coalesce_ms: i64,
    ) -> impl Future<Output = Vec<Result<Enqueued, QueueError>>> + Send;
    /// How many groups may be admitted at once: one on SQLite (one writer), a few on PostgreSQL,
    /// whose per-host locks let groups of different hosts commit side by side.
    fn group_writers(&self) -> usize;
    /// Whether each writer gets a thread of its own (see `group_commit`).
    fn writer_thread(&self) -> bool;
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
/// `begin_claim`, `wake_replicas` and `CLAIM_SQL`.
macro_rules! queue_store {
    ($store:ident) => {
        impl $store {
            /// Marks a batch expired with its pending recipients, then clears what no one needs.
            async fn expire_batch(
                tx: &mut <$store as Backend>::Tx,
                batch_id: &str,
                now: i64,
            ) -> Result<(), sqlx::Error> {
                Self::finish_batch(tx, batch_id, "expired", "deadline", now).await.map(drop)
            }

            /// Ends a batch nobody holds, and its pending recipients, in `state`.
            async fn finish_batch(
                tx: &mut <$store as Backend>::Tx,
                batch_id: &str,
                state: &str,
                reason: &str,
                now: i64,
            ) -> Result<bool, sqlx::Error> {
                let finished = Self::finish_batches(tx, &[(batch_id, None, state, reason, false)], now).await?;
                Ok(finished.first().copied().unwrap_or(false))
            }

            /// Ends each batch (id, lease, state, reason, provider answered) and its pending
            /// recipients, then clears
            /// the payloads no recipient waits for any more. A batch with a lease is ended only
            /// while that lease still holds it: the check and the write are one statement, which
            /// also row-locks the batch on PostgreSQL. One flag per batch, in order.
            async fn finish_batches(
                tx: &mut <$store as Backend>::Tx,
                batches: &[(&str, Option<&str>, &str, &str, bool)],
                now: i64,
            ) -> Result<Vec<bool>, sqlx::Error> {
                let mut finished = vec![false; batches.len()];
                let mut by_state: Vec<(&str, Vec<&str>)> = Vec::new();
                // Batches before their recipients, in batch id order: the order a dismissal takes
                // them in too (see `enqueue`), so the two cannot deadlock.
                let mut order: Vec<usize> = (0..batches.len()).collect();
                order.sort_unstable_by_key(|&i| batches[i].0);
                for i in order {
                    let (batch_id, lease, state, reason, answered) = batches[i];
                    let ended = sqlx::query(
                        "UPDATE push_delivery_batches SET state = $2, finished_at = $3, lease_token = NULL, \
                         last_reason = $4, attempts = attempts + $6 WHERE batch_id = $1 \
                         AND ($5 IS NULL OR (lease_token = $5 AND state = 'leased'))",
                    )
                    .bind(batch_id)
                    .bind(state)
                    .bind(now)
                    .bind(reason)
                    .bind(lease)
                    .bind(i32::from(answered))
                    .execute(&mut **tx)
                    .await?
                    .rows_affected()
                        == 1;
                    finished[i] = ended;
                    if ended {
                        match by_state.iter_mut().find(|(s, _)| *s == state) {
                            Some((_, ids)) => ids.push(batch_id),
                            None => by_state.push((state, vec![batch_id])),
                        }
                    }
                }
                for (state, ids) in &by_state {
                    let mut recipients = sqlx::QueryBuilder::new("UPDATE push_event_recipients SET status = ");
                    recipients.push_bind(*state);
                    recipients.push(", updated_at = ").push_bind(now);
                    recipients.push(" WHERE status = 'pending' AND batch_id IN (");
                    let mut list = recipients.separated(", ");
                    for id in ids {
                        list.push_bind(*id);
                    }
                    recipients.push(")");
                    recipients.build().execute(&mut **tx).await?;
                }
                if by_state.is_empty() {
                    return Ok(finished);
                }
                let ended = || by_state.iter().flat_map(|(_, ids)| ids.iter().copied());
                if !Self::FOR_UPDATE.is_empty() {
                    // Lock the events first (in id order): the clearing statement below then reads
                    // the recipients after any admission that is adding one to these events (it
                    // holds the event's row lock) has committed.
                    let mut lock = sqlx::QueryBuilder::new(
                        "SELECT e.event_id FROM push_events e WHERE e.payload_json IS NOT NULL \
                         AND e.event_id IN (SELECT r.event_id FROM push_event_recipients r WHERE r.batch_id IN (",
                    );
                    let mut list = lock.separated(", ");
                    for id in ended() {
                        list.push_bind(id);
                    }
                    lock.push(")) ORDER BY e.event_id");
                    lock.push(Self::FOR_UPDATE);
                    lock.build().fetch_all(&mut **tx).await?;
                }
                // A payload is kept while any recipient still waits for it.
                let mut clear = sqlx::QueryBuilder::new(
                    "UPDATE push_events SET payload_json = NULL WHERE payload_json IS NOT NULL \
                     AND NOT EXISTS (SELECT 1 FROM push_event_recipients p \
                       WHERE p.event_id = push_events.event_id AND p.status = 'pending') \
                     AND event_id IN (SELECT r.event_id FROM push_event_recipients r WHERE r.batch_id IN (",
                );
                let mut list = clear.separated(", ");
                for id in ended() {
                    list.push_bind(id);
                }
                clear.push("))");
                clear.build().execute(&mut **tx).await?;
                Ok(finished)
            }

            /// True (and the row locked for the rest of the transaction) while this lease still holds
            /// the batch: a no-op write, so a concurrent claim or answer waits rather than interleaves.
            async fn hold_lease(
                tx: &mut <$store as Backend>::Tx,
                batch_id: &str,
                token: &str,
            ) -> Result<bool, sqlx::Error> {
                let held = sqlx::query(
                    "UPDATE push_delivery_batches SET lease_token = lease_token \
                     WHERE batch_id = $1 AND lease_token = $2 AND state = 'leased'",
                )
                .bind(batch_id)
                .bind(token)
                .execute(&mut **tx)
                .await?;
                Ok(held.rows_affected() == 1)
            }

            /// A new batch for one member.
            #[allow(clippy::too_many_arguments)]
            async fn open_batch(
                tx: &mut <$store as Backend>::Tx,
                a: &Admission,
                recipient: &AdmissionRecipient,
                coalescible: bool,
                window_ends_at: i64,
                members_bytes: i64,
                deadline: i64,
                now: i64,
            ) -> Result<String, sqlx::Error> {
                let batch_id = random_id();
                sqlx::query(
                    "INSERT INTO push_delivery_batches (batch_id, registration_id, host_fingerprint, kind, \
                     state, coalescible, window_ends_at, available_at, member_count, members_bytes, \
                     routing_bytes, deadline, silent, attempts, created_at, provider) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $7, 1, $8, $9, $10, $11, 0, $12, $13)",
                )
                .bind(&batch_id)
                .bind(&recipient.registration_id)
                .bind(&a.host_fingerprint)
                .bind(a.kind.as_str())
                .bind(if coalescible { "open" } else { "pending" })
                .bind(flag(coalescible))
                .bind(window_ends_at)
                .bind(members_bytes)
                .bind(a.content.routing_bytes())
                .bind(deadline)
                .bind(flag(recipient.silent))
                .bind(now)
                .bind(recipient.provider.as_str())
                .execute(&mut **tx)
                .await?;
                Ok(batch_id)
            }

            /// Joins the registration's open window if the member fits; otherwise closes that window
            /// (due at once) and opens a new one. Returns the batch and when it becomes due.
            async fn coalesce(
                tx: &mut <$store as Backend>::Tx,
                a: &Admission,
                recipient: &AdmissionRecipient,
                deadline: i64,
                now: i64,
                coalesce_ms: i64,
            ) -> Result<(String, i64), sqlx::Error> {
                let (registration_id, silent) = (recipient.registration_id.as_str(), recipient.silent);
                let id = a.content.notification_id.as_deref().unwrap_or_default();
                let bytes = member_bytes(id, &a.notification_epoch);
                let routing = a.content.routing_bytes();
                let open = sqlx::query(
                    "SELECT batch_id, member_count, members_bytes, routing_bytes, window_ends_at \
                     FROM push_delivery_batches \
                     WHERE registration_id = $1 AND host_fingerprint = $2 AND kind = 'alert' \
                     AND state = 'open' AND coalescible = 1 AND window_ends_at > $3 AND member_count < $4 \
                     ORDER BY created_at DESC LIMIT 1",
                )
                .bind(registration_id)
                .bind(&a.host_fingerprint)
                .bind(now)
                .bind(MAX_BATCH_MEMBERS)
                .fetch_optional(&mut **tx)
                .await?;
                if let Some(row) = open {
                    let batch_id: String = row.try_get("batch_id")?;
                    let count = i64::from(row.try_get::<i32, _>("member_count")?) + 1;
                    let members = i64::from(row.try_get::<i32, _>("members_bytes")?) + bytes;
                    let routing = i64::from(row.try_get::<i32, _>("routing_bytes")?).max(routing);
                    let window_ends_at: i64 = row.try_get("window_ends_at")?;
                    if summary_fits(members, routing) {
                        // A batch that is full is due at once; the burst goes on in a new batch.
                        let due = if count >= MAX_BATCH_MEMBERS { now } else { window_ends_at };
                        // Guarded by its state: on PostgreSQL a lane may have claimed the window
                        // since it was read (claims take no host lock); then the member opens a
                        // new window instead of joining work already handed out.
                        let joined = sqlx::query(
                            "UPDATE push_delivery_batches SET member_count = $2, members_bytes = $3, \
                             routing_bytes = $4, window_ends_at = $5, available_at = $5, silent = $6, \
                             deadline = CASE WHEN deadline < $7 THEN $7 ELSE deadline END \
                             WHERE batch_id = $1 AND state = 'open' AND member_count = $8",
                        )
                        .bind(&batch_id)
                        .bind(count)
                        .bind(members)
                        .bind(routing)
                        .bind(due)
                        .bind(flag(silent))
                        .bind(deadline)
                        .bind(count - 1)
                        .execute(&mut **tx)
                        .await?;
                        if joined.rows_affected() == 1 {
                            return Ok((batch_id, due));
                        }
                    } else {
                        // Out of payload room: this window closes now and the member opens the next.
                        sqlx::query(
                            "UPDATE push_delivery_batches SET window_ends_at = $2, available_at = $2 \
                             WHERE batch_id = $1 AND state = 'open'",
                        )
                        .bind(&batch_id)
                        .bind(now)
                        .execute(&mut **tx)
                        .await?;
                    }
                }
                let due = now + coalesce_ms;
                let batch_id =
                    Self::open_batch(tx, a, recipient, true, due, bytes, deadline, now).await?;
                Ok((batch_id, due))
            }

            /// A dismissal takes back the pending alerts it covers for this registration.
            async fn cancel_covered_alerts(
                tx: &mut <$store as Backend>::Tx,
                a: &Admission,
                registration_id: &str,
                now: i64,
            ) -> Result<(), sqlx::Error> {
                let cancelled = sqlx::query(
                    "UPDATE push_event_recipients SET status = 'cancelled', updated_at = $6 \
                     WHERE registration_id = $1 AND status = 'pending' \
                     AND event_id IN (SELECT event_id FROM push_events WHERE host_fingerprint = $2 \
                       AND kind = 'alert' AND notification_epoch = $3 AND notification_id = $4 \
                       AND notification_seq < $5) \
                     AND batch_id IN (SELECT batch_id FROM push_delivery_batches \
                       WHERE registration_id = $1 AND state IN ('open', 'pending', 'leased'))",
                )
                .bind(registration_id)
                .bind(&a.host_fingerprint)
                .bind(&a.notification_epoch)
                .bind(a.content.notification_id.as_deref())
                .bind(a.notification_seq)
                .bind(now)
                .execute(&mut **tx)
                .await?;
                if cancelled.rows_affected() == 0 {
                    return Ok(());
                }
                sqlx::query(
                    "UPDATE push_delivery_batches SET member_count = (SELECT COUNT(*) FROM push_event_recipients r \
                       WHERE r.batch_id = push_delivery_batches.batch_id AND r.status = 'pending') \
                     WHERE registration_id = $1 AND state IN ('open', 'pending', 'leased')",
                )
                .bind(registration_id)
                .execute(&mut **tx)
                .await?;
                sqlx::query(
                    "UPDATE push_delivery_batches SET state = 'cancelled', finished_at = $2, \
                     last_reason = 'dismissed' \
                     WHERE registration_id = $1 AND state IN ('open', 'pending') AND member_count = 0",
                )
                .bind(registration_id)
                .bind(now)
                .execute(&mut **tx)
                .await?;
                Ok(())
            }

            /// One round of expiring work past its deadline (a leased batch only once its lease
            /// lapsed): how many it looked at, and how many it expired.
            async fn expire_overdue(&self, now: i64) -> Result<(u64, u64), QueueError> {
                let overdue: Vec<String> = sqlx::query_scalar(
                    "SELECT batch_id FROM push_delivery_batches WHERE deadline <= $1 AND \
                     (state IN ('open', 'pending') OR (state = 'leased' AND available_at <= $1)) LIMIT $2",
                )
                .bind(now)
                .bind(CLEANUP_BATCH)
                .fetch_all(self.reader())
                .await?;
                let seen = overdue.len() as u64;
                let mut expired = 0;
                for batch_id in overdue {
                    let mut tx = self.begin_claim().await?;
                    // Still overdue and not being worked on: an admission or a lane may have moved
                    // it since the list was read.
                    let still = sqlx::query(
                        "UPDATE push_delivery_batches SET last_reason = 'deadline' WHERE batch_id = $1 \
                         AND deadline <= $2 AND (state IN ('open', 'pending') \
                           OR (state = 'leased' AND available_at <= $2))",
                    )
                    .bind(&batch_id)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                    if still.rows_affected() == 1 {
                        Self::expire_batch(&mut tx, &batch_id, now).await?;
                        expired += 1;
                    }
                    tx.commit().await?;
                }
                Ok((seen, expired))
            }

            async fn clear_payloads(&self, now: i64, cleaned: &mut Cleaned) -> Result<(), QueueError> {
                let started = std::time::Instant::now();
                // Expired payloads, and completed ones that completion missed: when the last two
                // recipients of an event finish in concurrent transactions, each still sees the
                // other pending.
                // In rounds of at most CLEANUP_BATCH rows, so no statement holds its locks long. Each
                // round locks its candidates first (PostgreSQL) and then clears them in a second
                // statement, whose fresh snapshot sees a recipient an admission added meanwhile.
                for _ in 0..CLEANUP_PAYLOAD_ROUNDS {
                    let mut tx = self.begin_claim().await?;
                    let candidates: Vec<String> = sqlx::query_scalar(&format!(
                        "SELECT e.event_id FROM push_events e WHERE e.payload_json IS NOT NULL \
                         AND (e.expires_at <= $1 OR NOT EXISTS (SELECT 1 FROM push_event_recipients p \
                           WHERE p.event_id = e.event_id AND p.status = 'pending')) \
                         ORDER BY e.event_id LIMIT $2{}",
                        Self::FOR_UPDATE
                    ))
                    .bind(now)
                    .bind(CLEANUP_BATCH)
                    .fetch_all(&mut *tx)
                    .await?;
                    if !candidates.is_empty() {
                        let mut clear = sqlx::QueryBuilder::new(
                            "UPDATE push_events SET payload_json = NULL WHERE (expires_at <= ",
                        );
                        clear.push_bind(now);
                        clear.push(
                            " OR NOT EXISTS (SELECT 1 FROM push_event_recipients p \
                             WHERE p.event_id = push_events.event_id AND p.status = 'pending')) \
                             AND event_id IN (",
                        );
                        let mut list = clear.separated(", ");
                        for id in &candidates {
                            list.push_bind(id.as_str());
                        }
                        clear.push(")");
                        cleaned.cleared_payloads += clear.build().execute(&mut *tx).await?.rows_affected();
                    }
                    tx.commit().await?;
                    if candidates.len() < CLEANUP_BATCH as usize || started.elapsed() >= CLEANUP_BUDGET {
                        break;
                    }
                }
                Ok(())
            }
        }

        impl $store {
            /// Admits a group in one transaction, or fails as a whole (nothing written).
            async fn admit_together(&self, group: &[&Admission], now: i64, coalesce_ms: i64) -> Result<Vec<Enqueued>, QueueError> {
                use $crate::admission::Batched;
                let mut tx = self.begin_group_write(group).await?;
                let batched = if self.row_by_row {
                    Batched::RowByRow
                } else {
                    Self::admit_batched(&mut tx, group, now, coalesce_ms).await?
                };
                let admitted = match batched {
                    Batched::Done(admitted) => {
                        self.batched_groups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        admitted
                    }
                    Batched::RowByRow => Self::admit_each(&mut tx, group, now, coalesce_ms).await?,
                    Batched::Raced => {
                        tx.rollback().await?;
                        tx = self.begin_group_write(group).await?;
                        Self::admit_each(&mut tx, group, now, coalesce_ms).await?
                    }
                };
                if admitted.iter().any(|e| e.next_due_at.is_some()) {
                    Self::wake_replicas(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(admitted)
            }

            /// The group one admission at a time, each statement on its own.
            async fn admit_each(
                tx: &mut <$store as Backend>::Tx,
                group: &[&Admission],
                now: i64,
                coalesce_ms: i64,
            ) -> Result<Vec<Enqueued>, QueueError> {
                let mut admitted = Vec::with_capacity(group.len());
                for a in group {
                    admitted.push(Self::admit(tx, a, now, coalesce_ms).await?);
                }
                Ok(admitted)
            }

            /// One admission inside the group's transaction, after the group's host locks.
            async fn admit(
                tx: &mut <$store as Backend>::Tx,
                a: &Admission,
                now: i64,
                coalesce_ms: i64,
            ) -> Result<Enqueued, QueueError> {
                let every = |status| Enqueued {
                    statuses: a.recipients.iter().map(|r| (r.registration_id.clone(), status)).collect(),
                    next_due_at: None,
                };
                if a.kind == Kind::Dismiss && !Self::FOR_UPDATE.is_empty() {
                    // A dismissal takes back pending alerts from batches a lane may be reporting. It
                    // locks every named phone's active batches first, all in one id order, as a
                    // report flush takes them, and before the event row: otherwise the two each
                    // hold what the other waits for.
                    let mut lock = sqlx::QueryBuilder::new(
                        "SELECT batch_id FROM push_delivery_batches \
                         WHERE state IN ('open', 'pending', 'leased') AND registration_id IN (",
                    );
                    let mut list = lock.separated(", ");
                    for r in &a.recipients {
                        list.push_bind(r.registration_id.as_str());
                    }
                    lock.push(") ORDER BY batch_id");
                    lock.push(Self::FOR_UPDATE);
                    lock.build().fetch_all(&mut **tx).await?;
                }
                let hash = a.content.hash();
                // One read for what admission needs to know first: the event if it is a retry, the
                // host's quota use, and the dismissal fence of the notification.
                let seen = sqlx::query(
                    "SELECT e.event_id, e.content_hash, e.expires_at, \
                     (SELECT COUNT(*) FROM push_events q \
                       WHERE q.host_fingerprint = $1 AND q.kind = $2 AND q.accepted_at > $5) AS used, \
                     (SELECT d.dismissed_seq FROM push_dismissed_events d \
                       WHERE d.host_fingerprint = $1 AND d.notification_epoch = $3 \
                       AND d.notification_id = $6) AS fence \
                     FROM (SELECT 1 AS one) o LEFT JOIN push_events e \
                       ON e.host_fingerprint = $1 AND e.kind = $2 \
                       AND e.notification_epoch = $3 AND e.notification_seq = $4",
                )
                .bind(&a.host_fingerprint)
                .bind(a.kind.as_str())
                .bind(&a.notification_epoch)
                .bind(a.notification_seq)
                .bind(now - QUOTA_WINDOW_MS)
                .bind(a.content.notification_id.as_deref())
                .fetch_one(&mut **tx)
                .await?;
                let existing: Option<String> = seen.try_get("event_id")?;
                let is_new = existing.is_none();
                let (event_id, deadline) = match existing {
                    Some(event_id) => {
                        let stored_hash: String = seen.try_get("content_hash")?;
                        let deadline: i64 = seen.try_get("expires_at")?;
                        if stored_hash != hash || now >= deadline {
                            return Ok(every(AdmissionStatus::Error));
                        }
                        // Restores a payload cleared once earlier recipients were done (a later
                        // request for more of the host's devices repeats the same content), and
                        // holds the event's row lock until commit, so that a concurrent clean-up
                        // cannot clear it under the recipient this admission adds.
                        sqlx::query(
                            "UPDATE push_events SET payload_json = COALESCE(payload_json, $2) WHERE event_id = $1",
                        )
                        .bind(&event_id)
                        .bind(a.content.to_json())
                        .execute(&mut **tx)
                        .await?;
                        (event_id, deadline)
                    }
                    None => {
                        if a.expires_at_ms.is_some_and(|at| at <= now) {
                            return Ok(every(AdmissionStatus::Error));
                        }
                        let used: i64 = seen.try_get("used")?;
                        if used >= QUOTA_PER_KIND {
                            return Ok(every(AdmissionStatus::RateLimited));
                        }
                        let cap = now + MAX_LIFETIME_MS;
                        let deadline = a.expires_at_ms.map_or(cap, |at| at.min(cap));
                        let event_id = random_id();
                        sqlx::query(
                            "INSERT INTO push_events (event_id, host_fingerprint, kind, notification_epoch, \
                             notification_seq, notification_id, content_hash, payload_json, trace_parent, \
                             accepted_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                        )
                        .bind(&event_id)
                        .bind(&a.host_fingerprint)
                        .bind(a.kind.as_str())
                        .bind(&a.notification_epoch)
                        .bind(a.notification_seq)
                        .bind(a.content.notification_id.as_deref())
                        .bind(&hash)
                        .bind(a.content.to_json())
                        .bind(a.trace_parent.as_deref())
                        .bind(now)
                        .bind(deadline)
                        .execute(&mut **tx)
                        .await?;
                        (event_id, deadline)
                    }
                };

                let fenced = match (a.kind, a.content.notification_id.as_deref()) {
                    (Kind::Alert, Some(_)) => seen
                        .try_get::<Option<i64>, _>("fence")?
                        .is_some_and(|seq| a.notification_seq < seq),
                    _ => false,
                };

                let mut statuses = Vec::with_capacity(a.recipients.len());
                let mut next_due_at: Option<i64> = None;
                let mut named = std::collections::HashSet::with_capacity(a.recipients.len());
                for recipient in &a.recipients {
                    // A fresh event has no recipients yet but those named earlier in this request; a
                    // retry may name some it already has.
                    let known = !named.insert(recipient.registration_id.as_str())
                        || (!is_new
                        && sqlx::query_scalar::<_, String>(
                            "SELECT status FROM push_event_recipients WHERE event_id = $1 AND registration_id = $2",
                        )
                        .bind(&event_id)
                        .bind(&recipient.registration_id)
                        .fetch_optional(&mut **tx)
                        .await?
                        .is_some());
                    if !known {
                        let (batch_id, status) = if fenced {
                            (None, "cancelled")
                        } else {
                            let (batch_id, due) = match a.kind {
                                Kind::Dismiss => {
                                    Self::cancel_covered_alerts(tx, a, &recipient.registration_id, now).await?;
                                    let bytes = member_bytes(
                                        a.content.notification_id.as_deref().unwrap_or_default(),
                                        &a.notification_epoch,
                                    );
                                    let id = Self::open_batch(
                                        tx, a, recipient, false, now, bytes, deadline, now,
                                    )
                                    .await?;
                                    (id, now)
                                }
                                Kind::Alert if coalesce_ms == 0 || a.content.notification_id.is_none() => {
                                    let id = Self::open_batch(
                                        tx, a, recipient, false, now, 0, deadline, now,
                                    )
                                    .await?;
                                    (id, now)
                                }
                                Kind::Alert => {
                                    Self::coalesce(tx, a, recipient, deadline, now, coalesce_ms)
                                    .await?
                                }
                            };
                            next_due_at = Some(next_due_at.map_or(due, |d| d.min(due)));
                            (Some(batch_id), "pending")
                        };
                        sqlx::query(
                            "INSERT INTO push_event_recipients (event_id, registration_id, batch_id, status, \
                             silent, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $6)",
                        )
                        .bind(&event_id)
                        .bind(&recipient.registration_id)
                        .bind(batch_id)
                        .bind(status)
                        .bind(flag(recipient.silent))
                        .bind(now)
                        .execute(&mut **tx)
                        .await?;
                    }
                    statuses.push((recipient.registration_id.clone(), AdmissionStatus::Queued));
                }
                if let (Kind::Dismiss, Some(id)) = (a.kind, a.content.notification_id.as_deref()) {
                    sqlx::query(
                        "INSERT INTO push_dismissed_events (host_fingerprint, notification_epoch, notification_id, \
                         dismissed_seq, created_at) VALUES ($1, $2, $3, $4, $5) \
                         ON CONFLICT (host_fingerprint, notification_epoch, notification_id) DO UPDATE SET \
                         dismissed_seq = CASE WHEN excluded.dismissed_seq > push_dismissed_events.dismissed_seq \
                           THEN excluded.dismissed_seq ELSE push_dismissed_events.dismissed_seq END, \
                         created_at = excluded.created_at",
                    )
                    .bind(&a.host_fingerprint)
                    .bind(&a.notification_epoch)
                    .bind(id)
                    .bind(a.notification_seq)
                    .bind(now)
                    .execute(&mut **tx)
                    .await?;
                }
                Ok(Enqueued { statuses, next_due_at })
            }
        }

        impl QueueStore for $store {
            async fn enqueue_group(&self, group: &[&Admission], now: i64, coalesce_ms: i64) -> Vec<Result<Enqueued, QueueError>> {
                if group.len() > 1 {
                    match self.admit_together(group, now, coalesce_ms).await {
                        Ok(admitted) => return admitted.into_iter().map(Ok).collect(),
                        Err(error) => tracing::debug!(%error, size = group.len(), "group admission failed; admitting one by one"),
                    }
                }
                let mut results = Vec::with_capacity(group.len());
                for a in group {
                    let one = self.admit_together(&[a], now, coalesce_ms).await;
                    results.push(one.map(|mut admitted| admitted.remove(0)));
                }
                results
            }

            fn group_writers(&self) -> usize {
                Self::GROUP_WRITERS
            }

            fn writer_thread(&self) -> bool {
                Self::WRITER_THREAD
            }

            async fn claim(&self, lane: &str, max: i64, lease_ms: i64, now: i64, skip: Skip) -> Result<Vec<ClaimedBatch>, QueueError> {
                let mut tx = self.begin_claim().await?;
                let (skip_a, skip_b) = skip.binds();
                // The due batches with what a lane needs of them, in one statement.
                let rows = sqlx::query(Self::CLAIM_SQL)
                    .bind(now)
                    .bind(max)
                    .bind(skip_a)
                    .bind(skip_b)
                    .fetch_all(&mut *tx)
                    .await?;
                let mut due = Vec::with_capacity(rows.len());
                for row in rows {
                    let batch_id: String = row.try_get("batch_id")?;
                    if now >= row.try_get::<i64, _>("deadline")? {
                        Self::expire_batch(&mut tx, &batch_id, now).await?;
                        continue;
                    }
                    due.push((batch_id, row));
                }
                if due.is_empty() {
                    tx.commit().await?;
                    return Ok(Vec::new());
                }
                // The pending members of every due batch, in one statement, in delivery order.
                let mut query = sqlx::QueryBuilder::new(
                    "SELECT r.batch_id, e.event_id, e.notification_epoch, e.notification_seq, \
                     e.payload_json, e.trace_parent, e.expires_at \
                     FROM push_event_recipients r JOIN push_events e ON e.event_id = r.event_id \
                     WHERE r.status = 'pending' AND r.batch_id IN (",
                );
                let mut ids = query.separated(", ");
                for (batch_id, _) in &due {
                    ids.push_bind(batch_id.as_str());
                }
                query.push(") ORDER BY e.accepted_at, e.notification_seq");
                let member_rows = query.build().fetch_all(&mut *tx).await?;
                let mut members: HashMap<String, Vec<Member>> = HashMap::with_capacity(due.len());
                for m in &member_rows {
                    let batch_id: String = m.try_get("batch_id")?;
                    let member_deadline: i64 = m.try_get("expires_at")?;
                    let content = m
                        .try_get::<Option<String>, _>("payload_json")?
                        .and_then(|json| serde_json::from_str::<Content>(&json).ok());
                    let Some(content) = content.filter(|_| now < member_deadline) else {
                        // Past its own deadline (its payload may already be cleared): it expired,
                        // and must be neither sent nor reported as sent with the rest of the batch.
                        sqlx::query(
                            "UPDATE push_event_recipients SET status = 'expired', updated_at = $3 \
                             WHERE event_id = $1 AND batch_id = $2 AND status = 'pending'",
                        )
                        .bind(m.try_get::<String, _>("event_id")?)
                        .bind(&batch_id)
                        .bind(now)
                        .execute(&mut *tx)
                        .await?;
                        continue;
                    };
                    members.entry(batch_id).or_default().push(Member {
                        notification_epoch: m.try_get("notification_epoch")?,
                        notification_seq: m.try_get("notification_seq")?,
                        content,
                        trace_parent: m.try_get("trace_parent")?,
                        deadline: member_deadline,
                    });
                }
                // One lease token for the whole claim: a lease is still checked per batch (id and
                // token), and every batch of the claim belongs to the same lane.
                let token = random_id();
                let lease_expires_at = now + lease_ms;
                let mut claimed = Vec::with_capacity(due.len());
                for (batch_id, row) in due {
                    let Some(members) = members.remove(&batch_id) else {
                        Self::finish_batch(&mut tx, &batch_id, "cancelled", "no pending members", now).await?;
                        continue;
                    };
                    let kind: String = row.try_get("kind")?;
                    claimed.push(ClaimedBatch {
                        lease_token: token.clone(),
                        lease_expires_at,
                        registration_id: row.try_get("registration_id")?,
                        host_fingerprint: row.try_get("host_fingerprint")?,
                        kind: Kind::parse(&kind).unwrap_or(Kind::Alert),
                        attempt: u32::try_from(row.try_get::<i32, _>("attempts")? + 1).unwrap_or(u32::MAX),
                        retries: u32::try_from(row.try_get::<i32, _>("retries")?).unwrap_or(0),
                        deadline: members.iter().map(|m| m.deadline).min().unwrap_or(now),
                        silent: row.try_get::<i32, _>("silent")? != 0,
                        provider: Provider::parse(&row.try_get::<String, _>("provider")?),
                        recovered: row.try_get::<String, _>("state")? == "leased",
                        members,
                        batch_id,
                    });
                }
                if !claimed.is_empty() {
                    let mut lease = sqlx::QueryBuilder::new(
                        "UPDATE push_delivery_batches SET state = 'leased', lease_token = ",
                    );
                    lease.push_bind(&token);
                    lease.push(", lease_owner = ").push_bind(lane);
                    lease.push(", available_at = ").push_bind(lease_expires_at);
                    lease.push(", window_ends_at = CASE WHEN window_ends_at > ").push_bind(now);
                    lease.push(" THEN ").push_bind(now);
                    // Attempts are counted when a provider answers (see `retry` and `complete`): a
                    // claim whose lane never reached the provider costs the batch nothing.
                    lease.push(" ELSE window_ends_at END WHERE batch_id IN (");
                    let mut ids = lease.separated(", ");
                    for batch in &claimed {
                        ids.push_bind(batch.batch_id.as_str());
                    }
                    lease.push(")");
                    lease.build().execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(claimed)
            }

            async fn next_available_at(&self, skip: Skip) -> Result<Option<i64>, QueueError> {
                let (skip_a, skip_b) = skip.binds();
                let next: Option<i64> = sqlx::query_scalar(
                    "SELECT MIN(available_at) FROM push_delivery_batches \
                     WHERE state IN ('open', 'pending', 'leased') AND provider <> $1 AND provider <> $2",
                )
                .bind(skip_a)
                .bind(skip_b)
                .fetch_one(self.reader())
                .await?;
                Ok(next)
            }

            async fn renew(&self, batch_id: &str, token: &str, until: i64) -> Result<bool, QueueError> {
                let renewed = sqlx::query(
                    "UPDATE push_delivery_batches SET available_at = $3 \
                     WHERE batch_id = $1 AND lease_token = $2 AND state = 'leased'",
                )
                .bind(batch_id)
                .bind(token)
                .bind(until)
                .execute(&self.pool)
                .await?;
                Ok(renewed.rows_affected() == 1)
            }

            async fn complete(
                &self,
                completions: &[Completion],
                now: i64,
            ) -> Result<Vec<bool>, QueueError> {
                if completions.is_empty() {
                    return Ok(Vec::new());
                }
                let mut tx = self.begin_claim().await?;
                let batches: Vec<_> = completions
                    .iter()
                    .map(|c| {
                        (c.batch_id.as_str(), Some(c.lease_token.as_str()), c.outcome.as_str(), c.reason.as_str(), c.answered)
                    })
                    .collect();
                // A lost lease writes nothing, so the others can still commit.
                let recorded = Self::finish_batches(&mut tx, &batches, now).await?;
                tx.commit().await?;
                Ok(recorded)
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
                let (attempts, retries) = how.counts();
                // The common case is one statement: the lease still held and the retry before the
                // deadline (a retry is the only write of a failed attempt, so it sets the price
                // of an outage).
                let scheduled = sqlx::query(RETRY_SCHEDULE_SQL)
                    .bind(batch_id)
                    .bind(at)
                    .bind(reason)
                    .bind(attempts)
                    .bind(retries)
                    .bind(token)
                    .execute(&self.pool)
                    .await?;
                if scheduled.rows_affected() == 1 {
                    Self::wake_replicas_after_commit(&self.pool).await?;
                    return Ok(RetryResult::Scheduled);
                }
                let mut tx = self.begin_claim().await?;
                if !Self::hold_lease(&mut tx, batch_id, token).await? {
                    return Ok(RetryResult::LeaseLost);
                }
                let deadline: i64 =
                    sqlx::query_scalar("SELECT deadline FROM push_delivery_batches WHERE batch_id = $1")
                        .bind(batch_id)
                        .fetch_one(&mut *tx)
                        .await?;
                // A retry is never moved earlier to fit the deadline: it expires instead.
                if at >= deadline {
                    sqlx::query(
                        "UPDATE push_delivery_batches SET attempts = attempts + $2, retries = retries + $3 \
                         WHERE batch_id = $1",
                    )
                    .bind(batch_id)
                    .bind(attempts)
                    .bind(retries)
                    .execute(&mut *tx)
                    .await?;
                    Self::expire_batch(&mut tx, batch_id, now).await?;
                    tx.commit().await?;
                    return Ok(RetryResult::Expired);
                }
                // Only if the batch changed between the first statement and this transaction.
                sqlx::query(RETRY_SCHEDULE_SQL)
                    .bind(batch_id)
                    .bind(at)
                    .bind(reason)
                    .bind(attempts)
                    .bind(retries)
                    .bind(token)
                    .execute(&mut *tx)
                    .await?;
                Self::wake_replicas(&mut tx).await?;
                tx.commit().await?;
                Ok(RetryResult::Scheduled)
            }

            async fn hold(&self, provider: Provider, until: i64, due_before: i64) -> Result<u64, QueueError> {
                if provider == Provider::Unknown {
                    return Ok(0);
                }
                let held = sqlx::query(
                    "UPDATE push_delivery_batches SET available_at = $2, last_reason = 'held' \
                     WHERE provider = $1 AND state = 'pending' AND available_at < $3",
                )
                .bind(provider.as_str())
                .bind(until)
                .bind(due_before)
                .execute(&self.pool)
                .await?;
                Ok(held.rows_affected())
            }

            async fn release(&self, provider: Provider, now: i64, limit: i64) -> Result<u64, QueueError> {
                let mut tx = self.begin_claim().await?;
                // Never before a retry's own time (backoff, Retry-After); the earliest deadlines
                // first when only some go (a probe), and never one already past its deadline (the
                // claim would expire it and no probe would go out). Those are left to cleanup. The
                // outer conditions are checked again on a row another transaction changed meanwhile
                // (PostgreSQL re-reads it), so a release racing a claim never cuts a live lease.
                let released = sqlx::query(
                    "UPDATE push_delivery_batches SET last_reason = 'released', \
                     available_at = CASE WHEN not_before > $2 THEN not_before ELSE $2 END \
                     WHERE state = 'pending' AND last_reason = 'held' \
                     AND batch_id IN (SELECT batch_id FROM push_delivery_batches \
                       WHERE provider = $1 AND state = 'pending' AND last_reason = 'held' \
                       AND deadline > $2 ORDER BY deadline LIMIT $3)",
                )
                .bind(provider.as_str())
                .bind(now)
                .bind(limit)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if released > 0 {
                    Self::wake_replicas(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(released)
            }

            async fn event_record(
                &self,
                host: &str,
                kind: Kind,
                epoch: &str,
                seq: i64,
            ) -> Result<Option<EventRecord>, QueueError> {
                let event = sqlx::query(
                    "SELECT event_id, accepted_at, expires_at FROM push_events WHERE host_fingerprint = $1 \
                     AND kind = $2 AND notification_epoch = $3 AND notification_seq = $4",
                )
                .bind(host)
                .bind(kind.as_str())
                .bind(epoch)
                .bind(seq)
                .fetch_optional(self.reader())
                .await?;
                let Some(event) = event else { return Ok(None) };
                let event_id: String = event.try_get("event_id")?;
                let rows = sqlx::query(
                    "SELECT r.registration_id, r.status, r.updated_at, COALESCE(b.attempts, 0) AS attempts \
                     FROM push_event_recipients r LEFT JOIN push_delivery_batches b ON b.batch_id = r.batch_id \
                     WHERE r.event_id = $1 ORDER BY r.created_at, r.registration_id",
                )
                .bind(&event_id)
                .fetch_all(self.reader())
                .await?;
                let recipients = rows
                    .iter()
                    .map(|r| {
                        Ok(RecipientRecord {
                            registration_id: r.try_get("registration_id")?,
                            status: r.try_get("status")?,
                            updated_at: r.try_get("updated_at")?,
                            attempts: u32::try_from(r.try_get::<i32, _>("attempts")?).unwrap_or(0),
                        })
                    })
                    .collect::<Result<_, sqlx::Error>>()?;
                Ok(Some(EventRecord {
                    accepted_at: event.try_get("accepted_at")?,
                    deadline: event.try_get("expires_at")?,
                    recipients,
                }))
            }

            async fn depth(&self, now: i64) -> Result<Depth, QueueError> {
                let row = sqlx::query(
                    "SELECT \
                       COALESCE(SUM(CASE WHEN state IN ('open', 'pending') AND available_at > $1 THEN 1 ELSE 0 END), 0) AS waiting, \
                       COALESCE(SUM(CASE WHEN available_at <= $1 THEN 1 ELSE 0 END), 0) AS due, \
                       COALESCE(SUM(CASE WHEN state = 'leased' AND available_at > $1 THEN 1 ELSE 0 END), 0) AS leased, \
                       MIN(CASE WHEN available_at <= $1 THEN available_at END) AS oldest_due \
                     FROM push_delivery_batches WHERE state IN ('open', 'pending', 'leased')",
                )
                .bind(now)
                .fetch_one(self.reader())
                .await?;
                let count = |name: &str| -> Result<u64, sqlx::Error> {
                    Ok(u64::try_from(row.try_get::<i64, _>(name)?).unwrap_or(0))
                };
                Ok(Depth {
                    waiting: count("waiting")?,
                    due: count("due")?,
                    leased: count("leased")?,
                    oldest_due_age_ms: row
                        .try_get::<Option<i64>, _>("oldest_due")?
                        .map_or(0, |oldest| (now - oldest).max(0)),
                })
            }

            async fn cleanup(&self, now: i64) -> Result<Cleaned, QueueError> {
                let mut cleaned = Cleaned::default();
                // Each step works in rounds of at most CLEANUP_BATCH rows (no statement holds its
                // locks long, admissions interleave) and goes on while a round is full and the
                // pass's budget lasts, so cleanup keeps up with any admission rate it can.
                let started = std::time::Instant::now();
                let more = |round: u64| round >= CLEANUP_BATCH as u64 && started.elapsed() < CLEANUP_BUDGET;
                loop {
                    let (seen, expired) = self.expire_overdue(now).await?;
                    cleaned.expired_batches += expired;
                    if !more(seen) {
                        break;
                    }
                }
                self.clear_payloads(now, &mut cleaned).await?;
                let horizon = now - RETENTION_MS;
                loop {
                    sqlx::query(DELETE_OLD_RECIPIENTS)
                        .bind(horizon)
                        .bind(CLEANUP_BATCH)
                        .execute(&self.pool)
                        .await?;
                    let events = sqlx::query(DELETE_OLD_EVENTS)
                        .bind(horizon)
                        .bind(CLEANUP_BATCH)
                        .execute(&self.pool)
                        .await?
                        .rows_affected();
                    cleaned.deleted_events += events;
                    if !more(events) {
                        break;
                    }
                }
                for (statement, count) in [
                    (DELETE_OLD_BATCHES, &mut cleaned.deleted_batches),
                    (DELETE_OLD_FENCES, &mut cleaned.deleted_fences),
                ] {
                    loop {
                        let deleted = sqlx::query(statement)
                            .bind(horizon)
                            .bind(CLEANUP_BATCH)
                            .execute(&self.pool)
                            .await?
                            .rows_affected();
                        *count += deleted;
                        if !more(deleted) {
                            break;
                        }
                    }
                }
                let oldest: Option<i64> = sqlx::query_scalar(OLDEST_RETAINED)
                    .fetch_one(self.reader())
                    .await?;
                cleaned.past_retention_ms = oldest.map_or(0, |at| (horizon - at).max(0));
                Ok(cleaned)
            }

        }
    };
}

/// Recipients of the oldest events past retention (before the events themselves).
const DELETE_OLD_RECIPIENTS: &str = "DELETE FROM push_event_recipients WHERE event_id IN \
     (SELECT event_id FROM push_events WHERE accepted_at < $1 ORDER BY accepted_at LIMIT $2)";
const DELETE_OLD_EVENTS: &str = "DELETE FROM push_events WHERE event_id IN \
     (SELECT event_id FROM push_events WHERE accepted_at < $1 ORDER BY accepted_at LIMIT $2)";
const DELETE_OLD_BATCHES: &str = "DELETE FROM push_delivery_batches WHERE batch_id IN \
     (SELECT batch_id FROM push_delivery_batches WHERE created_at < $1 \
      AND state NOT IN ('open', 'pending', 'leased') ORDER BY created_at LIMIT $2)";
const DELETE_OLD_FENCES: &str = "DELETE FROM push_dismissed_events \
     WHERE (host_fingerprint, notification_epoch, notification_id) IN \
     (SELECT host_fingerprint, notification_epoch, notification_id FROM push_dismissed_events \
      WHERE created_at < $1 ORDER BY created_at LIMIT $2)";
/// The oldest row any retention applies to (each read walks an index from its low end).
const OLDEST_RETAINED: &str = "SELECT MIN(t) FROM (\
     SELECT MIN(accepted_at) AS t FROM push_events \
     UNION ALL SELECT MIN(created_at) FROM push_delivery_batches \
       WHERE state NOT IN ('open', 'pending', 'leased') \
     UNION ALL SELECT MIN(created_at) FROM push_dismissed_events) oldest";

/// A leased batch back to pending at `$2`, if `$6` still holds its lease and `$2` is before its
/// deadline.
const RETRY_SCHEDULE_SQL: &str = "UPDATE push_delivery_batches SET state = 'pending', \
     available_at = $2, not_before = $2, lease_token = NULL, last_reason = $3, \
     attempts = attempts + $4, retries = retries + $5 \
     WHERE batch_id = $1 AND lease_token = $6 AND state = 'leased' AND deadline > $2";

/// What differs between the backends.
pub trait Backend {
    type Tx;
}

/// SQLite: one writer at a time. `BEGIN IMMEDIATE` takes the write lock before the first read, so
/// the quota count and the insert that follows it cannot interleave with another admission.
#[derive(Debug, Clone)]
pub struct SqliteQueueStore {
    pool: sqlx::SqlitePool,
    readers: sqlx::SqlitePool,
    row_by_row: bool,
    /// Groups admitted on the batched path (see `AnyQueueStore::batched_groups`).
    batched_groups: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Backend for SqliteQueueStore {
    type Tx = sqlx::Transaction<'static, sqlx::Sqlite>;
}

impl SqliteQueueStore {
    const CLAIM_SQL: &'static str = "SELECT batch_id, registration_id, host_fingerprint, kind, state, \
         deadline, silent, attempts, retries, provider FROM push_delivery_batches \
         WHERE state IN ('open', 'pending', 'leased') AND available_at <= $1 \
         AND provider <> $3 AND provider <> $4 ORDER BY available_at LIMIT $2";
    /// One writer at a time: nothing to lock.
    const FOR_UPDATE: &'static str = "";

    pub fn new(pool: sqlx::SqlitePool) -> Self {
        let readers = orca_push_storage::ReadPool::readers(&pool);
        Self {
            pool,
            readers,
            row_by_row: false,
            batched_groups: Default::default(),
        }
    }

    /// Where reads outside a transaction go.
    fn reader(&self) -> &sqlx::SqlitePool {
        &self.readers
    }

    /// One writer: a second group could only wait for it.
    const GROUP_WRITERS: usize = 1;
    /// Its statements are round trips to a thread: the writer waits for each (`group_commit`).
    const WRITER_THREAD: bool = true;

    async fn begin_group_write(
        &self,
        _group: &[&Admission],
    ) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        self.pool.begin_with("BEGIN IMMEDIATE").await
    }

    async fn begin_claim(&self) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        self.pool.begin_with("BEGIN IMMEDIATE").await
    }

    /// One process owns a SQLite queue: the in-process waker is enough.
    async fn wake_replicas(_tx: &mut <Self as Backend>::Tx) -> Result<(), sqlx::Error> {
        Ok(())
    }

    async fn wake_replicas_after_commit(_pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
        Ok(())
    }
}

/// PostgreSQL (READ COMMITTED), shared by every replica: admissions of one host serialise on a
/// transaction advisory lock, claims skip rows another replica has locked, and a commit that makes
/// work due notifies every replica's waiting lanes.
#[derive(Debug, Clone)]
pub struct PgQueueStore {
    pool: sqlx::PgPool,
    readers: sqlx::PgPool,
    row_by_row: bool,
    /// Groups admitted on the batched path (see `AnyQueueStore::batched_groups`).
    batched_groups: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Backend for PgQueueStore {
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;
}

impl PgQueueStore {
    const CLAIM_SQL: &'static str = "SELECT batch_id, registration_id, host_fingerprint, kind, state, \
         deadline, silent, attempts, retries, provider FROM push_delivery_batches \
         WHERE state IN ('open', 'pending', 'leased') AND available_at <= $1 \
         AND provider <> $3 AND provider <> $4 ORDER BY available_at LIMIT $2 FOR UPDATE SKIP LOCKED";
    /// Row locks taken by a reading statement.
    const FOR_UPDATE: &'static str = " FOR UPDATE";

    pub fn new(pool: sqlx::PgPool) -> Self {
        let readers = orca_push_storage::ReadPool::readers(&pool);
        Self {
            pool,
            readers,
            row_by_row: false,
            batched_groups: Default::default(),
        }
    }

    /// Where reads outside a transaction go.
    fn reader(&self) -> &sqlx::PgPool {
        &self.readers
    }

    pub fn pool(&self) -> &sqlx::PgPool {
        &self.pool
    }

    /// Groups of different hosts commit side by side; a host's admissions serialise on its lock.
    const GROUP_WRITERS: usize = 4;
    /// Its connections belong to the main runtime's I/O driver: the writers run there.
    const WRITER_THREAD: bool = false;
    /// Every host's transaction lock, in one order (the lock keys'), so two groups naming the same
    /// hosts never each hold what the other waits for.
    const LOCK_HOSTS_SQL: &'static str = "SELECT COUNT(pg_advisory_xact_lock(k)) FROM \
         (SELECT DISTINCT hashtextextended('push_events:' || h, 0) AS k FROM UNNEST($1::text[]) AS h \
          ORDER BY k) AS keys";

    async fn begin_group_write(
        &self,
        group: &[&Admission],
    ) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let hosts: Vec<&str> = group.iter().map(|a| a.host_fingerprint.as_str()).collect();
        sqlx::query(Self::LOCK_HOSTS_SQL)
            .bind(hosts)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    async fn begin_claim(&self) -> Result<<Self as Backend>::Tx, sqlx::Error> {
        self.pool.begin().await
    }

    async fn wake_replicas(tx: &mut <Self as Backend>::Tx) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(WAKE_CHANNEL)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// `wake_replicas` for a write that committed on its own.
    async fn wake_replicas_after_commit(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(WAKE_CHANNEL)
            .execute(pool)
            .await?;
        Ok(())
    }
}

queue_store!(SqliteQueueStore);
queue_store!(PgQueueStore);
crate::admission::batched_admission!(SqliteQueueStore);
crate::admission::batched_admission!(PgQueueStore);

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

    /// Groups admitted on the batched path of `crate::admission` so far.
    pub fn batched_groups(&self) -> u64 {
        let counter = match self {
            Self::Sqlite(s) => &s.batched_groups,
            Self::Postgres(s) => &s.batched_groups,
        };
        counter.load(std::sync::atomic::Ordering::Relaxed)
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
    ) -> Vec<Result<Enqueued, QueueError>> {
        delegate!(self, s => s.enqueue_group(group, now, coalesce_ms))
    }
    fn writer_thread(&self) -> bool {
        match self {
            Self::Sqlite(s) => s.writer_thread(),
            Self::Postgres(s) => s.writer_thread(),
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
