//! The queue's behaviour over a store: admission, claiming with a long poll that never busy-waits,
//! leases, outcomes, cleanup.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use orca_push_storage::Clock;

use crate::error::QueueError;
use crate::group_commit::GroupCommit;
use crate::handoff::Handoff;
use crate::model::{Admission, Kind, Provider};
use crate::store::{
    Cleaned, Completion, Depth, EventRecord, Outcome, QueueStore, Retry, RetryResult,
};
use crate::wake::Wake;

mod claiming;

use claiming::{DueRead, LastClaim};

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

    /// Why the queue cannot admit though its database answers, if it cannot: its SQLite WAL
    /// could not be synced, and every admission is refused until a restart (`WalSync`). Its
    /// health then says NOT_SERVING, so `/ready` and probes see it.
    pub fn broken(&self) -> Option<&'static str> {
        self.store
            .wal_sync()
            .is_some_and(orca_push_storage::WalSync::has_failed)
            .then_some("the SQLite WAL could not be synced")
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
        // A time before 1970 is never due to a claim (claims ask for available_at >= 0): the batch
        // would wait for its deadline instead.
        if at < 0 {
            return Err(QueueError::InvalidRequest("retry_at_ms: Unix milliseconds"));
        }
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
