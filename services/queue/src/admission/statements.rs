//! The batched admission's statements: what `plan` needs read, and its writes, one multi-row
//! statement per table. The SQL is written once for both backends, as the store's is.

use crate::store::sql::Stmt;

/// Rows per multi-row statement: far below SQLite's 32,766 bound parameters at 18 per row.
pub const ROWS_PER_STATEMENT: usize = 1000;

/// Before the rows of `read_seen`: each admission's index and identity.
pub const READ_SEEN_HEAD: &str = "WITH a (i, host, kind, epoch, seq, nid) AS (";
/// After them, then the quota use (`push_quota_use`, or `0` where the writer counts it, SQLite),
/// then `READ_SEEN_TAIL`, then `READ_SEEN_USE_JOIN` where the statement counts the use.
pub const READ_SEEN_MIDDLE: &str = ") SELECT a.i AS i, e.event_id AS event_id, ";

/// After the quota use: the dismissal fence, and the event if stored.
pub const READ_SEEN_TAIL: &str = " AS used, \
     (SELECT d.dismissed_seq FROM push_dismissed_events d \
       WHERE d.host_fingerprint = a.host AND d.notification_epoch = a.epoch \
       AND d.notification_id = a.nid) AS fence \
     FROM a LEFT JOIN push_events e \
       ON e.host_fingerprint = a.host AND e.kind = a.kind \
       AND e.notification_epoch = a.epoch AND e.notification_seq = a.seq";

/// The open windows of a list of registrations that end after a time (then that time,
/// `READ_WINDOWS_FULL`, `MAX_BATCH_MEMBERS`, `READ_WINDOWS_LIST` and the list): only those
/// a member may join, which `plan` checks again. A window that has ended stays open until a lane
/// takes it, and while a provider is held none does: in the admission benchmark (providers
/// refusing connections) each phone had some four ended windows, and sending them all, a row at
/// a time from sqlx's SQLite thread, made this read the slowest statement of a round. It names the
/// live states for `push_delivery_batches_live`, as `crate::store`'s `OPEN_WINDOW_SQL` says.
pub const READ_WINDOWS_HEAD: &str = "SELECT batch_id, registration_id, host_fingerprint, \
     member_count, members_bytes, routing_bytes, window_ends_at, created_at \
     FROM push_delivery_batches \
     WHERE state IN ('open', 'pending', 'leased') \
     AND kind = 'alert' AND state = 'open' AND coalescible = 1 AND window_ends_at > ";
pub const READ_WINDOWS_FULL: &str = " AND member_count < ";
pub const READ_WINDOWS_LIST: &str = " AND registration_id";

/// The inserts and updates below follow `INSERT` or `UPDATE` and the backend's `OR_FAIL`.
pub const INTO_EVENTS: &str = " INTO push_events (event_id, host_fingerprint, kind, \
     notification_epoch, notification_seq, notification_id, content_hash, payload_json, \
     trace_parent, accepted_at, expires_at) ";

pub const INTO_BATCHES: &str = " INTO push_delivery_batches (batch_id, registration_id, \
     host_fingerprint, kind, state, coalescible, window_ends_at, available_at, member_count, \
     members_bytes, routing_bytes, deadline, silent, attempts, created_at, provider, lease_token, \
     lease_owner) ";

pub const INSERT_RECIPIENTS: &str = "INSERT INTO push_event_recipients (event_id, \
     registration_id, batch_id, status, silent, created_at, updated_at) ";

/// `INSERT_RECIPIENTS` that also wakes other replicas: this, the rows, `WAKING_TAIL`, the
/// channel and the payload, then `)`. Its one row counts the recipients inserted (`n`).
pub const WAKING_HEAD: &str = "WITH w AS (INSERT INTO push_event_recipients (event_id, \
     registration_id, batch_id, status, silent, created_at, updated_at) ";
pub const WAKING_TAIL: &str = " RETURNING 1) SELECT (SELECT COUNT(*) FROM w) AS n, pg_notify(";

/// Before the rows of the windows' final states.
pub const UPDATE_WINDOWS_HEAD: &str =
    "WITH v (id, was, n, members, routing, due, quiet, late, state) AS (";
