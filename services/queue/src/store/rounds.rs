//! A writer's round: its admissions (and, where the backend says so, lanes' reports and claims) in
//! one transaction, and what happens when that transaction fails: the admissions again together,
//! then each on its own, so one bad admission never fails its neighbours; the reports in a
//! transaction of their own and each claim in its own, apart from the admissions.

use crate::store::ClaimedBatch;
use crate::store::Enqueued;

/// What a round's one transaction did (`admit_together`).
pub(super) struct Together {
    pub admitted: Vec<Enqueued>,
    pub reported: Vec<bool>,
    pub claimed: Vec<Vec<ClaimedBatch>>,
}

/// The rounds of one backend (`$store` implements `Backend`).
macro_rules! round_statements {
    ($store:ty) => {
        impl $store {
            /// `QueueStore::enqueue_group`.
            async fn admit_group(
                &self,
                group: &[&Admission],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&$crate::handoff::Handoff>,
            ) -> (Vec<Result<Enqueued, QueueError>>, bool) {
                let mut apart = false;
                if group.len() > 1 {
                    match self
                        .admit_together(group, &[], &[], now, coalesce_ms, handoff)
                        .await
                    {
                        Ok(done) => return (done.admitted.into_iter().map(Ok).collect(), false),
                        Err(error) => {
                            apart = true;
                            tracing::debug!(
                                %error,
                                size = group.len(),
                                "group admission failed; admitting one by one"
                            )
                        }
                    }
                }
                let mut results = Vec::with_capacity(group.len());
                for a in group {
                    let mut one = self
                        .admit_together(&[a], &[], &[], now, coalesce_ms, handoff)
                        .await;
                    // A connection the server closed since its last use (a restart, a fail-over,
                    // less than `PING_IDLE_AFTER` idle) fails the first statement sent on it, and
                    // the pool replaces it: the admission goes again on the next, once. If the
                    // first commit did reach the server, the second finds the event stored and is
                    // answered as a retry is (queued, no quota spent, no recipient twice).
                    if one.as_ref().is_err_and(QueueError::connection_lost) {
                        // The lost attempt may have committed work no answer names: the lanes
                        // look (`Round::uncertain`).
                        apart = true;
                        tracing::debug!("admission's connection lost; admitting it again");
                        one = self
                            .admit_together(&[a], &[], &[], now, coalesce_ms, handoff)
                            .await;
                    }
                    apart |= one.is_err();
                    results.push(one.map(|mut done| done.admitted.remove(0)));
                }
                (results, apart)
            }

            /// `QueueStore::write_round`: the claims, the group and the reports in one
            /// transaction; if that fails, each on its own as `claim`, `enqueue_group` and
            /// `complete` would.
            #[allow(clippy::too_many_arguments)]
            async fn admit_and_report(
                &self,
                group: &[&Admission],
                reports: &[Completion],
                claims: &[ClaimAsk],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&$crate::handoff::Handoff>,
            ) -> Round {
                if group.is_empty() && claims.is_empty() {
                    return Round {
                        admitted: Vec::new(),
                        reported: self.report_round(reports, now).await,
                        claimed: Vec::new(),
                        uncertain: false,
                    };
                }
                let mut failed = false;
                if !reports.is_empty() || !claims.is_empty() {
                    match self
                        .admit_together(group, reports, claims, now, coalesce_ms, handoff)
                        .await
                    {
                        Ok(done) => {
                            return Round {
                                admitted: done.admitted.into_iter().map(Ok).collect(),
                                reported: Ok(done.reported),
                                claimed: done.claimed.into_iter().map(Ok).collect(),
                                uncertain: false,
                            };
                        }
                        Err(error) => {
                            failed = true;
                            tracing::debug!(
                                %error,
                                size = group.len(),
                                reports = reports.len(),
                                claims = claims.len(),
                                "round failed; admitting, reporting and claiming apart"
                            )
                        }
                    }
                }
                // The claims first, as in the round: what waited in the table before it.
                let mut claimed = Vec::with_capacity(claims.len());
                for ask in claims {
                    claimed.push(
                        self.claim_due(&ask.lane, ask.max, ask.lease_ms, now, ask.skip)
                            .await,
                    );
                }
                let (admitted, apart) = self.admit_group(group, now, coalesce_ms, handoff).await;
                let reported = self.complete_leased(reports, now).await;
                Round {
                    admitted,
                    reported,
                    claimed,
                    uncertain: failed || apart,
                }
            }

            /// Runs `claims` in `tx`, in order, on what is due in the table. A claim the table
            /// gave fewer due batches than it asked for took all its providers had, so a later
            /// one skipping the same providers does not look again.
            async fn claim_round(
                tx: &mut <$store as Backend>::Tx,
                claims: &[ClaimAsk],
                now: i64,
            ) -> Result<Vec<Vec<ClaimedBatch>>, QueueError> {
                let mut claimed = Vec::with_capacity(claims.len());
                let mut exhausted: Vec<Skip> = Vec::new();
                for ask in claims {
                    if exhausted.contains(&ask.skip) {
                        claimed.push(Vec::new());
                        continue;
                    }
                    let (got, read) =
                        Self::claim_in(tx, &ask.lane, ask.max, ask.lease_ms, now, ask.skip).await?;
                    if i64::try_from(read).unwrap_or(i64::MAX) < ask.max {
                        exhausted.push(ask.skip);
                    }
                    claimed.push(got);
                }
                Ok(claimed)
            }

            /// Claims from the table, admits a group (its new work due at once leased to the
            /// claims' room left, then to waiting claims) and records `reports`, in one
            /// transaction; or fails as a whole (nothing handed to a claim; if its commit failed,
            /// what it leased to claims is given back, since the server may have committed it).
            async fn admit_together(
                &self,
                group: &[&Admission],
                reports: &[Completion],
                claims: &[ClaimAsk],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&$crate::handoff::Handoff>,
            ) -> Result<Together, QueueError> {
                use $crate::admission::Batched;
                let mut tx = self.begin_group_write(group).await?;
                // Where the writer counts the quota (SQLite), it reads what it counts from the
                // table on its first round.
                let mut quota = self.round_quota();
                if !group.is_empty() {
                    quota.prepare(&mut tx, now).await?;
                }
                // What waited in the table is older than this round's work: the claims take it
                // first.
                let mut claimed = Self::claim_round(&mut tx, claims, now).await?;
                let mut round = Vec::new();
                let mut room_answers = Vec::with_capacity(claims.len());
                for (ask, got) in claims.iter().zip(&claimed) {
                    let room = usize::try_from(ask.max)
                        .unwrap_or(0)
                        .saturating_sub(got.len());
                    let offer = handoff
                        .filter(|_| room > 0 && !group.is_empty())
                        .map(|h| h.round_offer(&ask.lane, room, ask.lease_ms, ask.skip));
                    room_answers.push(offer.map(|(offer, answered)| {
                        round.push(offer);
                        answered
                    }));
                }
                let batched = if group.is_empty() {
                    Batched::Done(Vec::new(), Vec::new(), Some(Vec::new()))
                } else if self.row_by_row {
                    Batched::RowByRow
                } else {
                    Self::admit_batched(
                        &mut tx,
                        &mut quota,
                        group,
                        now,
                        coalesce_ms,
                        handoff,
                        &mut round,
                        (self.told(), self.origin()),
                    )
                    .await?
                };
                let (admitted, handed, told) = match batched {
                    Batched::Done(admitted, handed, told) => {
                        if !group.is_empty() {
                            self.batched_groups
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        (admitted, handed, told)
                    }
                    Batched::RowByRow => (
                        Self::admit_each(&mut tx, &mut quota, group, now, coalesce_ms).await?,
                        Vec::new(),
                        None,
                    ),
                    Batched::Raced => {
                        // The offers taken went with the plan: the claims keep what the table
                        // gave them, claimed again in the new transaction.
                        tx.rollback().await?;
                        tx = self.begin_group_write(group).await?;
                        claimed = Self::claim_round(&mut tx, claims, now).await?;
                        (
                            Self::admit_each(&mut tx, &mut quota, group, now, coalesce_ms).await?,
                            Vec::new(),
                            None,
                        )
                    }
                };
                drop(round);
                let reported = if reports.is_empty() {
                    Vec::new()
                } else {
                    Self::finish_reported(&mut tx, reports, now).await?
                };
                // A batched round on PostgreSQL told replicas from its recipients' insert already.
                let told = match told {
                    Some(told) => told,
                    // SQLite: nothing to tell, nor to work out on every round.
                    None if !Self::TELLS_REPLICAS => Vec::new(),
                    None => {
                        let due = self.told().news(
                            &$crate::wake::earliest_due(group.iter().copied().zip(&admitted)),
                            now,
                        );
                        if !due.is_empty() {
                            let payload = $crate::wake::payload_from(&due, self.origin());
                            Self::wake_replicas(&mut tx, &payload).await?;
                        }
                        due
                    }
                };
                if let Err(error) = tx.commit().await {
                    quota.commit_failed();
                    // The server may have committed before the answer was lost with the
                    // connection (PostgreSQL), or may still be committing: the batches leased to
                    // this round's claims would then wait out their leases with no lane to send
                    // them. They are given back under their tokens, due again at once, as a gone
                    // claim's are, once their hosts' locks are free (`hand_back`: a commit still
                    // under way holds them); if nothing was committed, no row bears those tokens
                    // and the hand-back changes nothing. The claims themselves get an empty answer
                    // and look again.
                    if let Some(handoff) = handoff {
                        let leased = handed
                            .into_iter()
                            .flat_map(|(_, batches)| batches)
                            .chain(claimed.into_iter().flatten())
                            .collect::<Vec<_>>();
                        if !leased.is_empty() {
                            tracing::warn!(
                                %error,
                                batches = leased.len(),
                                "a round's commit failed; giving back what it leased to claims"
                            );
                            handoff.orphan(leased);
                        }
                    }
                    return Err(error.into());
                }
                quota.committed(now);
                self.heard_told(&told);
                if let Some(handoff) = handoff {
                    for (offer, batches) in handed {
                        handoff.answer(offer, batches);
                    }
                }
                // The round's claims add what the group handed them.
                for (got, answered) in claimed.iter_mut().zip(room_answers) {
                    if let Some(mut answered) = answered
                        && let Ok(handed) = answered.try_recv()
                    {
                        got.extend(handed);
                    }
                }
                Ok(Together {
                    admitted,
                    reported,
                    claimed,
                })
            }
        }
    };
}
pub(crate) use round_statements;
