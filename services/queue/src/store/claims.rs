//! Lanes claiming due batches under a lease, renewing it, and holding it for a report.

use super::Skip;
use crate::model::Provider;

/// The pending members of a list of batches: the list (`Stmt::push_in`), then their
/// order.
pub(super) const CLAIM_MEMBERS_HEAD: &str = "SELECT r.batch_id, e.event_id, e.notification_epoch, \
     e.notification_seq, e.payload_json, e.trace_parent, e.expires_at \
     FROM push_event_recipients r JOIN push_events e ON e.event_id = r.event_id \
     WHERE r.status = 'pending' AND r.batch_id";

/// A member past its own deadline, expired in the batch being claimed.
pub(super) const EXPIRE_MEMBER_SQL: &str = "UPDATE push_event_recipients \
     SET status = 'expired', updated_at = $3 \
     WHERE event_id = $1 AND batch_id = $2 AND status = 'pending'";

/// What a claim reads of each due batch.
const CLAIM_COLUMNS: &str = "batch_id, registration_id, host_fingerprint, kind, state, deadline, \
     silent, attempts, retries, provider";

/// A statement per set of skipped providers, made once: each provider a statement takes is read
/// apart, so that its batches are a seek into its own range of `push_delivery_batches_due`
/// (provider, then time; queue migration 0007 on SQLite, 0009 on PostgreSQL). Read in time order
/// across providers, a lane leaving a held provider alone walked every due batch of it to reach
/// another's: about 15,000 entries a read with the providers refusing connections (round 47,
/// docs/benchmarks.md).
pub(super) struct PerSkip([String; 4]);

impl PerSkip {
    pub(super) fn new(make: impl Fn(Skip) -> String) -> Self {
        Self(
            [(false, false), (false, true), (true, false), (true, true)]
                .map(|(apns, fcm)| make(Skip { apns, fcm })),
        )
    }

    pub(super) fn get(&self, skip: Skip) -> &str {
        &self.0[usize::from(skip.apns) * 2 + usize::from(skip.fcm)]
    }
}

/// The providers whose work a statement for `skip` reads (never none: work of no known provider
/// is never skipped).
fn taken(skip: Skip) -> impl Iterator<Item = &'static str> {
    Provider::ALL
        .into_iter()
        .filter(move |p| skip.takes(*p))
        .map(Provider::as_str)
}

/// When the next batch of a provider not skipped becomes due: the earliest of each provider's,
/// each read as the first in time order (PostgreSQL plans a `MIN` of its own, made on a small
/// table, as an aggregate over the whole range). `available_at >= 0`, always true, lets
/// PostgreSQL read `push_delivery_batches_due` (queue migrations 0007 and 0009 there).
pub(super) fn next_due_sql(skip: Skip) -> String {
    let each: Vec<String> = taken(skip)
        .enumerate()
        .map(|(n, provider)| {
            format!(
                "SELECT * FROM (SELECT available_at AS t FROM push_delivery_batches \
                 WHERE provider = '{provider}' AND state IN ('open', 'pending', 'leased') \
                 AND available_at >= 0 ORDER BY available_at LIMIT 1) due_{n}"
            )
        })
        .collect();
    format!("SELECT MIN(t) FROM ({}) due", each.join(" UNION ALL "))
}

/// Up to `$2` batches due at `$1` of the providers `skip` takes, in time order: up to `$2` of
/// each provider, read apart, then the earliest. `by_time` bounds each provider's read after
/// `available_at <= $1` and `locks` follows its `LIMIT` (the backend's).
pub(super) fn claim_sql(skip: Skip, by_time: &str, locks: &str) -> String {
    let each: Vec<String> = taken(skip)
        .enumerate()
        .map(|(n, provider)| {
            format!(
                "SELECT * FROM (SELECT {CLAIM_COLUMNS}, available_at FROM push_delivery_batches \
                 WHERE provider = '{provider}' AND state IN ('open', 'pending', 'leased') \
                 AND available_at <= $1{by_time} ORDER BY available_at LIMIT $2{locks}) due_{n}"
            )
        })
        .collect();
    format!(
        "SELECT {CLAIM_COLUMNS} FROM ({}) due ORDER BY available_at LIMIT $2",
        each.join(" UNION ALL ")
    )
}