/// After them, `UPDATE` and the backend's `OR_FAIL`. Each applies only if the window is still in
/// the state the group read it in (`open`, a row's `state`) with the count it read.
///
/// The state comes with each row, not as a constant: PostgreSQL plans a kept statement once per
/// connection, and on a new, nearly empty table it took `state = 'open'` for one row and scanned
/// the live index for it, every open window, on every call after (round 28, docs/benchmarks.md).
/// Compared with a row's value it can only check the state of the batch found by its id.
pub const UPDATE_WINDOWS_TAIL: &str = " push_delivery_batches SET member_count = v.n, \
     members_bytes = v.members, routing_bytes = v.routing, window_ends_at = v.due, \
     available_at = v.due, silent = COALESCE(v.quiet, push_delivery_batches.silent), \
     deadline = CASE WHEN push_delivery_batches.deadline < v.late THEN v.late \
       ELSE push_delivery_batches.deadline END \
     FROM v WHERE push_delivery_batches.batch_id = v.id \
     AND push_delivery_batches.state = v.state AND push_delivery_batches.member_count = v.was";

/// A group's write statements, as queries: joined into one query of several statements where the
/// transaction runs such a query in one round trip (`Exec::joins`: sqlx's SQLite connection, a
/// round trip to its thread, which the group writer waits for; timed inside a round at 64
/// connections, some 0.3-0.6 ms each, the three inserts alone about 1 ms), else a query each
/// (PostgreSQL runs one statement per prepared query; the SQLite writer's own connection runs
/// them on its thread, with nothing to save). A joined query's text differs with each mix of row counts; the writer
/// keeps it prepared while it has at most `KEEP_ROWS_AT_MOST` rows in all, and compiles a larger
/// one again each round: joining only up to that many rows, so that each text stayed kept, was
/// slower at 256 connections (docs/benchmarks.md, round 8), a round trip costing more than the
/// compiling.
///
/// Only INSERT and UPDATE statements may be joined: the rows changed are summed over the
/// statements, and sqlx would count a statement of another kind as the one before it again.
/// sqlx 0.8 deprecates queries of several statements (its issue 3108); an upgrade that drops them
/// fails `a_joined_query_writes_each_statement_with_its_own_rows`.
pub struct Writes<'args> {
    joined: bool,
    /// Parameters `$N` (PostgreSQL) or `?` (SQLite): see `Stmt`.
    numbered: bool,
    /// Each query, with its rows in all.
    queries: Vec<(Stmt<'args>, usize)>,
}

impl<'args> Writes<'args> {
    pub fn new(joined: bool, numbered: bool) -> Self {
        Self {
            joined,
            numbered,
            queries: Vec::new(),
        }
    }

    /// A statement of `rows` rows that begins with `head`, for the caller to finish.
    pub fn statement(&mut self, head: &str, rows: usize) -> &mut Stmt<'args> {
        if !self.joined || self.queries.is_empty() {
            self.queries.push((Stmt::build("", self.numbered), 0));
        }
        let at = self.queries.len() - 1;
        let (query, total) = &mut self.queries[at];
        if !query.sql().is_empty() {
            query.push("; ");
        }
        query.push(head);
        *total += rows;
        query
    }

    /// How many queries there are so far.
    pub fn count(&self) -> usize {
        self.queries.len()
    }

    /// The queries to run in order, each with its rows in all.
    pub fn queries(self) -> impl Iterator<Item = (Stmt<'args>, usize)> {
        self.queries.into_iter()
    }
}

/// The rows a plan's writes change when no window changed since the group read it: every insert
/// writes all its rows or fails, and each window update applies to one window.
pub fn changes_expected(plan: &super::Plan<'_>) -> u64 {
    (plan.updates.len() + plan.events.len() + plan.batches.len() + plan.recipients.len()) as u64
}

