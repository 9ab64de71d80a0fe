//! Cleanup (expiring overdue work, clearing payloads, deleting what is past retention) and the
//! reads that watch the queue: its depth and one event's record.

/// Recipients of the oldest events past retention (before the events themselves).
pub(super) const DELETE_OLD_RECIPIENTS: &str = "DELETE FROM push_event_recipients \
     WHERE event_id IN \
     (SELECT event_id FROM push_events WHERE accepted_at < $1 ORDER BY accepted_at LIMIT $2)";
pub(super) const DELETE_OLD_EVENTS: &str = "DELETE FROM push_events WHERE event_id IN \
     (SELECT event_id FROM push_events WHERE accepted_at < $1 ORDER BY accepted_at LIMIT $2)";
pub(super) const DELETE_OLD_BATCHES: &str = "DELETE FROM push_delivery_batches WHERE batch_id IN \
     (SELECT batch_id FROM push_delivery_batches WHERE created_at < $1 \
      AND state NOT IN ('open', 'pending', 'leased') ORDER BY created_at LIMIT $2)";
/// The oldest dismissal fences past retention. The age is checked again outside the list: a fence is raised again in place (a later dismissal
/// of the same notification sets its `created_at`), and PostgreSQL, finding a row another
/// transaction changed while the delete waited for it, checks only the outer condition again.
pub(super) const DELETE_OLD_FENCES: &str = "DELETE FROM push_dismissed_events \
     WHERE created_at < $1 AND (host_fingerprint, notification_epoch, notification_id) IN \
     (SELECT host_fingerprint, notification_epoch, notification_id FROM push_dismissed_events \
      WHERE created_at < $1 ORDER BY created_at LIMIT $2)";
/// Rows of `push_quota_use` (PostgreSQL's queue migration 0010) that start before `$1`: a seen
/// read counts the whole window instead of reading one that old (`push_quota_use`), and the
/// trigger's next insert of the host's events, or a round once the host has
/// `crate::admission::QUOTA_ROW_FROM` alerts in the window, writes it again. One statement a pass:
/// the rows are one per host and kind, and a pass finds those whose hosts stopped sending in the
/// last minute. Rows a round or an insert's trigger holds are skipped, not waited for: a round
/// locks its hosts' rows in its own order, and a delete taking them in another could deadlock it.
pub(super) const DELETE_OLD_QUOTA_USE: &str = "DELETE FROM push_quota_use \
     WHERE counted_after < $1 AND (host_fingerprint, kind) IN \
     (SELECT host_fingerprint, kind FROM push_quota_use WHERE counted_after < $1 \
      FOR UPDATE SKIP LOCKED)";

/// The oldest row any retention applies to (each read walks an index from its low end).
pub(super) const OLDEST_RETAINED: &str = "SELECT MIN(t) FROM (\
     SELECT MIN(accepted_at) AS t FROM push_events \
     UNION ALL SELECT MIN(created_at) FROM push_delivery_batches \
       WHERE state NOT IN ('open', 'pending', 'leased') \
     UNION ALL SELECT MIN(created_at) FROM push_dismissed_events) oldest";

/// At most `$2` batches past their deadline at `$1` that no live lease holds. It names the live
/// states word for word, so that SQLite reads an index of live batches, not the table.
pub(super) const OVERDUE_SQL: &str = "SELECT batch_id FROM push_delivery_batches \
     WHERE deadline <= $1 AND state IN ('open', 'pending', 'leased') AND \
     (state IN ('open', 'pending') OR (state = 'leased' AND available_at <= $1)) LIMIT $2";

/// Marks a batch for expiry if it is still overdue at `$2` and no live lease holds it.
pub(super) const STILL_OVERDUE_SQL: &str = "UPDATE push_delivery_batches \
     SET last_reason = 'deadline' WHERE batch_id = $1 \
     AND deadline <= $2 AND (state IN ('open', 'pending') \
       OR (state = 'leased' AND available_at <= $2))";

/// At most `$4` events accepted from `$1` until before `$2` whose payload is expired at `$3` or
/// waited for by no recipient, in id order. They are found by acceptance time
/// (`push_events_accepted`): no index names the payload, so that clearing it stays a heap-only
/// update on PostgreSQL (migration 0006). The recipients are looked up per event (a scalar
/// subquery): written `NOT EXISTS`, PostgreSQL hashed every pending recipient of the table for
/// each call.
pub(super) const PAYLOAD_CANDIDATES_SQL: &str = "SELECT e.event_id FROM push_events e \
     WHERE e.accepted_at >= $1 AND e.accepted_at < $2 AND e.payload_json IS NOT NULL \
     AND (e.expires_at <= $3 OR (SELECT 1 FROM push_event_recipients p \
       WHERE p.event_id = e.event_id AND p.status = 'pending' LIMIT 1) IS NULL) \
     ORDER BY e.event_id LIMIT $4";