/// A lease extended to `$3`, if `$2` still holds it.
pub(super) const RENEW_SQL: &str = "UPDATE push_delivery_batches SET available_at = $3 \
     WHERE batch_id = $1 AND lease_token = $2 AND state = 'leased'";

/// A no-op write that row-locks the batch while `$2` still holds its lease.
pub(super) const HOLD_LEASE_SQL: &str = "UPDATE push_delivery_batches \
     SET lease_token = lease_token \
     WHERE batch_id = $1 AND lease_token = $2 AND state = 'leased'";

/// The claims' statements for one backend (`$store` implements `Backend`).
macro_rules! claim_statements {
    ($store:ty) => {
        impl $store {
            /// `QueueStore::claim`.
            async fn claim_due(
                &self,
                lane: &str,
                max: i64,
                lease_ms: i64,
                now: i64,
                skip: Skip,
            ) -> Result<Vec<ClaimedBatch>, QueueError> {
                let mut tx = self.begin_lease().await?;
                let (claimed, _) = Self::claim_in(&mut tx, lane, max, lease_ms, now, skip).await?;
                match tx.commit().await {
                    Ok(()) => Ok(claimed),
                    Err(error) if claimed.is_empty() => Err(error.into()),
                    Err(error) => Err(QueueError::ClaimNotCommitted {
                        leased: claimed,
                        error: Box::new(error.into()),
                    }),
                }
            }

            /// Up to `max` due batches leased to `lane`, inside `tx` (a claim's own transaction or
            /// a writer's round), and how many due batches the table gave (some of which may have
            /// expired or had nothing left to send instead).
            async fn claim_in(
                tx: &mut <$store as Backend>::Tx,
                lane: &str,
                max: i64,
                lease_ms: i64,
                now: i64,
                skip: Skip,
            ) -> Result<(Vec<ClaimedBatch>, usize), QueueError> {
                // The due batches with what a lane needs of them, in one statement.
                let rows = Stmt::new(Self::claim_sql(skip))
                    .bind(now)
                    .bind(max)
                    .fetch_all(tx)
                    .await?;
                let read = rows.len();
                let mut due = Vec::with_capacity(rows.len());
                for row in rows {
                    let batch_id: String = row.col("batch_id")?;
                    if now >= row.col::<i64>("deadline")? {
                        Self::expire_batch(tx, &batch_id, now).await?;
                        continue;
                    }
                    due.push((batch_id, row));
                }
                if due.is_empty() {
                    return Ok((Vec::new(), read));
                }
                // The pending members of every due batch, in one statement, in delivery order.
                let mut query =
                    Stmt::build($crate::store::claims::CLAIM_MEMBERS_HEAD, Self::NUMBERED);
                query.push_in(due.iter().map(|(batch_id, _)| batch_id.as_str()));
                query.push(" ORDER BY e.accepted_at, e.notification_seq");
                let member_rows = query.fetch_all(tx).await?;
                let mut members: HashMap<String, Vec<Member>> = HashMap::with_capacity(due.len());
                for m in &member_rows {
                    let batch_id: String = m.col("batch_id")?;
                    let member_deadline: i64 = m.col("expires_at")?;
                    let content = m
                        .col::<Option<String>>("payload_json")?
                        .and_then(|json| serde_json::from_str::<Content>(&json).ok());
                    let Some(content) = content.filter(|_| now < member_deadline) else {
                        // Past its own deadline (its payload may already be cleared): it expired,
                        // and must be neither sent nor reported as sent with the rest of the batch.
                        Stmt::new($crate::store::claims::EXPIRE_MEMBER_SQL)
                            .bind(m.col::<String>("event_id")?)
                            .bind(&batch_id)
                            .bind(now)
                            .execute(tx)
                            .await?;
                        continue;
                    };
                    members.entry(batch_id).or_default().push(Member {
                        notification_epoch: m.col("notification_epoch")?,
                        notification_seq: m.col("notification_seq")?,
                        content,
                        trace_parent: m.col("trace_parent")?,
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
                        Self::finish_batch(tx, &batch_id, "cancelled", "no pending members", now)
                            .await?;
                        continue;
                    };
                    let kind: String = row.col("kind")?;
                    claimed.push(ClaimedBatch {
                        lease_token: token.clone(),
                        lease_expires_at,
                        registration_id: row.col("registration_id")?,
                        host_fingerprint: row.col("host_fingerprint")?,
                        kind: Kind::parse(&kind).unwrap_or(Kind::Alert),
                        attempt: u32::try_from(row.col::<i32>("attempts")? + 1).unwrap_or(u32::MAX),
                        retries: u32::try_from(row.col::<i32>("retries")?).unwrap_or(0),
                        deadline: members.iter().map(|m| m.deadline).min().unwrap_or(now),
                        silent: row.col::<i32>("silent")? != 0,
                        provider: Provider::parse(&row.col::<String>("provider")?),
                        recovered: row.col::<String>("state")? == "leased",
                        members,
                        batch_id,
                    });
                }
                if !claimed.is_empty() {
                    let mut lease = Stmt::build("UPDATE", Self::NUMBERED);
                    lease.push(Self::OR_FAIL);
                    lease.push(" push_delivery_batches SET state = 'leased', lease_token = ");
                    lease.push_bind(token.as_str());
                    lease.push(", lease_owner = ").push_bind(lane);
                    lease.push(", available_at = ").push_bind(lease_expires_at);
                    lease
                        .push(", window_ends_at = CASE WHEN window_ends_at > ")
                        .push_bind(now);
                    lease.push(" THEN ").push_bind(now);
                    // Attempts are counted when a provider answers (see `retry` and `complete`): a
                    // claim whose lane never reached the provider costs the batch nothing.
                    lease.push(" ELSE window_ends_at END WHERE batch_id");
                    lease.push_in(claimed.iter().map(|b| b.batch_id.as_str()));
                    lease.execute(tx).await?;
                }
                Ok((claimed, read))
            }

            /// `QueueStore::next_available_at`.
            async fn next_due(&self, skip: Skip) -> Result<Option<i64>, QueueError> {
                static NEXT_DUE: std::sync::LazyLock<$crate::store::claims::PerSkip> =
                    std::sync::LazyLock::new(|| {
                        $crate::store::claims::PerSkip::new($crate::store::claims::next_due_sql)
                    });
                let next: Option<i64> = sqlx::query_scalar(NEXT_DUE.get(skip))
                    .fetch_one(self.reader())
                    .await?;
                Ok(next)
            }

            /// `QueueStore::renew`.
            async fn renew_lease(
                &self,
                batch_id: &str,
                token: &str,
                until: i64,
            ) -> Result<bool, QueueError> {
                let renewed = sqlx::query($crate::store::claims::RENEW_SQL)
                    .bind(batch_id)
                    .bind(token)
                    .bind(until)
                    .execute(self.writes())
                    .await?;
                Ok(renewed.rows_affected() == 1)
            }

            /// True (and the row locked for the rest of the transaction) while this lease still holds
            /// the batch: a no-op write, so a concurrent claim or answer waits rather than interleaves.
            async fn hold_lease(
                tx: &mut <$store as Backend>::Tx,
                batch_id: &str,
                token: &str,
            ) -> Result<bool, sqlx::Error> {
                let held = Stmt::new($crate::store::claims::HOLD_LEASE_SQL)
                    .bind(batch_id)
                    .bind(token)
                    .execute(tx)
                    .await?;
                Ok(held == 1)
            }
        }
    };
}
pub(crate) use claim_statements;
