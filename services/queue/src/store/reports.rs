//! What lanes report back: a batch finished (sent, dead, failed, expired), given back for a
//! retry, or held and released with its provider's breaker.

pub(super) mod call;

/// Before the rows of final answers: batch, state, reason, lease (NULL: no lease to check, as for
/// an expiry) and whether the provider answered.
pub(super) const FINISH_BATCHES_HEAD: &str = "WITH v (id, state, reason, lease, answered) AS (";
/// After them, `) UPDATE` and the backend's `OR_FAIL`, then the time, then `FINISH_BATCHES_TAIL`.
pub(super) const FINISH_BATCHES_MIDDLE: &str = " push_delivery_batches SET state = v.state, \
     lease_token = NULL, last_reason = v.reason, \
     attempts = push_delivery_batches.attempts + v.answered, finished_at = ";
/// Each batch only under its own lease; the ones finished come back.
pub(super) const FINISH_BATCHES_TAIL: &str = " FROM v WHERE push_delivery_batches.batch_id = v.id \
     AND (v.lease IS NULL OR (push_delivery_batches.lease_token = v.lease \
       AND push_delivery_batches.state = 'leased')) \
     RETURNING push_delivery_batches.batch_id";

/// Clears the payloads of a list of batches' events that no recipient waits for, after `UPDATE`
/// and the backend's `OR_FAIL`: the list (`Stmt::push_in`), then `)`.
pub(super) const CLEAR_FINISHED_PAYLOADS_HEAD: &str = " push_events SET payload_json = NULL \
     WHERE payload_json IS NOT NULL \
     AND NOT EXISTS (SELECT 1 FROM push_event_recipients p \
       WHERE p.event_id = push_events.event_id AND p.status = 'pending') \
     AND event_id IN (SELECT r.event_id FROM push_event_recipients r WHERE r.batch_id";

/// The pending recipients of a list of batches finished at a time take their batch's state, after
/// `UPDATE` and the backend's `OR_FAIL`, then `updated_at = ` and that time, `FINISHED_RECIPIENTS_AT`
/// and the time again: the list (`Stmt::push_in`). Joined after the batches' update on sqlx's SQLite
/// connection (`Exec::joins`), where it cannot take the ids that update returned: every finish writes a
/// batch's recipients in its own transaction, and a recipient only ever joins a batch that is not
/// finished, so the only finished batches with a pending recipient are the ones the update before
/// just ended (and the time, which that update set, narrows it to those).
pub(super) const FINISHED_RECIPIENTS_HEAD: &str =
    " push_event_recipients SET status = b.state, updated_at = ";
/// After `FINISHED_RECIPIENTS_HEAD`'s time.
pub(super) const FINISHED_RECIPIENTS_AT: &str = " FROM push_delivery_batches b \
     WHERE b.batch_id = push_event_recipients.batch_id \
     AND b.state NOT IN ('open', 'pending', 'leased') AND b.finished_at = ";
/// After `FINISHED_RECIPIENTS_AT`'s time.
pub(super) const FINISHED_RECIPIENTS_LIST: &str =
    " AND push_event_recipients.status = 'pending' AND push_event_recipients.batch_id";

/// A leased batch back to pending at `$2`, if `$6` still holds its lease and `$2` is before its
/// deadline.
pub(super) const RETRY_SCHEDULE_SQL: &str = "UPDATE push_delivery_batches SET state = 'pending', \
     available_at = $2, not_before = $2, lease_token = NULL, last_reason = $3, \
     attempts = attempts + $4, retries = retries + $5 \
     WHERE batch_id = $1 AND lease_token = $6 AND state = 'leased' AND deadline > $2";

/// A batch's deadline.
pub(super) const DEADLINE_SQL: &str =
    "SELECT deadline FROM push_delivery_batches WHERE batch_id = $1";

/// The attempt and retry a retry past the deadline still counts.
pub(super) const COUNT_RETRY_SQL: &str = "UPDATE push_delivery_batches \
     SET attempts = attempts + $2, retries = retries + $3 WHERE batch_id = $1";