/// Row-locks a list of events (`Stmt::push_in`), then `ORDER BY event_id` and the backend's row
/// locks.
pub(super) const LOCK_EVENTS_HEAD: &str = "SELECT event_id FROM push_events WHERE event_id";

/// Clears the candidates' payloads that expired by the bound pushed next, or that no recipient
/// waits for; then `CLEAR_PAYLOADS_MIDDLE`, and the candidates
/// (`Stmt::push_in`).
pub(super) const CLEAR_PAYLOADS_HEAD: &str = "UPDATE push_events SET payload_json = NULL \
     WHERE payload_json IS NOT NULL AND (expires_at <= ";

/// After `CLEAR_PAYLOADS_HEAD`'s bound.
pub(super) const CLEAR_PAYLOADS_MIDDLE: &str = " OR (SELECT 1 FROM push_event_recipients p \
     WHERE p.event_id = push_events.event_id AND p.status = 'pending' LIMIT 1) IS NULL) \
     AND event_id";

/// How many batches wait, are due or are leased at `$1`, and the oldest due time.
pub(super) const DEPTH_SQL: &str = "SELECT \
       COALESCE(SUM(CASE WHEN state IN ('open', 'pending') AND available_at > $1 \
         THEN 1 ELSE 0 END), 0) AS waiting, \
       COALESCE(SUM(CASE WHEN available_at <= $1 THEN 1 ELSE 0 END), 0) AS due, \
       COALESCE(SUM(CASE WHEN state = 'leased' AND available_at > $1 \
         THEN 1 ELSE 0 END), 0) AS leased, \
       MIN(CASE WHEN available_at <= $1 THEN available_at END) AS oldest_due \
     FROM push_delivery_batches WHERE state IN ('open', 'pending', 'leased')";

/// An event by its identity.
pub(super) const EVENT_SQL: &str = "SELECT event_id, accepted_at, expires_at FROM push_events \
     WHERE host_fingerprint = $1 \
     AND kind = $2 AND notification_epoch = $3 AND notification_seq = $4";

/// An event's recipients, each with its batch's attempts.
pub(super) const EVENT_RECIPIENTS_SQL: &str = "SELECT r.registration_id, r.status, \
     r.updated_at, COALESCE(b.attempts, 0) AS attempts \
     FROM push_event_recipients r LEFT JOIN push_delivery_batches b ON b.batch_id = r.batch_id \
     WHERE r.event_id = $1 ORDER BY r.created_at, r.registration_id";

/// Where this replica's payload sweep ended: every event accepted before it was read after it
/// had expired, and its payload cleared.
#[derive(Debug)]
pub struct PayloadSweep(std::sync::atomic::AtomicI64);

impl Default for PayloadSweep {
    fn default() -> Self {
        Self(std::sync::atomic::AtomicI64::new(i64::MIN))
    }
}

