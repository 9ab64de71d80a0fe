//! A writer's round: its admissions (and, where the backend says so, lanes' reports) in one
//! transaction, and what happens when that transaction fails: the admissions again together, then
//! each on its own, so one bad admission never fails its neighbours; the reports in a transaction
//! of their own, apart from the admissions.

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
            ) -> Vec<Result<Enqueued, QueueError>> {
                if group.len() > 1 {
                    match self
                        .admit_together(group, &[], now, coalesce_ms, handoff)
                        .await
                    {
                        Ok((admitted, _)) => return admitted.into_iter().map(Ok).collect(),
                        Err(error) => tracing::debug!(
                            %error,
                            size = group.len(),
                            "group admission failed; admitting one by one"
                        ),
                    }
                }
                let mut results = Vec::with_capacity(group.len());
                for a in group {
                    let one = self
                        .admit_together(&[a], &[], now, coalesce_ms, handoff)
                        .await;
                    results.push(one.map(|(mut admitted, _)| admitted.remove(0)));
                }
                results
            }

            /// `QueueStore::write_round`: the group and the reports in one transaction; if that
            /// fails, each on its own as `enqueue_group` and `complete` would.
            async fn admit_and_report(
                &self,
                group: &[&Admission],
                reports: &[Completion],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&$crate::handoff::Handoff>,
            ) -> Round {
                if group.is_empty() {
                    return Round {
                        admitted: Vec::new(),
                        reported: self.complete_leased(reports, now).await,
                    };
                }
                if !reports.is_empty() {
                    match self
                        .admit_together(group, reports, now, coalesce_ms, handoff)
                        .await
                    {
                        Ok((admitted, reported)) => {
                            return Round {
                                admitted: admitted.into_iter().map(Ok).collect(),
                                reported: Ok(reported),
                            };
                        }
                        Err(error) => tracing::debug!(
                            %error,
                            size = group.len(),
                            reports = reports.len(),
                            "round failed; admitting and reporting apart"
                        ),
                    }
                }
                Round {
                    admitted: self.admit_group(group, now, coalesce_ms, handoff).await,
                    reported: self.complete_leased(reports, now).await,
                }
            }

            /// Admits a group and records `reports` in one transaction, or fails as a whole
            /// (nothing written, nothing handed to a claim).
            async fn admit_together(
                &self,
                group: &[&Admission],
                reports: &[Completion],
                now: i64,
                coalesce_ms: i64,
                handoff: Option<&$crate::handoff::Handoff>,
            ) -> Result<(Vec<Enqueued>, Vec<bool>), QueueError> {
                use $crate::admission::Batched;
                let mut tx = self.begin_group_write(group).await?;
                let batched = if self.row_by_row {
                    Batched::RowByRow
                } else {
                    Self::admit_batched(&mut tx, group, now, coalesce_ms, handoff).await?
                };
                let (admitted, handed) = match batched {
                    Batched::Done(admitted, handed) => {
                        self.batched_groups
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        (admitted, handed)
                    }
                    Batched::RowByRow => (
                        Self::admit_each(&mut tx, group, now, coalesce_ms).await?,
                        Vec::new(),
                    ),
                    Batched::Raced => {
                        tx.rollback().await?;
                        tx = self.begin_group_write(group).await?;
                        (
                            Self::admit_each(&mut tx, group, now, coalesce_ms).await?,
                            Vec::new(),
                        )
                    }
                };
                let reported = if reports.is_empty() {
                    Vec::new()
                } else {
                    Self::finish_reported(&mut tx, reports, now).await?
                };
                let due = $crate::wake::earliest_due(group.iter().copied().zip(&admitted));
                if !due.is_empty() {
                    Self::wake_replicas(&mut tx, &$crate::wake::payload_naming(&due)).await?;
                }
                tx.commit().await?;
                if let Some(handoff) = handoff {
                    for (offer, batches) in handed {
                        handoff.answer(offer, batches);
                    }
                }
                Ok((admitted, reported))
            }
        }
    };
}
pub(crate) use round_statements;