/// Moves a provider's pending batches due before `$3` to `$2`. It names the live states, as
/// `push_delivery_batches_due` does, so that SQLite reads that index rather than the table
/// (`admit::OPEN_WINDOW_SQL` says why), and `available_at >= 0` for PostgreSQL's (migration 0007).
pub(super) const HOLD_SQL: &str = "UPDATE push_delivery_batches \
     SET available_at = $2, last_reason = 'held' \
     WHERE provider = $1 AND state IN ('open', 'pending', 'leased') AND state = 'pending' \
     AND available_at < $3 AND available_at >= 0";

/// Makes at most `$3` held batches of a provider due again, not before `$2` nor their retry's
/// time.
pub(super) const RELEASE_SQL: &str = "UPDATE push_delivery_batches SET last_reason = 'released', \
     available_at = CASE WHEN not_before > $2 THEN not_before ELSE $2 END \
     WHERE state = 'pending' AND last_reason = 'held' \
     AND batch_id IN (SELECT batch_id FROM push_delivery_batches \
       WHERE provider = $1 AND state IN ('open', 'pending', 'leased') AND state = 'pending' \
       AND last_reason = 'held' \
       AND deadline > $2 ORDER BY deadline LIMIT $3)";

/// The reports' statements for one backend (`$store` implements `Backend`).
macro_rules! report_statements {
    ($store:ty) => {
        impl $store {
            /// Marks a batch expired with its pending recipients, then clears what no one needs.
            async fn expire_batch(
                tx: &mut <$store as Backend>::Tx,
                batch_id: &str,
                now: i64,
            ) -> Result<(), sqlx::Error> {
                Self::finish_batch(tx, batch_id, "expired", "deadline", now)
                    .await
                    .map(drop)
            }

            /// Ends a batch nobody holds, and its pending recipients, in `state`.
            async fn finish_batch(
                tx: &mut <$store as Backend>::Tx,
                batch_id: &str,
                state: &str,
                reason: &str,
                now: i64,
            ) -> Result<bool, sqlx::Error> {
                let finished =
                    Self::finish_batches(tx, &[(batch_id, None, state, reason, false)], now)
                        .await?;
                Ok(finished.first().copied().unwrap_or(false))
            }

            /// Ends each batch (id, lease, state, reason, provider answered) and its pending
            /// recipients, then clears the payloads no recipient waits for any more. A batch with
            /// a lease is ended only while that lease still holds it: the check and the write are
            /// one statement. One flag per batch, in order. On PostgreSQL all of it is one call
            /// of `push_finish_batches` (`reports::call`), which also row-locks the batches and
            /// then their events, each in id order.
            async fn finish_batches(
                tx: &mut <$store as Backend>::Tx,
                batches: &[$crate::store::reports::call::Finish<'_>],
                now: i64,
            ) -> Result<Vec<bool>, sqlx::Error> {
                let mut finished = vec![false; batches.len()];
                let mut by_state: Vec<(&str, Vec<&str>)> = Vec::new();
                // Each batch once (a second report of the same batch finds its lease gone).
                let mut seen = std::collections::HashSet::with_capacity(batches.len());
                let mut rows: Vec<usize> = (0..batches.len())
                    .filter(|&i| seen.insert(batches[i].0))
                    .collect();
                // Batches before their recipients, in batch id order: the order a dismissal takes
                // them in too (see `enqueue`), so the two cannot deadlock.
                rows.sort_unstable_by_key(|&i| batches[i].0);
                if rows.is_empty() {
                    return Ok(finished);
                }
                if Self::FINISHES_BY_CALL {
                    let ended =
                        $crate::store::reports::call::finish_by_call(tx, batches, &rows, now)
                            .await?;
                    for &i in &rows {
                        finished[i] = ended.contains(batches[i].0);
                    }
                    return Ok(finished);
                }
                // SQLite from here: its one writer needs no row locks (PostgreSQL's, in the
                // function above, keep the batches' and their events' order).
                if tx.joins() {
                    return Self::finish_batches_joined(tx, batches, &rows, now).await;
                }
                // Every batch in one statement; each is finished only under its own lease.
                let update = Self::finish_batches_query(batches, &rows, now);
                let ended = Self::ended_batches(tx, update, rows.len()).await?;
                for &i in &rows {
                    let (batch_id, _, state, _, _) = batches[i];
                    if ended.contains(batch_id) {
                        finished[i] = true;
                        match by_state.iter_mut().find(|(s, _)| *s == state) {
                            Some((_, ids)) => ids.push(batch_id),
                            None => by_state.push((state, vec![batch_id])),
                        }
                    }
                }
                // On SQLite their texts differ with the number of ids: kept as a group's
                // statements are (`keep_statement`), or a round's reports of up to 512 batches
                // would fill the statement cache. PostgreSQL binds the ids as one array.
                for (state, ids) in &by_state {
                    let mut recipients = Stmt::build("UPDATE", Self::NUMBERED);
                    recipients
                        .push(Self::OR_FAIL)
                        .push(" push_event_recipients SET status = ")
                        .push_bind(*state);
                    recipients.push(", updated_at = ").push_bind(now);
                    recipients.push(" WHERE status = 'pending' AND batch_id");
                    recipients.push_in(ids.iter().copied());
                    recipients
                        .persistent(Self::keep_statement(ids.len()))
                        .execute(tx)
                        .await?;
                }
                if by_state.is_empty() {
                    return Ok(finished);
                }
                let ended = || by_state.iter().flat_map(|(_, ids)| ids.iter().copied());
                // A payload is kept while any recipient still waits for it.
                let mut clear = Stmt::build("UPDATE", Self::NUMBERED);
                clear
                    .push(Self::OR_FAIL)
                    .push($crate::store::reports::CLEAR_FINISHED_PAYLOADS_HEAD);
                clear.push_in(ended());
                clear.push(")");
                clear
                    .persistent(Self::keep_statement(ended().count()))
                    .execute(tx)
                    .await?;
                Ok(finished)
            }

            /// The batches' update of `finish_batches`, for the batches at `rows`: each ended only
            /// under its own lease, the ones ended returned.
            fn finish_batches_query<'a>(
                batches: &[$crate::store::reports::call::Finish<'a>],
                rows: &[usize],
                now: i64,
            ) -> Stmt<'a> {
                let mut update =
                    Stmt::build($crate::store::reports::FINISH_BATCHES_HEAD, Self::NUMBERED);
                update.push_values(rows, |mut row, &i| {
                    let (batch_id, lease, state, reason, answered) = batches[i];
                    row.push_bind(batch_id)
                        .push_bind(state)
                        .push_bind(reason)
                        .push_bind(lease)
                        .push_bind(i32::from(answered));
                });
                update
                    .push(") UPDATE")
                    .push(Self::OR_FAIL)
                    .push($crate::store::reports::FINISH_BATCHES_MIDDLE);
                update.push_bind(now);
                update.push($crate::store::reports::FINISH_BATCHES_TAIL);
                update
            }

            /// Runs `query` (`finish_batches_query`'s, and whatever follows it) for `rows`
            /// batches: the ids of those it ended.
            async fn ended_batches(
                tx: &mut <$store as Backend>::Tx,
                query: Stmt<'_>,
                rows: usize,
            ) -> Result<std::collections::HashSet<String>, sqlx::Error> {
                query
                    .persistent(Self::keep_statement(rows))
                    .fetch_all(tx)
                    .await?
                    .iter()
                    .map(|row| row.col::<String>("batch_id"))
                    .collect()
            }

            /// `finish_batches` as one query of three statements (sqlx's SQLite connection,
            /// `Exec::joins`): the batches, their recipients (`FINISHED_RECIPIENTS_HEAD`) and the
            /// payloads no recipient waits for, in one round trip to the connection's thread where
            /// they were three. It takes no row locks, so only a backend that needs none joins. The last two take every batch of the list, the ones whose lease was lost
            /// too: those have no recipient to write, and a payload is cleared only when no
            /// recipient waits for it, whichever batch names it.
            async fn finish_batches_joined(
                tx: &mut <$store as Backend>::Tx,
                batches: &[$crate::store::reports::call::Finish<'_>],
                rows: &[usize],
                now: i64,
            ) -> Result<Vec<bool>, sqlx::Error> {
                use $crate::store::reports as sql;
                let mut query = Self::finish_batches_query(batches, rows, now);
                query.push("; ");
                query.push("UPDATE").push(Self::OR_FAIL);
                query.push(sql::FINISHED_RECIPIENTS_HEAD);
                query.push_bind(now);
                query.push(sql::FINISHED_RECIPIENTS_AT);
                query.push_bind(now);
                query.push(sql::FINISHED_RECIPIENTS_LIST);
                query.push_in(rows.iter().map(|&i| batches[i].0));
                query.push("; ");
                query.push("UPDATE").push(Self::OR_FAIL);
                query.push(sql::CLEAR_FINISHED_PAYLOADS_HEAD);
                query.push_in(rows.iter().map(|&i| batches[i].0));
                query.push(")");
                // Only the first statement returns rows: the batches it ended.
                let ended = Self::ended_batches(tx, query, rows.len()).await?;
                let mut finished = vec![false; batches.len()];
                for &i in rows {
                    finished[i] = ended.contains(batches[i].0);
                }
                Ok(finished)
            }

            /// A writer's round of reports alone (`write_round`), in a round's transaction: on
            /// SQLite the writer's own connection.
            async fn report_round(
                &self,
                completions: &[Completion],
                now: i64,
            ) -> Result<Vec<bool>, QueueError> {
                self.complete_with(completions, now, true).await
            }

            /// `QueueStore::complete`.
            async fn complete_leased(
                &self,
                completions: &[Completion],
                now: i64,
            ) -> Result<Vec<bool>, QueueError> {
                self.complete_with(completions, now, false).await
            }

            /// Records `completions` in a transaction of their own: a round's
            /// (`begin_group_write`), one call of `push_finish_batches` on a connection outside
            /// any (PostgreSQL, each batch named once: `reports::call`), or a lane's
            /// (`begin_claim`).
            async fn complete_with(
                &self,
                completions: &[Completion],
                now: i64,
                in_round: bool,
            ) -> Result<Vec<bool>, QueueError> {
                if completions.is_empty() {
                    return Ok(Vec::new());
                }
                // One call, a transaction of its own: one round trip where a transaction of the
                // statements was seven.
                if Self::FINISHES_BY_CALL && !in_round {
                    use $crate::store::reports::call;
                    let batches: Vec<_> = completions.iter().map(call::finish_of).collect();
                    if let Some(rows) = call::each_once(&batches) {
                        let mut conn = self.writes().acquire().await?;
                        let ended = call::finish_by_call(&mut conn, &batches, &rows, now).await?;
                        return Ok(batches.iter().map(|b| ended.contains(b.0)).collect());
                    }
                }
                let mut tx = if in_round {
                    self.begin_group_write(&[]).await?
                } else {
                    self.begin_claim().await?
                };
                let recorded = Self::finish_reported(&mut tx, completions, now).await?;
                tx.commit().await?;
                Ok(recorded)
            }

            /// Final answers, each against its own lease, inside `tx`: a lost lease writes
            /// nothing, so the others can still commit. One flag per answer, in order. Two answers
            /// for one batch (a lane whose lease lapsed and the lane that reclaimed it, reporting in
            /// the same round) go in successive statements, so the stale one cannot hide the one
            /// holding the lease.
            async fn finish_reported(
                tx: &mut <$store as Backend>::Tx,
                completions: &[Completion],
                now: i64,
            ) -> Result<Vec<bool>, sqlx::Error> {
                let mut recorded = vec![false; completions.len()];
                let mut left: Vec<usize> = (0..completions.len()).collect();
                while !left.is_empty() {
                    let mut ids = std::collections::HashSet::with_capacity(left.len());
                    let (now_round, later): (Vec<usize>, Vec<usize>) = left
                        .iter()
                        .copied()
                        .partition(|&i| ids.insert(completions[i].batch_id.as_str()));
                    let batches: Vec<_> = now_round
                        .iter()
                        .map(|&i| $crate::store::reports::call::finish_of(&completions[i]))
                        .collect();
                    let finished = Self::finish_batches(tx, &batches, now).await?;
                    for (&i, done) in now_round.iter().zip(finished) {
                        recorded[i] = done;
                    }
                    left = later;
                }
                Ok(recorded)
            }

            /// `QueueStore::retry`.
            async fn retry_leased(
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
                let scheduled = sqlx::query($crate::store::reports::RETRY_SCHEDULE_SQL)
                    .bind(batch_id)
                    .bind(at)
                    .bind(reason)
                    .bind(attempts)
                    .bind(retries)
                    .bind(token)
                    .execute(self.writes())
                    .await?;
                if scheduled.rows_affected() == 1 {
                    Self::wake_replicas_after_commit(&self.pool).await;
                    return Ok(RetryResult::Scheduled);
                }
                let mut tx = self.begin_claim().await?;
                if !Self::hold_lease(&mut tx, batch_id, token).await? {
                    return Ok(RetryResult::LeaseLost);
                }
                let deadline: i64 = Stmt::new($crate::store::reports::DEADLINE_SQL)
                    .bind(batch_id)
                    .fetch_one(&mut tx)
                    .await?
                    .col("deadline")?;
                // A retry is never moved earlier to fit the deadline: it expires instead.
                if at >= deadline {
                    Stmt::new($crate::store::reports::COUNT_RETRY_SQL)
                        .bind(batch_id)
                        .bind(attempts)
                        .bind(retries)
                        .execute(&mut tx)
                        .await?;
                    Self::expire_batch(&mut tx, batch_id, now).await?;
                    tx.commit().await?;
                    return Ok(RetryResult::Expired);
                }
                // Only if the batch changed between the first statement and this transaction.
                Stmt::new($crate::store::reports::RETRY_SCHEDULE_SQL)
                    .bind(batch_id)
                    .bind(at)
                    .bind(reason)
                    .bind(attempts)
                    .bind(retries)
                    .bind(token)
                    .execute(&mut tx)
                    .await?;
                Self::wake_replicas(&mut tx, "").await?;
                tx.commit().await?;
                Ok(RetryResult::Scheduled)
            }

            /// `QueueStore::hold`.
            async fn hold_provider(
                &self,
                provider: Provider,
                until: i64,
                due_before: i64,
            ) -> Result<u64, QueueError> {
                if provider == Provider::Unknown {
                    return Ok(0);
                }
                let held = sqlx::query($crate::store::reports::HOLD_SQL)
                    .bind(provider.as_str())
                    .bind(until)
                    .bind(due_before)
                    .execute(self.writes())
                    .await?;
                Ok(held.rows_affected())
            }

            /// `QueueStore::release`.
            async fn release_provider(
                &self,
                provider: Provider,
                now: i64,
                limit: i64,
            ) -> Result<u64, QueueError> {
                let mut tx = self.begin_claim().await?;
                // Never before a retry's own time (backoff, Retry-After); the earliest deadlines
                // first when only some go (a probe), and never one already past its deadline (the
                // claim would expire it and no probe would go out). Those are left to cleanup. The
                // outer conditions are checked again on a row another transaction changed meanwhile
                // (PostgreSQL re-reads it), so a release racing a claim never cuts a live lease.
                let released = Stmt::new($crate::store::reports::RELEASE_SQL)
                    .bind(provider.as_str())
                    .bind(now)
                    .bind(limit)
                    .execute(&mut tx)
                    .await?;
                if released > 0 {
                    Self::wake_replicas(&mut tx, "").await?;
                }
                tx.commit().await?;
                Ok(released)
            }
        }
    };
}
pub(crate) use report_statements;