impl PayloadSweep {
    /// Where it ended (`i64::MIN` before the first sweep).
    pub(super) fn ended(&self) -> i64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One clean-up task per replica sets it, so a plain store (a clock set back moves it back).
    pub(super) fn end_at(&self, at: i64) {
        self.0.store(at, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Cleanup's statements for one backend (`$store` implements `Backend`).
macro_rules! cleanup_statements {
    ($store:ty) => {
        impl $store {
            /// `QueueStore::cleanup`.
            async fn cleanup_pass(&self, now: i64) -> Result<Cleaned, QueueError> {
                let mut cleaned = Cleaned::default();
                // Each step works in rounds of at most CLEANUP_BATCH rows (no statement holds its
                // locks long, admissions interleave) and goes on while a round is full and its own
                // budget lasts (one step's backlog does not starve the next), so cleanup keeps up
                // with any admission rate it can.
                let more = |round: u64, since: std::time::Instant| {
                    round >= CLEANUP_BATCH as u64 && since.elapsed() < CLEANUP_BUDGET
                };
                let since = std::time::Instant::now();
                loop {
                    let (seen, expired) = self.expire_overdue(now).await?;
                    cleaned.expired_batches += expired;
                    if !more(seen, since) {
                        break;
                    }
                }
                self.clear_payloads(now, &mut cleaned).await?;
                let horizon = now - RETENTION_MS;
                let since = std::time::Instant::now();
                // Each round in a transaction that plans by key, as a lane's do (`begin_claim`):
                // PostgreSQL's generic plan of a delete made on small tables joined the oldest
                // ids to a sequential scan of the whole table, on every pass (round 31,
                // docs/benchmarks.md).
                loop {
                    let mut tx = self.begin_claim().await?;
                    Stmt::new($crate::store::cleanup::DELETE_OLD_RECIPIENTS)
                        .bind(horizon)
                        .bind(CLEANUP_BATCH)
                        .execute(&mut tx)
                        .await?;
                    let events = Stmt::new($crate::store::cleanup::DELETE_OLD_EVENTS)
                        .bind(horizon)
                        .bind(CLEANUP_BATCH)
                        .execute(&mut tx)
                        .await?;
                    tx.commit().await?;
                    cleaned.deleted_events += events;
                    if !more(events, since) {
                        break;
                    }
                }
                for (statement, count) in [
                    (
                        $crate::store::cleanup::DELETE_OLD_BATCHES,
                        &mut cleaned.deleted_batches,
                    ),
                    (
                        $crate::store::cleanup::DELETE_OLD_FENCES,
                        &mut cleaned.deleted_fences,
                    ),
                ] {
                    let since = std::time::Instant::now();
                    loop {
                        let mut tx = self.begin_claim().await?;
                        let deleted = Stmt::new(statement)
                            .bind(horizon)
                            .bind(CLEANUP_BATCH)
                            .execute(&mut tx)
                            .await?;
                        tx.commit().await?;
                        *count += deleted;
                        if !more(deleted, since) {
                            break;
                        }
                    }
                }
                if Self::QUOTA_USE_ROWS {
                    // Older than any seen read reads (`crate::admission::push_quota_use`).
                    cleaned.deleted_quota_rows =
                        sqlx::query($crate::store::cleanup::DELETE_OLD_QUOTA_USE)
                            .bind(now - 2 * QUOTA_WINDOW_MS)
                            .execute(self.writes())
                            .await?
                            .rows_affected();
                }
                let oldest: Option<i64> =
                    sqlx::query_scalar($crate::store::cleanup::OLDEST_RETAINED)
                        .fetch_one(self.reader())
                        .await?;
                cleaned.past_retention_ms = oldest.map_or(0, |at| (horizon - at).max(0));
                Ok(cleaned)
            }

            /// One round of expiring work past its deadline (a leased batch only once its lease
            /// lapsed): how many it looked at, and how many it expired.
            async fn expire_overdue(&self, now: i64) -> Result<(u64, u64), QueueError> {
                // Where plans are made once and kept (PostgreSQL), in a transaction that plans by
                // key: the generic plan made on a fresh deployment's small table scanned every
                // batch of the retention window on each pass, where the live ones are in
                // `push_delivery_batches_live` (round 31, docs/benchmarks.md).
                let overdue: Vec<String> = if Self::PLANS_KEPT {
                    let mut tx = self.begin_claim().await?;
                    let rows = Stmt::new($crate::store::cleanup::OVERDUE_SQL)
                        .bind(now)
                        .bind(CLEANUP_BATCH)
                        .fetch_all(&mut tx)
                        .await?;
                    tx.commit().await?;
                    rows.iter()
                        .map(|row| row.col::<String>("batch_id"))
                        .collect::<Result<_, _>>()?
                } else {
                    sqlx::query_scalar($crate::store::cleanup::OVERDUE_SQL)
                        .bind(now)
                        .bind(CLEANUP_BATCH)
                        .fetch_all(self.reader())
                        .await?
                };
                let seen = overdue.len() as u64;
                let mut expired = 0;
                for batch_id in overdue {
                    let mut tx = self.begin_claim().await?;
                    // Still overdue and not being worked on: an admission or a lane may have moved
                    // it since the list was read.
                    let still = Stmt::new($crate::store::cleanup::STILL_OVERDUE_SQL)
                        .bind(&batch_id)
                        .bind(now)
                        .execute(&mut tx)
                        .await?;
                    if still == 1 {
                        Self::expire_batch(&mut tx, &batch_id, now).await?;
                        expired += 1;
                    }
                    tx.commit().await?;
                }
                Ok((seen, expired))
            }

            async fn clear_payloads(
                &self,
                now: i64,
                cleaned: &mut Cleaned,
            ) -> Result<(), QueueError> {
                let started = std::time::Instant::now();
                // Expired payloads, and completed ones that completion missed (the last two
                // recipients of an event finishing in concurrent transactions each still saw the
                // other pending, or a member expired inside a claim was its event's last
                // recipient), read by acceptance time a step at a time. Events accepted before `lag` have all expired: once read after that,
                // they are not read again.
                let lag = now - PAYLOAD_SWEEP_LAG_MS;
                // First the last minutes, whole, on every pass (so a backlog after a start does
                // not hold up what just expired).
                self.sweep_payloads(lag, now + 1, now, started, cleaned)
                    .await?;
                // Then what aged past `lag` since this replica's last sweep ended (at first, the
                // retention horizon), while the budget lasts.
                let ended = self.payload_sweep.ended();
                let mut from = ended.max(now - RETENTION_MS).min(lag);
                while from < lag && started.elapsed() < CLEANUP_BUDGET {
                    let until = from.saturating_add(PAYLOAD_SWEEP_STEP_MS).min(lag);
                    if !self
                        .sweep_payloads(from, until, now, started, cleaned)
                        .await?
                    {
                        break;
                    }
                    self.payload_sweep.end_at(until);
                    from = until;
                }
                // A clock set back leaves the sweep's end ahead of `lag`: what was accepted
                // between the two must still be read once it ages past `lag`.
                if ended > lag {
                    self.payload_sweep.end_at(lag);
                }
                Ok(())
            }

            /// Clears the missed payloads of the events accepted from `from` until before `until`,
            /// a step at a time: whether it got through them all before the budget of a pass that
            /// began at `started` ran out.
            async fn sweep_payloads(
                &self,
                from: i64,
                until: i64,
                now: i64,
                started: std::time::Instant,
                cleaned: &mut Cleaned,
            ) -> Result<bool, QueueError> {
                let mut step = from;
                while step < until {
                    let step_until = step.saturating_add(PAYLOAD_SWEEP_STEP_MS).min(until);
                    loop {
                        // Read first (beside the writer): most steps find nothing to clear.
                        let candidates: Vec<String> =
                            sqlx::query_scalar($crate::store::cleanup::PAYLOAD_CANDIDATES_SQL)
                                .bind(step)
                                .bind(step_until)
                                .bind(now)
                                .bind(CLEANUP_BATCH)
                                .fetch_all(self.reader())
                                .await?;
                        if !candidates.is_empty() {
                            cleaned.cleared_payloads +=
                                self.clear_candidates(&candidates, now).await?;
                        }
                        if candidates.len() < CLEANUP_BATCH as usize {
                            break;
                        }
                        if started.elapsed() >= CLEANUP_BUDGET {
                            return Ok(false);
                        }
                    }
                    step = step_until;
                }
                Ok(true)
            }

            /// Clears those of `candidates` whose payload is expired at `now` or that no recipient
            /// waits for. The events are locked first (PostgreSQL, in id order, as reports lock
            /// them) and cleared in a second statement, whose fresh snapshot sees a recipient an
            /// admission added meanwhile.
            async fn clear_candidates(
                &self,
                candidates: &[String],
                now: i64,
            ) -> Result<u64, QueueError> {
                // By key (`begin_claim`): the candidates are a few ids.
                let mut tx = self.begin_claim().await?;
                if !Self::FOR_UPDATE.is_empty() {
                    let mut lock =
                        Stmt::build($crate::store::cleanup::LOCK_EVENTS_HEAD, Self::NUMBERED);
                    lock.push_in(candidates.iter().map(String::as_str));
                    lock.push(" ORDER BY event_id");
                    lock.push(Self::FOR_UPDATE);
                    lock.fetch_all(&mut tx).await?;
                }
                let mut clear =
                    Stmt::build($crate::store::cleanup::CLEAR_PAYLOADS_HEAD, Self::NUMBERED);
                clear.push_bind(now);
                clear.push($crate::store::cleanup::CLEAR_PAYLOADS_MIDDLE);
                clear.push_in(candidates.iter().map(String::as_str));
                let cleared = clear.execute(&mut tx).await?;
                tx.commit().await?;
                Ok(cleared)
            }

            /// `QueueStore::depth`.
            async fn count_depth(&self, now: i64) -> Result<Depth, QueueError> {
                let row = sqlx::query($crate::store::cleanup::DEPTH_SQL)
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

            /// `QueueStore::event_record`.
            async fn find_event_record(
                &self,
                host: &str,
                kind: Kind,
                epoch: &str,
                seq: i64,
            ) -> Result<Option<EventRecord>, QueueError> {
                let event = sqlx::query($crate::store::cleanup::EVENT_SQL)
                    .bind(host)
                    .bind(kind.as_str())
                    .bind(epoch)
                    .bind(seq)
                    .fetch_optional(self.reader())
                    .await?;
                let Some(event) = event else { return Ok(None) };
                let event_id: String = event.try_get("event_id")?;
                let rows = sqlx::query($crate::store::cleanup::EVENT_RECIPIENTS_SQL)
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
        }
    };
}
pub(crate) use cleanup_statements;
