//! Claiming: a long poll that reads when work is next due, takes turns while work is not piling
//! up, and claims in the writer's round or a transaction of its own.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::Instrument as _;

use super::{DeliveryQueue, MAX_CLAIM, MAX_LEASE_MS, MAX_WAIT_MS, now, refuse_nul};
use crate::error::QueueError;
use crate::handoff::{hand_back, record_lapsed_leases};
use crate::store::{ClaimAsk, ClaimedBatch, QueueStore, Skip};

/// What the last claim to end says to a lane that took its turn after it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LastClaim {
    /// Claims ended so far.
    pub(super) ended: u64,
    /// Whether it came back with all it asked for (more may be due).
    pub(super) full: bool,
    /// The providers it left alone.
    pub(super) skip: Skip,
}

/// One read of when the next batch is due, and when that read began.
#[derive(Debug, Clone, Copy)]
pub(super) struct DueRead {
    pub(super) began: std::time::Instant,
    pub(super) skip: Skip,
    pub(super) next: Option<i64>,
}

impl<S: QueueStore> DeliveryQueue<S> {
    /// Claims up to `max` due batches for `lane`. With nothing due, waits until the earliest batch
    /// becomes due, until woken by new work, or until `wait_ms` passes; it never polls on a timer.
    pub async fn claim(
        &self,
        lane: &str,
        max: i64,
        lease_ms: i64,
        wait_ms: u64,
    ) -> Result<Vec<ClaimedBatch>, QueueError> {
        self.claim_skipping(lane, max, lease_ms, wait_ms, Skip::default())
            .await
    }

