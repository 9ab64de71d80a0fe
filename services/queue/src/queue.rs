//! The queue's behaviour over a store: admission, claiming with a long poll that never busy-waits,
//! leases, outcomes, cleanup.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use orca_push_storage::Clock;
use tracing::Instrument as _;

use crate::error::QueueError;
use crate::group_commit::GroupCommit;
use crate::handoff::{Handoff, hand_back, record_lapsed_leases};
use crate::model::{Admission, Kind, Provider};
use crate::store::{
    ClaimAsk, ClaimedBatch, Cleaned, Completion, Depth, EventRecord, Outcome, QueueStore, Retry,
    RetryResult, Skip,
};
use crate::wake::Wake;

/// Leases a lane may ask for, and claims per call.
pub const MAX_LEASE_MS: i64 = 5 * 60 * 1000;
pub const MAX_CLAIM: i64 = 64;
/// Final answers one `CompleteMany` call may carry.
pub const MAX_COMPLETIONS: usize = 256;
/// The longest a claim waits for work before answering empty.
pub const MAX_WAIT_MS: u64 = 30_000;
/// The longest a provider's work is held in one call.
pub const MAX_HOLD_MS: i64 = 5 * 60 * 1000;

pub struct DeliveryQueue<S> {
    store: S,
    clock: Arc<dyn Clock>,
    /// Wakes waiting claims when work may have become due (this process's admissions and retries,
    /// and other replicas' through PostgreSQL notifications).
    wake: Arc<Wake>,
    /// Admissions that arrive together commit together.
    admissions: GroupCommit,
    /// Waiting claims, answered by the admissions that make work due at once.
    handoff: Arc<Handoff>,
    claim_transactions: AtomicU64,
    handed_claims: AtomicU64,
    due_reads: AtomicU64,
    /// The last read of the earliest due time, shared by lanes woken together.
    due_read: tokio::sync::Mutex<Option<DueRead>>,
    /// With one writer, this replica's claims take turns while work is not piling up (see
    /// `claim_skipping`).
    claim_turn: tokio::sync::Mutex<()>,
    /// The last claim to end (with one writer).
    last_claim: std::sync::Mutex<LastClaim>,
}

/// What the last claim to end says to a lane that took its turn after it.
#[derive(Debug, Clone, Copy, Default)]
struct LastClaim {
    /// Claims ended so far.
    ended: u64,
    /// Whether it came back with all it asked for (more may be due).
    full: bool,
    /// The providers it left alone.
    skip: Skip,
}

/// One read of when the next batch is due, and when that read began.
#[derive(Debug, Clone, Copy)]
struct DueRead {
    began: std::time::Instant,
    skip: Skip,
    next: Option<i64>,
}

fn now(clock: &dyn Clock) -> i64 {
    i64::try_from(clock.now_ms()).unwrap_or(i64::MAX)
}