/// The batched admission's statements for one backend (`$store` implements `Backend`).
macro_rules! batched_admission {
    ($store:ty) => {
        impl $store {
            /// Whether a group statement of `rows` rows stays prepared (`KEEP_ROWS_AT_MOST`).
            fn keep_statement(rows: usize) -> bool {
                Self::KEEP_ROWS_AT_MOST.is_some_and(|most| rows <= most)
            }

            /// Admits `group` on the batched path inside `tx` (see `crate::admission`). Where
            /// the backend notifies other replicas (`WAKES_IN_WRITES`), the recipients' insert
            /// tells them what of the group's work is news after `told`, signed with `origin`,
            /// and `Batched::Done` says what.
            #[allow(clippy::too_many_arguments)]
            async fn admit_batched(
                tx: &mut <$store as Backend>::Tx,
                quota: &mut RoundQuota,
                group: &[&Admission],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&$crate::handoff::Handoff>,
                round: &mut Vec<$crate::handoff::Offer>,
                (told, origin): ($crate::wake::Told, &str),
            ) -> Result<$crate::admission::Batched, sqlx::Error> {
                use $crate::admission::{self as batch, Batched};
                if !batch::eligible(group) {
                    return Ok(Batched::RowByRow);
                }
                let seen = Self::read_seen(tx, quota, group, now).await?;
                if seen.iter().any(|s| s.stored) {
                    return Ok(Batched::RowByRow);
                }
                let windows = Self::read_windows(tx, group, now, coalesce_ms).await?;
                let Some(mut plan) = batch::plan(group, &seen, windows, now, coalesce_ms) else {
                    return Ok(Batched::RowByRow);
                };
                // Work due at once goes to the round's claims and those waiting for it, written
                // already leased. If the group turns out to have raced, the offers are dropped
                // with the rolled-back transaction and their claims look again.
                let handed = handoff.map_or_else(Vec::new, |h| {
                    $crate::handoff::lease_due_now(&mut plan, h, round, now)
                });
                // One query of several statements where that saves round trips (sqlx's SQLite
                // connection), else a query per statement (`Writes`).
                let mut writes = batch::Writes::new(tx.joins(), Self::NUMBERED);
                if !plan.updates.is_empty() {
                    let q = writes.statement(batch::UPDATE_WINDOWS_HEAD, plan.updates.len());
                    q.push_values(&plan.updates, |mut row, u| {
                        row.push_bind(u.batch_id.as_str())
                            .push_bind(u.read_count)
                            .push_bind(u.member_count)
                            .push_bind(u.members_bytes)
                            .push_bind(u.routing_bytes)
                            .push_bind(u.due)
                            .push_bind(u.silent.map(flag))
                            .push_bind(u.deadline_at_least)
                            .push_bind("open");
                    });
                    q.push(") UPDATE")
                        .push(Self::OR_FAIL)
                        .push(batch::UPDATE_WINDOWS_TAIL);
                }
                // The hosts' quota use after the round, its window starting where the seen read's
                // did (`crate::admission::quota_rows`).
                let quota_use = if Self::QUOTA_USE_ROWS {
                    batch::rows_to_write(group, &seen, &plan.events)
                } else {
                    Vec::new()
                };
                for (i, chunk) in plan.events.chunks(batch::ROWS_PER_STATEMENT).enumerate() {
                    let q = if i == 0 && !quota_use.is_empty() {
                        let q = writes.statement(batch::QUOTA_USE_HEAD, chunk.len());
                        batch::push_quota_rows(q, now - QUOTA_WINDOW_MS, &quota_use);
                        q.push("INSERT");
                        q
                    } else {
                        writes.statement("INSERT", chunk.len())
                    };
                    q.push(Self::OR_FAIL).push(batch::INTO_EVENTS);
                    q.push_values(chunk, |mut row, e| {
                        let a = e.admission;
                        row.push_bind(e.event_id.as_str())
                            .push_bind(a.host_fingerprint.as_str())
                            .push_bind(a.kind.as_str())
                            .push_bind(a.notification_epoch.as_str())
                            .push_bind(a.notification_seq)
                            .push_bind(a.content.notification_id.as_deref())
                            .push_bind(e.content_hash.as_str())
                            .push_bind(a.content.to_json())
                            .push_bind(a.trace_parent.as_deref())
                            .push_bind(now)
                            .push_bind(e.deadline);
                    });
                }
                for chunk in plan.batches.chunks(batch::ROWS_PER_STATEMENT) {
                    let q = writes.statement("INSERT", chunk.len());
                    q.push(Self::OR_FAIL).push(batch::INTO_BATCHES);
                    q.push_values(chunk, |mut row, b| {
                        let (state, available_at) = b.state();
                        row.push_bind(b.batch_id.as_str())
                            .push_bind(b.registration_id)
                            .push_bind(b.host_fingerprint)
                            .push_bind(Kind::Alert.as_str())
                            .push_bind(state)
                            .push_bind(flag(b.coalescible))
                            .push_bind(b.window_ends_at)
                            .push_bind(available_at)
                            .push_bind(b.member_count)
                            .push_bind(b.members_bytes)
                            .push_bind(b.routing_bytes)
                            .push_bind(b.deadline)
                            .push_bind(flag(b.silent))
                            .push_bind(0_i32)
                            .push_bind(now)
                            .push_bind(b.provider.as_str())
                            .push_bind(b.lease.as_ref().map(|l| l.token.as_str()))
                            .push_bind(b.lease.as_ref().map(|l| l.owner.as_str()));
                    });
                }
                // The wake-up of other replicas rides in the last recipients' statement: one
                // round trip fewer in a round every admission in it waits for. Work due is
                // always some recipient's, so a round that wakes has one.
                // Work handed to this process's claims is none of theirs
                // (`Plan::leave_handed_undue`).
                let news = Self::WAKES_IN_WRITES.then(|| {
                    told.news(
                        &$crate::wake::earliest_due(group.iter().copied().zip(&plan.results)),
                        now,
                    )
                });
                let wake = news
                    .as_deref()
                    .filter(|news| !news.is_empty())
                    .map(|news| $crate::wake::payload_from(news, origin));
                let chunks = plan.recipients.chunks(batch::ROWS_PER_STATEMENT).count();
                let mut counted_at = None;
                for (i, chunk) in plan
                    .recipients
                    .chunks(batch::ROWS_PER_STATEMENT)
                    .enumerate()
                {
                    let waking = wake.as_deref().filter(|_| i + 1 == chunks);
                    let head = match waking {
                        Some(_) => batch::WAKING_HEAD,
                        None => batch::INSERT_RECIPIENTS,
                    };
                    let q = writes.statement(head, chunk.len());
                    q.push_values(chunk, |mut row, r| {
                        row.push_bind(plan.events[r.event].event_id.as_str())
                            .push_bind(r.registration_id)
                            .push_bind(r.batch_id.as_deref())
                            .push_bind(r.status)
                            .push_bind(flag(r.silent))
                            .push_bind(now)
                            .push_bind(now);
                    });
                    if let Some(payload) = waking {
                        q.push(batch::WAKING_TAIL)
                            .push_bind($crate::store::WAKE_CHANNEL)
                            .push(", ")
                            .push_bind(payload.to_owned())
                            .push(")");
                        counted_at = Some(writes.count() - 1);
                    }
                }
                let mut changed = 0;
                let joined = tx.joins();
                for (i, (q, rows)) in writes.queries().enumerate() {
                    let q = q.persistent(Self::keep_statement(rows));
                    changed += if counted_at == Some(i) {
                        let inserted: i64 = q.fetch_one(tx).await?.col("n")?;
                        u64::try_from(inserted).unwrap_or(0)
                    } else {
                        q.execute(tx).await?
                    };
                    // A query per statement: a window update that lost a race is known before
                    // the inserts run.
                    let raced = i == 0
                        && !joined
                        && !plan.updates.is_empty()
                        && changed != plan.updates.len() as u64;
                    if raced {
                        return Ok(Batched::Raced);
                    }
                }
                if changed != batch::changes_expected(&plan) {
                    return Ok(Batched::Raced);
                }
                // What a statement carried was told; if none did (no recipient to carry it, which
                // `plan` never leaves), the round tells it on its own.
                let told = news.filter(|news| news.is_empty() || counted_at.is_some());
                for e in &plan.events {
                    quota.admitted(&e.admission.host_fingerprint, e.admission.kind, now);
                }
                Ok(Batched::Done(plan.results, handed, told))
            }

            /// One row per admission: whether its identity is stored, its host's quota use (from
            /// the statement, or `quota`'s ledger), and its notification's dismissal fence.
            async fn read_seen(
                tx: &mut <$store as Backend>::Tx,
                quota: &RoundQuota,
                group: &[&Admission],
                now: i64,
            ) -> Result<Vec<$crate::admission::Seen>, sqlx::Error> {
                use $crate::admission as batch;
                let mut q = Stmt::build(batch::READ_SEEN_HEAD, Self::NUMBERED);
                q.push_values(group.iter().enumerate(), |mut row, (i, a)| {
                    row.push_bind(i as i64)
                        .push_bind(a.host_fingerprint.as_str())
                        .push_bind(a.kind.as_str())
                        .push_bind(a.notification_epoch.as_str())
                        .push_bind(a.notification_seq)
                        .push_bind(a.content.notification_id.as_deref());
                });
                q.push(batch::READ_SEEN_MIDDLE);
                let by_time = quota.by_time();
                match by_time {
                    Some(by_time) => batch::push_quota_use(&mut q, now - QUOTA_WINDOW_MS, by_time),
                    None => {
                        q.push("0");
                    }
                }
                q.push(batch::READ_SEEN_TAIL);
                if by_time.is_some() {
                    q.push(batch::READ_SEEN_USE_JOIN);
                }
                let rows = q
                    .persistent(Self::keep_statement(group.len()))
                    .fetch_all(tx)
                    .await?;
                let mut seen = vec![batch::Seen::default(); group.len()];
                for row in rows {
                    let i: i64 = row.col("i")?;
                    let (slot, a) = usize::try_from(i)
                        .ok()
                        .and_then(|i| Some((seen.get_mut(i)?, group.get(i)?)))
                        .ok_or_else(|| {
                            sqlx::Error::Protocol(format!("admission index {i} out of range"))
                        })?;
                    *slot = batch::Seen {
                        stored: row.col::<Option<String>>("event_id")?.is_some(),
                        used: match quota.used(&a.host_fingerprint, a.kind, now)? {
                            Some(used) => used,
                            None => row.col("used")?,
                        },
                        fence: row.col("fence")?,
                        quota_row: by_time.is_some() && row.col::<i32>("quota_row")? == 1,
                    };
                }
                Ok(seen)
            }

            /// The joinable windows of the group's coalescing recipients.
            async fn read_windows(
                tx: &mut <$store as Backend>::Tx,
                group: &[&Admission],
                now: i64,
                coalesce_ms: i64,
            ) -> Result<Vec<$crate::admission::OpenWindow>, sqlx::Error> {
                use $crate::admission as batch;
                let registrations: std::collections::BTreeSet<&str> = group
                    .iter()
                    .filter(|a| batch::coalesces(a, coalesce_ms))
                    .flat_map(|a| a.recipients.iter().map(|r| r.registration_id.as_str()))
                    .collect();
                if registrations.is_empty() {
                    return Ok(Vec::new());
                }
                let keep = Self::keep_statement(registrations.len());
                let mut q = Stmt::build(batch::READ_WINDOWS_HEAD, Self::NUMBERED);
                q.push_bind(now)
                    .push(batch::READ_WINDOWS_FULL)
                    .push_bind($crate::model::MAX_BATCH_MEMBERS)
                    .push(batch::READ_WINDOWS_LIST);
                q.push_in(registrations);
                let rows = q.persistent(keep).fetch_all(tx).await?;
                rows.into_iter()
                    .map(|row| {
                        Ok(batch::OpenWindow {
                            batch_id: row.col("batch_id")?,
                            registration_id: row.col("registration_id")?,
                            host_fingerprint: row.col("host_fingerprint")?,
                            member_count: i64::from(row.col::<i32>("member_count")?),
                            members_bytes: i64::from(row.col::<i32>("members_bytes")?),
                            routing_bytes: i64::from(row.col::<i32>("routing_bytes")?),
                            window_ends_at: row.col("window_ends_at")?,
                            created_at: row.col("created_at")?,
                        })
                    })
                    .collect()
            }
        }
    };
}
pub(crate) use batched_admission;