    /// `claim`, leaving alone (neither claiming nor waiting for) the work of `skip`'s providers.
    pub async fn claim_skipping(
        &self,
        lane: &str,
        max: i64,
        lease_ms: i64,
        wait_ms: u64,
        skip: Skip,
    ) -> Result<Vec<ClaimedBatch>, QueueError> {
        refuse_nul(&[lane])?;
        if !(1..=MAX_CLAIM).contains(&max) || !(1_000..=MAX_LEASE_MS).contains(&lease_ms) {
            return Err(QueueError::InvalidRequest(
                "max_batches 1-64 and lease_ms 1000-300000",
            ));
        }
        let give_up = tokio::time::Instant::now() + Duration::from_millis(wait_ms.min(MAX_WAIT_MS));
        let waiting = self.wake.claim(skip);
        // Woken by news of work due at once (see below).
        let mut woken_due_now = false;
        loop {
            // Note what was heard before looking, so work committed meanwhile is not missed; and
            // while looking, work due at any time is news for this claim.
            waiting.looking();
            let heard = self.wake.heard(skip);
            let heard_due_now = self.wake.heard_due_now(skip);
            let claims_before = self.last_claim().ended;
            let listening_since = std::time::Instant::now();
            // A read first: a claim is a write transaction, and every admission wakes every
            // waiting lane, mostly for a window that is due seconds later. Claiming on each wake
            // put four empty write transactions per admission group in the one SQLite writer's
            // way; the read runs beside it. But news of work due at once says what the read
            // would: the lanes it woke go straight to their turns (on PostgreSQL, for work that no
            // waiting claim was handed, or another replica's, the read was a round trip between a
            // send's commit and its claim, and the server's most frequent statement).
            let until_due = if std::mem::take(&mut woken_due_now) {
                Some(Duration::ZERO)
            } else {
                self.next_due(skip, listening_since).await?.map(|at| {
                    Duration::from_millis(u64::try_from(at - now(&*self.clock)).unwrap_or(0))
                })
            };
            if until_due.is_some_and(|d| d.is_zero()) {
                // The lanes that one read found work for take turns: the first claims it all, and
                // a lane whose turn comes after a claim that came back short looks again rather
                // than claim what is gone. Profiled at 100 end-to-end flows on SQLite, three
                // claims in five came back empty, each a write transaction that waited some 10 ms
                // for the writer, in the admissions' way; on PostgreSQL, where claims run side by
                // side, two in three came back empty, each four round trips the server's CPU
                // bounded deliveries by. While claims come back full, work is piling up: a lane
                // then claims beside the one claiming rather than wait for its turn (taking turns
                // then cost 11-16% of the deliveries at 1,000 flows on SQLite).
                let turn = match self.claim_turn.try_lock() {
                    Ok(turn) => Some(turn),
                    Err(_) if self.last_claim().full => None,
                    // A claim held up (a lock, a busy pool) keeps the others waiting for their
                    // turn no longer than they would have waited for work.
                    Err(_) => {
                        match tokio::time::timeout_at(give_up, self.claim_turn.lock()).await {
                            Ok(turn) => Some(turn),
                            Err(_) => return Ok(Vec::new()),
                        }
                    }
                };
                if turn.is_some() {
                    // A short claim that skipped other providers' work says nothing of this one's.
                    let last = self.last_claim();
                    if last.ended != claims_before && !last.full && last.skip == skip {
                        continue;
                    }
                }
                self.claim_transactions.fetch_add(1, Ordering::Relaxed);
                let claimed = self.claim_once(lane, max, lease_ms, skip).await;
                let full = claimed
                    .as_ref()
                    .is_ok_and(|b| i64::try_from(b.len()).is_ok_and(|n| n >= max));
                {
                    let mut last = self.last_claims();
                    *last = LastClaim {
                        ended: last.ended + 1,
                        full,
                        skip,
                    };
                }
                drop(turn);
                let batches = claimed?;
                let result = if batches.is_empty() { "empty" } else { "work" };
                metrics::counter!("orca_push_queue_claims_total", "result" => result).increment(1);
                if !batches.is_empty() {
                    return Ok(batches);
                }
            }
            let remaining = give_up.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                return Ok(Vec::new());
            }
            let wait = until_due.unwrap_or(remaining).min(remaining);
            if wait.is_zero() {
                // Due but claimed by another lane in between: look again at once.
                tokio::task::yield_now().await;
                continue;
            }
            // Asleep until then, or until news of work this claim takes that is due before then
            // (a held provider's new work does not wake it), or until an admission hands it work
            // due at once.
            let until = tokio::time::Instant::now() + wait;
            waiting.asleep_until(until);
            if !self.store.hands_off() {
                self.wake.news(skip, heard, until).await;
                woken_due_now = self.wake.heard_due_now(skip) != heard_due_now;
                continue;
            }
            let max = usize::try_from(max).unwrap_or(1);
            let mut ticket = self.handoff.wait(lane, max, lease_ms, skip);
            let answered = tokio::select! {
                handed = ticket.answered() => Some(handed),
                () = self.wake.news(skip, heard, until) => None,
            };
            let handed = match answered {
                Some(handed) => handed,
                None => ticket.withdraw().await,
            };
            if !handed.is_empty() {
                self.handed_claims.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("orca_push_queue_claims_total", "result" => "handed")
                    .increment(1);
                return Ok(handed);
            }
        }
    }

    pub(super) fn last_claims(&self) -> std::sync::MutexGuard<'_, LastClaim> {
        // A plain record: a panicking holder cannot leave it half written.
        self.last_claim
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn last_claim(&self) -> LastClaim {
        *self.last_claims()
    }

    /// Claims answered by an admission's hand-off rather than a claim transaction.
    pub fn handed_claims(&self) -> u64 {
        self.handed_claims.load(Ordering::Relaxed)
    }

    /// Claims waiting now for an admission to hand them work.
    pub fn waiting_claims(&self) -> usize {
        self.handoff.waiting()
    }

    /// Batches given back so far because no lane would send them under the lease they were
    /// given (`crate::handoff::Handoff::orphan`).
    pub fn given_back_batches(&self) -> u64 {
        self.handoff.given_back()
    }

    /// When the next batch not skipped is due. Every lane woken by one commit asks at once; a read
    /// that began after `listening_since` (when the caller started listening for wakes) saw every
    /// commit the caller was not woken for, so lanes woken together share one read: on PostgreSQL
    /// these reads were the most frequent statement under load, four per admission group.
    pub(super) async fn next_due(
        &self,
        skip: Skip,
        listening_since: std::time::Instant,
    ) -> Result<Option<i64>, QueueError> {
        let mut last = self.due_read.lock().await;
        if let Some(read) = *last
            && read.skip == skip
            && read.began >= listening_since
        {
            return Ok(read.next);
        }
        let began = std::time::Instant::now();
        let next = self.store.next_available_at(skip).await?;
        self.due_reads.fetch_add(1, Ordering::Relaxed);
        *last = Some(DueRead { began, skip, next });
        Ok(next)
    }

    /// Notifications of other replicas' new work heard so far (PostgreSQL; see `Wake::notified`).
    pub fn replica_news(&self) -> u64 {
        self.wake.replica_news()
    }

    /// Reads of the earliest due time so far (see `next_due`).
    pub fn due_reads(&self) -> u64 {
        self.due_reads.load(Ordering::Relaxed)
    }

    /// Claims that found work due and went to the writer so far: a transaction of their own, or
    /// a place in a writer's round (`QueueStore::claims_in_rounds`).
    pub fn claim_transactions(&self) -> u64 {
        self.claim_transactions.load(Ordering::Relaxed)
    }

    /// One claim: in the writer's next round where the store says so, else a transaction run on
    /// a task of its own. Either way a caller that goes away mid-claim (the gRPC call ends with
    /// its caller) neither drops a write transaction halfway nor leaves what it leased to wait out
    /// the lease: that work is handed back at once.
    pub(super) async fn claim_once(
        &self,
        lane: &str,
        max: i64,
        lease_ms: i64,
        skip: Skip,
    ) -> Result<Vec<ClaimedBatch>, QueueError> {
        if self.store.claims_in_rounds() {
            // In the writer's next round, which records lapsed leases and gives back what a
            // caller gone by then was answered.
            let ask = ClaimAsk {
                lane: lane.to_owned(),
                max,
                lease_ms,
                skip,
            };
            let answered = self.admissions.claim(ask).await?;
            return self.handoff.claim_answer(answered).read().await;
        }
        let store = self.store.clone();
        let clock = self.clock.clone();
        let wake = self.wake.clone();
        let lane = lane.to_owned();
        let (answer, answered) = tokio::sync::oneshot::channel();
        // Read through the hand-off's guard: dropped unread, the batches go back at once.
        let answered = self.handoff.claim_answer(answered);
        tokio::spawn(
            async move {
                let now = now(&*clock);
                let (claimed, not_committed) =
                    match store.claim(&lane, max, lease_ms, now, skip).await {
                        Err(QueueError::ClaimNotCommitted { leased, error }) => {
                            tracing::warn!(
                                %error,
                                batches = leased.len(),
                                "a claim's commit failed; giving back what it leased"
                            );
                            (Err(*error), leased)
                        }
                        claimed => (claimed, Vec::new()),
                    };
                if let Ok(batches) = &claimed {
                    record_lapsed_leases(batches);
                }
                if let Err(Ok(batches)) = answer.send(claimed) {
                    hand_back(&store, &wake, &batches, now).await;
                }
                hand_back(&store, &wake, &not_committed, now).await;
            }
            .in_current_span(),
        );
        answered.read().await
    }
}