impl<S: QueueStore> DeliveryQueue<S> {
    /// A queue over `store`; its admission writers run until it is dropped.
    pub fn new(store: S, clock: Arc<dyn Clock>, coalesce_ms: u64, wake: Arc<Wake>) -> Self {
        let coalesce_ms = i64::try_from(coalesce_ms).unwrap_or(0);
        let handoff = Arc::new(Handoff::new(crate::handoff::give_back(
            store.clone(),
            clock.clone(),
            wake.clone(),
        )));
        let admissions = GroupCommit::start(
            store.clone(),
            clock.clone(),
            coalesce_ms,
            wake.clone(),
            handoff.clone(),
        );
        Self {
            store,
            clock,
            wake,
            admissions,
            handoff,
            claim_transactions: AtomicU64::new(0),
            handed_claims: AtomicU64::new(0),
            due_reads: AtomicU64::new(0),
            due_read: tokio::sync::Mutex::new(None),
            claim_turn: tokio::sync::Mutex::new(()),
            last_claim: std::sync::Mutex::new(LastClaim::default()),
        }
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Admissions and reports waiting for the group commit's writer to take them.
    pub fn waiting_for_writer(&self) -> usize {
        self.admissions.waiting()
    }

    /// Admission groups committed so far (each one transaction).
    pub fn admission_groups(&self) -> u64 {
        self.admissions.groups()
    }

    /// Admits a notification for already-resolved recipients; one status per recipient, in order.
    pub async fn enqueue(
        &self,
        admission: &Admission,
    ) -> Result<crate::store::Enqueued, QueueError> {
        admission.validate()?;
        // Quota refusals are counted by the writer that decides them (`GroupCommit`).
        self.admissions.admit(admission.clone()).await
    }

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
        loop {
            // Note what was heard before looking, so work committed meanwhile is not missed; and
            // while looking, work due at any time is news for this claim.
            waiting.looking();
            let heard = self.wake.heard(skip);
            let claims_before = self.last_claim().ended;
            let listening_since = std::time::Instant::now();
            // A read first: a claim is a write transaction, and every admission wakes every
            // waiting lane, mostly for a window that is due seconds later. Claiming on each wake
            // put four empty write transactions per admission group in the one SQLite writer's
            // way; the read runs beside it.
            let until_due = self.next_due(skip, listening_since).await?.map(|at| {
                Duration::from_millis(u64::try_from(at - now(&*self.clock)).unwrap_or(0))
            });
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

    fn last_claims(&self) -> std::sync::MutexGuard<'_, LastClaim> {
        // A plain record: a panicking holder cannot leave it half written.
        self.last_claim
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn last_claim(&self) -> LastClaim {
        *self.last_claims()
    }

    /// Claims answered by an admission's hand-off rather than a claim transaction.
    pub fn handed_claims(&self) -> u64 {
        self.handed_claims.load(Ordering::Relaxed)
    }

    /// When the next batch not skipped is due. Every lane woken by one commit asks at once; a read
    /// that began after `listening_since` (when the caller started listening for wakes) saw every
    /// commit the caller was not woken for, so lanes woken together share one read: on PostgreSQL
    /// these reads were the most frequent statement under load, four per admission group.
    async fn next_due(
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
    async fn claim_once(
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
                let claimed = store.claim(&lane, max, lease_ms, now, skip).await;
                if let Ok(batches) = &claimed {
                    record_lapsed_leases(batches);
                }
                if let Err(Ok(batches)) = answer.send(claimed) {
                    hand_back(&store, &wake, &batches, now).await;
                }
            }
            .in_current_span(),
        );
        answered.read().await
    }

    pub async fn renew(
        &self,
        batch_id: &str,
        token: &str,
        lease_ms: i64,
    ) -> Result<Option<i64>, QueueError> {
        refuse_nul(&[batch_id, token])?;
        if !(1_000..=MAX_LEASE_MS).contains(&lease_ms) {
            return Err(QueueError::InvalidRequest("lease_ms 1000-300000"));
        }
        let until = now(&*self.clock) + lease_ms;
        Ok(self
            .store
            .renew(batch_id, token, until)
            .await?
            .then_some(until))
    }

    pub async fn complete(
        &self,
        batch_id: &str,
        token: &str,
        outcome: Outcome,
        reason: &str,
        answered: bool,
    ) -> Result<bool, QueueError> {
        let recorded = self
            .complete_many(vec![Completion {
                batch_id: batch_id.to_owned(),
                lease_token: token.to_owned(),
                outcome,
                reason: reason.to_owned(),
                answered,
            }])
            .await?;
        Ok(recorded.first().copied().unwrap_or(false))
    }

    /// Several final answers in one transaction, each against its own lease.
    pub async fn complete_many(
        &self,
        mut completions: Vec<Completion>,
    ) -> Result<Vec<bool>, QueueError> {
        if completions.len() > MAX_COMPLETIONS {
            return Err(QueueError::InvalidRequest("at most 256 reports per call"));
        }
        for c in &mut completions {
            refuse_nul(&[&c.batch_id, &c.lease_token])?;
            c.reason = bounded_reason(&c.reason);
        }
        if self.store.reports_in_rounds() {
            self.admissions.report(completions).await
        } else {
            self.store.complete(&completions, now(&*self.clock)).await
        }
    }

    pub async fn retry(
        &self,
        batch_id: &str,
        token: &str,
        at: i64,
        reason: &str,
        how: Retry,
    ) -> Result<RetryResult, QueueError> {
        refuse_nul(&[batch_id, token])?;
        let result = self
            .store
            .retry(
                batch_id,
                token,
                at,
                &bounded_reason(reason),
                how,
                now(&*self.clock),
            )
            .await?;
        if result == RetryResult::Scheduled {
            self.wake.any();
        }
        Ok(result)
    }

    /// Holds a failing provider's pending work until `until` (at most five minutes ahead: every
    /// deadline is, so a longer hold only means expiry): the batches due before `due_before` (all
    /// those due before `until` when absent), so batches already held further out cost nothing.
    pub async fn hold(
        &self,
        provider: Provider,
        until: i64,
        due_before: Option<i64>,
    ) -> Result<u64, QueueError> {
        let now = now(&*self.clock);
        if provider == Provider::Unknown || until <= now {
            return Err(QueueError::InvalidRequest(
                "a provider, and a time in the future",
            ));
        }
        let until = until.min(now + MAX_HOLD_MS);
        let held = self
            .store
            .hold(provider, until, due_before.unwrap_or(until).min(until))
            .await?;
        if held > 0 {
            tracing::info!(
                provider = provider.as_str(),
                held,
                "holding a failing provider's work"
            );
        }
        Ok(held)
    }

    /// Makes a held provider's work due again: all of it (the provider recovered), or `limit`
    /// batches (a probe).
    pub async fn release(&self, provider: Provider, limit: Option<u64>) -> Result<u64, QueueError> {
        let now = now(&*self.clock);
        if provider == Provider::Unknown {
            return Err(QueueError::InvalidRequest("a provider"));
        }
        let limit = limit.map_or(i64::MAX, |n| i64::try_from(n).unwrap_or(i64::MAX));
        {
            let released = self.store.release(provider, now, limit).await?;
            if released > 0 {
                self.wake.work_for([provider]);
                tracing::info!(
                    provider = provider.as_str(),
                    released,
                    "released a recovered provider's work"
                );
            }
            Ok(released)
        }
    }

    pub async fn event_record(
        &self,
        host: &str,
        kind: Kind,
        epoch: &str,
        seq: i64,
    ) -> Result<Option<EventRecord>, QueueError> {
        refuse_nul(&[host, epoch])?;
        self.store.event_record(host, kind, epoch, seq).await
    }

    pub async fn depth(&self) -> Result<Depth, QueueError> {
        self.store.depth(now(&*self.clock)).await
    }

    /// Publishes the depth gauges (aggregate, no labels beyond the state).
    pub async fn record_depth(&self) {
        match self.depth().await {
            Ok(depth) => {
                metrics::gauge!("orca_push_queue_batches", "state" => "waiting")
                    .set(depth.waiting as f64);
                metrics::gauge!("orca_push_queue_batches", "state" => "due").set(depth.due as f64);
                metrics::gauge!("orca_push_queue_batches", "state" => "leased")
                    .set(depth.leased as f64);
                metrics::gauge!("orca_push_queue_oldest_due_age_seconds")
                    .set(depth.oldest_due_age_ms as f64 / 1000.0);
            }
            Err(error) => tracing::warn!(%error, "queue depth unavailable"),
        }
    }

    pub async fn cleanup(&self) -> Result<Cleaned, QueueError> {
        self.store.cleanup(now(&*self.clock)).await
    }
}

/// PostgreSQL refuses U+0000 in text (SQLite would store it): refused before any SQL, so both
/// backends answer INVALID_ARGUMENT alike.
fn refuse_nul(values: &[&str]) -> Result<(), QueueError> {
    if values.iter().any(|v| v.contains('\0')) {
        Err(QueueError::InvalidRequest("NUL in a string"))
    } else {
        Ok(())
    }
}

/// Reasons are machine words from the sender; keep them short and printable.
fn bounded_reason(reason: &str) -> String {
    reason
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(64)
        .collect()
}