#[cfg(test)]
mod tests {
    use super::Writes;

    /// sqlx binds a joined query's `?` parameters in order from one statement to the next, so each
    /// statement gets its own rows (it runs such a query on its connection's thread in one go).
    #[tokio::test]
    async fn a_joined_query_writes_each_statement_with_its_own_rows() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::query("CREATE TABLE a (x INTEGER, y TEXT); CREATE TABLE b (z TEXT)")
            .execute(&pool)
            .await
            .unwrap();
        for joined in [true, false] {
            let mut writes = Writes::new(joined, false);
            writes.statement("INSERT INTO a (x, y) ", 2).push_values(
                [(1_i64, "one"), (2, "two")],
                |mut row, (x, y)| {
                    row.push_bind(x).push_bind(y);
                },
            );
            writes
                .statement("INSERT INTO b (z) ", 1)
                .push_values(["three"], |mut row, z| {
                    row.push_bind(z);
                });
            let mut queries = 0;
            let mut changed = 0;
            let mut tx = pool.begin().await.unwrap();
            for (q, _) in writes.queries() {
                queries += 1;
                changed += q.execute(&mut tx).await.unwrap();
            }
            tx.commit().await.unwrap();
            assert_eq!((queries, changed), (if joined { 1 } else { 2 }, 3));
        }
        let a: Vec<(i64, String)> = sqlx::query_as("SELECT x, y FROM a ORDER BY rowid")
            .fetch_all(&pool)
            .await
            .unwrap();
        let b: Vec<String> = sqlx::query_scalar("SELECT z FROM b")
            .fetch_all(&pool)
            .await
            .unwrap();
        let one_two = [(1, "one".to_owned()), (2, "two".to_owned())];
        assert_eq!(a, [one_two.clone(), one_two].concat());
        assert_eq!(b, ["three", "three"]);
    }
}
