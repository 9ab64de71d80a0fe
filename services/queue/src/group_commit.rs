//! Group commit: admissions that arrive together commit together. Each admission waits on a
//! channel; a writer takes everything waiting (up to `MAX_GROUP`) and admits it in one transaction,
//! then answers each caller, so `queued` still means committed. While one group commits, the next
//! gathers. Callers of one host that wait for each other's answers are in successive groups, in
//! order; within a group admissions run in arrival order, so quota counts what went before.
//!
//! Where the store says so (`QueueStore::reports_in_rounds`, `claims_in_rounds`: SQLite), lanes'
//! reports and claims wait on the same channel and run in the same transaction as the admissions
//! they arrived with: a claim there first takes what is due in the table, then the round's new
//! work due at once, written already leased to it. Claims are answered at the commit (a lease
//! needs no sync: lost, the work is due again), the rest once the round is synced.
//! Where its commits do not wait for the disk (`QueueStore::wal_sync`: SQLite under full
//! durability), a round is answered once a WAL sync after its commit is done: by the writer before
//! its next round when little waits, else beside it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use orca_push_storage::Clock;
use tokio::sync::{Mutex, mpsc, oneshot};
use tracing::Instrument as _;

use crate::error::QueueError;
use crate::handoff::Handoff;
use crate::model::Admission;
use crate::store::{ClaimAsk, ClaimedBatch, Completion, Enqueued, QueueStore};
use crate::wake::Wake;

mod answers;
mod side_by_side;

use answers::{Answers, Refused, ReportAnswer, answer_claims};
use side_by_side::{Committing, Running};

/// The most admissions one transaction carries.
pub const MAX_GROUP: usize = 128;
/// Report rows past which a round takes no more reports.
pub const MAX_ROUND_REPORTS: usize = 512;
/// The most claims one round carries (a sender runs four lanes, each with one claim at a time).
pub const MAX_ROUND_CLAIMS: usize = 16;
/// Work waiting for the next round from which a round's sync runs beside it rather than before
/// it (`orca_push_storage::wal_sync`).
const PIPELINE_FROM: usize = 16;
/// Admissions and reports waiting for a writer before callers wait to hand theirs over.
const WAITING: usize = 4 * MAX_GROUP;
/// How long a writer waits for work before it gives back what its rounds keep from one to the
/// next (`QueueStore::writers_busy`): a little longer than the gap between rounds under a steady
/// load, which the timer's millisecond ticks round up.
const IDLE_AFTER: std::time::Duration = std::time::Duration::from_millis(1);
/// What waits for a writer's round. Not boxed: the channel's slots are as large as an admission
/// either way, and a box would cost every admission an allocation.
#[allow(clippy::large_enum_variant)]
enum Work {
    Admit(Waiting),
    Report(Reporting),
    Claim(Claiming),
}

/// A lane's claim, as `QueueStore::claim` takes it.
struct Claiming {
    ask: ClaimAsk,
    answer: ClaimAnswer,
    /// The caller's span, as an admission's.
    span: tracing::Span,
}

/// Where a claim's batches go.
pub type ClaimAnswer = oneshot::Sender<Result<Vec<ClaimedBatch>, QueueError>>;

/// Final answers a lane reported, each against its own lease.
struct Reporting {
    completions: Vec<Completion>,
    answer: ReportAnswer,
    /// The caller's span, as an admission's.
    span: tracing::Span,
}

struct Waiting {
    admission: Admission,
    answer: oneshot::Sender<Result<Enqueued, QueueError>>,
    /// The caller's span: the group's work is traced under the first caller's and linked from
    /// every other's.
    span: tracing::Span,
}

/// Hands admissions to the writers.
pub struct GroupCommit {
    waiting: mpsc::Sender<Work>,
    groups: Arc<AtomicU64>,
}

impl GroupCommit {
    /// Starts `store.group_writers()` writers, which stop when this is dropped. Work a group
    /// makes due at once goes to the claims waiting in `handoff`.
    pub fn start<S: QueueStore>(
        store: S,
        clock: Arc<dyn Clock>,
        coalesce_ms: i64,
        wake: Arc<Wake>,
        handoff: Arc<Handoff>,
    ) -> Self {
        let (waiting, queue) = mpsc::channel(WAITING);
        let queue = Arc::new(Mutex::new(queue));
        let groups = Arc::new(AtomicU64::new(0));
        let writers = store.group_writers().max(1);
        let running = (writers > 1).then(|| Arc::new(Running::default()));
        let mut own_thread = Vec::new();
        for _ in 0..writers {
            let writer = Writer {
                store: store.clone(),
                clock: clock.clone(),
                coalesce_ms,
                wake: wake.clone(),
                handoff: handoff.clone(),
                queue: queue.clone(),
                groups: groups.clone(),
                running: running.clone(),
            };
            if store.writer_thread() {
                own_thread.push(writer);
            } else {
                tokio::spawn(writer.run());
            }
        }
        if !own_thread.is_empty() {
            spawn_on_own_thread(own_thread, store.writer_io());
        }
        Self { waiting, groups }
    }

    /// Admissions and reports waiting for a writer to take them.
    pub fn waiting(&self) -> usize {
        self.waiting.max_capacity() - self.waiting.capacity()
    }

    /// Groups handed to the store so far.
    pub fn groups(&self) -> u64 {
        self.groups.load(Ordering::Relaxed)
    }

    /// Puts `work` in line for the next round.
    async fn hand(&self, work: Work) -> Result<(), QueueError> {
        self.waiting
            .send(work)
            .await
            .map_err(|_| QueueError::WriterStopped)
    }

    /// Admits `admission` with whatever else is waiting; answers once its group has committed.
    pub async fn admit(&self, admission: Admission) -> Result<Enqueued, QueueError> {
        let (answer, answered) = oneshot::channel();
        self.hand(Work::Admit(Waiting {
            admission,
            answer,
            span: tracing::Span::current(),
        }))
        .await?;
        answered.await.map_err(|_| QueueError::WriterStopped)?
    }

    /// Records final answers in the next round (`QueueStore::reports_in_rounds`); one flag per
    /// answer, once the round has committed.
    pub async fn report(&self, completions: Vec<Completion>) -> Result<Vec<bool>, QueueError> {
        if completions.is_empty() {
            return Ok(Vec::new());
        }
        let (answer, answered) = oneshot::channel();
        self.hand(Work::Report(Reporting {
            completions,
            answer,
            span: tracing::Span::current(),
        }))
        .await?;
        answered.await.map_err(|_| QueueError::WriterStopped)?
    }

    /// Claims in the next round (`QueueStore::claims_in_rounds`); the batches come on the
    /// returned receiver once the round has committed. What is answered to a receiver dropped
    /// meanwhile goes to the hand-off's orphans.
    pub async fn claim(
        &self,
        ask: ClaimAsk,
    ) -> Result<oneshot::Receiver<Result<Vec<ClaimedBatch>, QueueError>>, QueueError> {
        let (answer, answered) = oneshot::channel();
        self.hand(Work::Claim(Claiming {
            ask,
            answer,
            span: tracing::Span::current(),
        }))
        .await?;
        Ok(answered)
    }
}

/// What one round takes: admissions (up to `MAX_GROUP`), reports (up to about
/// `MAX_ROUND_REPORTS` rows) and claims (up to `MAX_ROUND_CLAIMS`).
#[derive(Default)]
struct Batch {
    admissions: Vec<Waiting>,
    reports: Vec<Reporting>,
    report_rows: usize,
    claims: Vec<Claiming>,
}

impl Batch {
    fn add(&mut self, work: Work) {
        match work {
            Work::Admit(waiting) => self.admissions.push(waiting),
            Work::Report(reporting) => {
                self.report_rows += reporting.completions.len();
                self.reports.push(reporting);
            }
            Work::Claim(claiming) => self.claims.push(claiming),
        }
    }

    /// Admissions, reports and claims, each counted once.
    fn len(&self) -> usize {
        self.admissions.len() + self.reports.len() + self.claims.len()
    }

    fn full(&self) -> bool {
        self.admissions.len() >= MAX_GROUP
            || self.report_rows >= MAX_ROUND_REPORTS
            || self.claims.len() >= MAX_ROUND_CLAIMS
    }

    /// Whatever else is already waiting, up to a full round.
    fn take_waiting(&mut self, queue: &mut mpsc::Receiver<Work>) {
        while !self.full() {
            match queue.try_recv() {
                Ok(next) => self.add(next),
                Err(_) => break,
            }
        }
    }
}

/// Runs `writers` on a thread of their own, with a runtime of their own. Every statement of a
/// group is a round trip (to sqlx's SQLite worker thread, or to the PostgreSQL server); on the
/// shared runtime the writer then waits behind every ready request task before it sends the next
/// one (profiled on SQLite: 3-4 ms per group of 30 on two busy cores before anything was written).
/// On its own thread it is woken at once.
///
/// `io`: whether the writers' connections are sockets this runtime drives (PostgreSQL: the
/// store's round connections are opened here, so their answers wake this thread directly).
/// Without it the runtime has a timer (the pool's acquire timeout) but no I/O driver, and the
/// thread parks on a futex rather than in `epoll_wait`, woken without an `eventfd` write: on
/// SQLite, nothing on it does I/O (SQLite runs on sqlx's thread, the sync is a blocking call), and
/// the I/O driver's turn was a fifth of this thread's samples at 100 end-to-end flows.
fn spawn_on_own_thread<S: QueueStore>(writers: Vec<Writer<S>>, io: bool) {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time();
    if io {
        builder.enable_io();
    }
    match builder.build() {
        Ok(runtime) => {
            let thread = std::thread::Builder::new()
                .name("queue-writer".into())
                .spawn(move || {
                    runtime.block_on(futures::future::join_all(
                        writers.into_iter().map(Writer::run),
                    ))
                });
            if let Err(error) = thread {
                tracing::error!(%error, "the admission writers' thread did not start");
            }
        }
        Err(error) => {
            tracing::warn!(%error, "no runtime for the admission writers; they share the main one");
            for writer in writers {
                tokio::spawn(writer.run());
            }
        }
    }
}

struct Writer<S> {
    store: S,
    clock: Arc<dyn Clock>,
    coalesce_ms: i64,
    wake: Arc<Wake>,
    handoff: Arc<Handoff>,
    queue: Arc<Mutex<mpsc::Receiver<Work>>>,
    groups: Arc<AtomicU64>,
    /// The rounds committing now, where writers run side by side (`SIDE_BY_SIDE_FROM`).
    running: Option<Arc<Running>>,
}

/// Which of a round's callers its span goes under: the first that is sampled, else the first.
/// Under the first alone, a caller whose own trace is not sampled (its `traceparent` said `-00`)
/// would leave the round and its SQL out of every other caller's trace too.
fn parent_of<'a>(
    callers: impl Iterator<Item = &'a tracing::Span>,
    sampled: impl Fn(&tracing::Span) -> bool,
) -> usize {
    callers
        .enumerate()
        .find(|(_, span)| sampled(span))
        .map_or(0, |(at, _)| at)
}

impl<S: QueueStore> Writer<S> {
    async fn run(self) {
        self.store.writers_busy(true);
        while let Some((batch, committing)) = self.next_round().await {
            // Traced under the first sampled caller's span (an admission's if any), linked from
            // the others'.
            let callers = batch
                .admissions
                .iter()
                .map(|w| &w.span)
                .chain(batch.reports.iter().map(|r| &r.span))
                .chain(batch.claims.iter().map(|c| &c.span));
            let parent_at = parent_of(callers.clone(), orca_push_telemetry::is_sampled);
            let parent = callers.clone().nth(parent_at);
            let span = tracing::info_span!(
                parent: parent.cloned().unwrap_or_else(tracing::Span::none),
                "queue.group_commit",
                otel.kind = "internal",
                admissions = batch.admissions.len(),
                reports = batch.report_rows,
                claims = batch.claims.len(),
            );
            for (_, other) in callers.enumerate().filter(|(at, _)| *at != parent_at) {
                span.follows_from(other);
            }
            // A panic while committing (a bug, or a driver's) must not stop admission for good:
            // the round's callers get `WriterStopped` (their answers are dropped: never a false
            // `queued`), and this writer goes on with the next round.
            let commit = std::panic::AssertUnwindSafe(self.commit(batch).instrument(span));
            let panicked = futures::FutureExt::catch_unwind(commit).await.is_err();
            drop(committing);
            if panicked {
                tracing::error!("the admission writer panicked committing a group; it goes on");
                metrics::counter!("orca_push_queue_writer_panics_total").increment(1);
            }
        }
        self.store.writers_busy(false);
    }

    /// Waits for one admission or report, then takes whatever else is already waiting. None:
    /// stopped. With writers side by side, the round counts as committing from before the next
    /// writer can take work, so that one sees it and gathers.
    async fn next_round(&self) -> Option<(Batch, Option<Committing<'_>>)> {
        let mut queue = self.queue.lock().await;
        let mut batch = Batch::default();
        let first = match queue.try_recv() {
            Ok(work) => work,
            Err(_) if !self.store.keeps_between_rounds() => queue.recv().await?,
            // What a round kept for the next goes back once no work came for `IDLE_AFTER`.
            Err(_) => match tokio::time::timeout(IDLE_AFTER, queue.recv()).await {
                Ok(work) => work?,
                Err(_) => {
                    self.store.writers_busy(false);
                    let work = queue.recv().await?;
                    self.store.writers_busy(true);
                    work
                }
            },
        };
        batch.add(first);
        batch.take_waiting(&mut queue);
        if let Some(running) = &self.running {
            side_by_side::gather_while_another_commits(running, &mut queue, &mut batch).await;
        }
        let committing = self.running.as_deref().map(Committing::start);
        drop(queue);
        Some((batch, committing))
    }

    /// Admissions and reports waiting for the next round (0 while another writer takes them).
    fn waiting(&self) -> usize {
        self.queue.try_lock().map_or(0, |queue| queue.len())
    }

    /// Once the WAL could not be synced, nothing is answered as durable until a restart:
    /// admissions are then refused before they are written, rather than written and answered as
    /// refused. Written, they would be delivered and charged to their host's quota while the host
    /// was told they were not accepted (and its retries would be written again). Reports and
    /// claims still go: their deliveries happened, and a lease needs no sync.
    fn refuse_if_never_durable(&self, group: Vec<Waiting>) -> Vec<Waiting> {
        let Some(Err(failed)) = self
            .store
            .wal_sync()
            .filter(|sync| sync.has_failed())
            .map(orca_push_storage::WalSync::sync_now)
        else {
            return group;
        };
        let failed = Arc::new(QueueError::NotDurable(failed));
        for waiting in group {
            let _ = waiting.answer.send(Err(QueueError::Round(failed.clone())));
        }
        Vec::new()
    }

    async fn commit(&self, batch: Batch) {
        let Batch {
            admissions: group,
            reports,
            claims,
            ..
        } = batch;
        let group = self.refuse_if_never_durable(group);
        if !group.is_empty() {
            metrics::histogram!("orca_push_queue_admission_group_size").record(group.len() as f64);
            self.groups.fetch_add(1, Ordering::Relaxed);
        }
        let now = i64::try_from(self.clock.now_ms()).unwrap_or(i64::MAX);
        let admissions: Vec<&Admission> = group.iter().map(|w| &w.admission).collect();
        // The reports' rows move into one list; each caller keeps how many of them are its own.
        let mut completions: Vec<Completion> = Vec::new();
        let reports: Vec<(ReportAnswer, usize)> = reports
            .into_iter()
            .map(|r| {
                let rows = r.completions.len();
                completions.extend(r.completions);
                (r.answer, rows)
            })
            .collect();
        let (asks, claim_answers): (Vec<ClaimAsk>, Vec<ClaimAnswer>) =
            claims.into_iter().map(|c| (c.ask, c.answer)).unzip();
        let round = self
            .store
            .write_round(
                &admissions,
                &completions,
                &asks,
                now,
                self.coalesce_ms,
                self.store.hands_off().then_some(&*self.handoff),
            )
            .await;
        let admitted = admissions
            .iter()
            .zip(&round.admitted)
            .filter_map(|(a, r)| Some((*a, r.as_ref().ok()?)));
        // Committed, and so visible to claims (a hand-off may already have given some of it to
        // one): lanes may start on it while it is synced.
        let committed = i64::try_from(self.clock.now_ms()).unwrap_or(i64::MAX);
        self.wake
            .work_due(&crate::wake::earliest_due(admitted), committed);
        if round.uncertain {
            // This replica skips the echo of what it notified (`wake::payload_from`): a round
            // whose commit's answer was lost may have committed work that no result names.
            self.wake.any();
        }
        // A lease needs no sync (lost, its work is due again), and the work handed to claims
        // waiting outside the round goes at the commit too.
        answer_claims(&self.handoff, claim_answers, round.claimed);
        let answers = Answers {
            refused: Refused::of(&admissions, &round.admitted),
            admissions: group.into_iter().map(|w| w.answer).collect(),
            admitted: round.admitted,
            reports,
            reported: round.reported,
        };
        // `queued` still means on disk: answered once a sync after this commit is done. A round
        // of claims alone is synced too: skipping it measured slower at 1,000 flows (smaller
        // rounds after it; docs/benchmarks.md, round 17), and its claims were answered already.
        match self.store.wal_sync() {
            // Work piling up: the writer goes on with the next round while this one is synced.
            Some(sync) if self.waiting() >= PIPELINE_FROM => {
                sync.after_sync(move |synced| answers.send(synced))
            }
            // Little waiting: the writer syncs itself, as a commit at FULL would, sparing the
            // answers a hop to another thread (measured at 8 connections: 0.4 ms more per send
            // when every round went through the sync thread).
            Some(sync) => answers.send(sync.sync_now()),
            None => answers.send(Ok(())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    use super::side_by_side::{GATHER_AT_MOST, SIDE_BY_SIDE_FROM};
    use super::*;
    use crate::model::{AdmissionRecipient, Content, Kind, Provider};
    use crate::store::{
        ClaimedBatch, Cleaned, Completion, Depth, EventRecord, Retry, RetryResult, Skip,
    };

    /// A round goes under its first sampled caller, or its first when none is.
    #[test]
    fn a_round_goes_under_its_first_sampled_caller() {
        let spans = [
            tracing::Span::none(),
            tracing::Span::none(),
            tracing::Span::none(),
        ];
        let sampled_at = |at: Option<usize>| {
            let spans = &spans;
            move |span: &tracing::Span| at.is_some_and(|at| std::ptr::eq(span, &spans[at]))
        };
        assert_eq!(parent_of(spans.iter(), sampled_at(Some(1))), 1);
        assert_eq!(parent_of(spans.iter(), sampled_at(Some(0))), 0);
        assert_eq!(parent_of(spans.iter(), sampled_at(None)), 0);
        assert_eq!(parent_of(std::iter::empty(), sampled_at(None)), 0);
    }

    /// What the store answers to everything but admission, which is all a writer asks of it.
    const ONLY_ADMITS: QueueError = QueueError::InvalidRequest("this store only admits");

    /// A store whose first round panics (if `panic_first`); every later one admits, records
    /// what it carried, and finds a report's lease held when its batch id ends in `held`.
    #[derive(Clone, Default)]
    struct PanicsOnce {
        panic_first: bool,
        panicked: Arc<AtomicBool>,
        /// (admissions, reports) of each round.
        rounds: Arc<std::sync::Mutex<Vec<(usize, usize)>>>,
        /// Every recipient refused by the quota.
        refuse: bool,
        /// Each round says it began, then waits to be let go.
        gate: Option<Arc<Gate>>,
        /// `group_writers` (0: one).
        writers: usize,
    }

    #[derive(Default)]
    struct Gate {
        entered: tokio::sync::Notify,
        open: tokio::sync::Notify,
    }

    impl QueueStore for PanicsOnce {
        async fn write_round(
            &self,
            group: &[&Admission],
            reports: &[Completion],
            _claims: &[ClaimAsk],
            now: i64,
            coalesce_ms: i64,
            handoff: Option<&Handoff>,
        ) -> crate::store::Round {
            self.rounds
                .lock()
                .unwrap()
                .push((group.len(), reports.len()));
            if let Some(gate) = &self.gate {
                gate.entered.notify_one();
                gate.open.notified().await;
            }
            crate::store::Round {
                admitted: self.enqueue_group(group, now, coalesce_ms, handoff).await,
                reported: Ok(reports
                    .iter()
                    .map(|r| r.batch_id.ends_with("held"))
                    .collect()),
                claimed: Vec::new(),
                uncertain: false,
            }
        }
        fn reports_in_rounds(&self) -> bool {
            true
        }
        fn hands_off(&self) -> bool {
            false
        }
        async fn enqueue_group(
            &self,
            group: &[&Admission],
            _now: i64,
            _coalesce_ms: i64,
            _handoff: Option<&Handoff>,
        ) -> Vec<Result<Enqueued, QueueError>> {
            if self.panic_first && !self.panicked.swap(true, Ordering::SeqCst) {
                panic!("a bug while committing");
            }
            let status = if self.refuse {
                crate::model::AdmissionStatus::RateLimited
            } else {
                crate::model::AdmissionStatus::Queued
            };
            group
                .iter()
                .map(|a| {
                    Ok(Enqueued {
                        statuses: a
                            .recipients
                            .iter()
                            .map(|r| (r.registration_id.clone(), status))
                            .collect(),
                        next_due_at: None,
                    })
                })
                .collect()
        }
        fn group_writers(&self) -> usize {
            self.writers.max(1)
        }
        fn writer_thread(&self) -> bool {
            self.panic_first
        }
        async fn claim(
            &self,
            _: &str,
            _: i64,
            _: i64,
            _: i64,
            _: Skip,
        ) -> Result<Vec<ClaimedBatch>, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn next_available_at(&self, _: Skip) -> Result<Option<i64>, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn renew(&self, _: &str, _: &str, _: i64) -> Result<bool, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn complete(&self, _: &[Completion], _: i64) -> Result<Vec<bool>, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn retry(
            &self,
            _: &str,
            _: &str,
            _: i64,
            _: &str,
            _: Retry,
            _: i64,
        ) -> Result<RetryResult, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn settle(&self, _: &[&str], _: &[&str]) -> Result<(), QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn hold(&self, _: Provider, _: i64, _: i64) -> Result<u64, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn release(&self, _: Provider, _: i64, _: i64) -> Result<u64, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn event_record(
            &self,
            _: &str,
            _: Kind,
            _: &str,
            _: i64,
        ) -> Result<Option<EventRecord>, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn depth(&self, _: i64) -> Result<Depth, QueueError> {
            Err(ONLY_ADMITS)
        }
        async fn cleanup(&self, _: i64) -> Result<Cleaned, QueueError> {
            Err(ONLY_ADMITS)
        }
    }

    fn admission(seq: i64) -> Admission {
        Admission {
            host_fingerprint: "host".into(),
            kind: Kind::Alert,
            notification_epoch: "e".into(),
            notification_seq: seq,
            content: Content {
                notification_id: Some(format!("n-{seq}")),
                source: "plugin".into(),
                agent_state: None,
                title: "t".into(),
                body: "b".into(),
                worktree_id: None,
            },
            expires_at_ms: None,
            recipients: vec![AdmissionRecipient {
                registration_id: "r".into(),
                silent: false,
                provider: Provider::Fcm,
            }],
            trace_parent: None,
        }
    }

    #[tokio::test]
    async fn a_panicking_commit_fails_its_group_only_and_the_writer_goes_on() {
        let groups = GroupCommit::start(
            PanicsOnce {
                panic_first: true,
                ..PanicsOnce::default()
            },
            Arc::new(orca_push_storage::SystemClock),
            3000,
            Arc::new(Wake::new()),
            Arc::new(Handoff::new(Box::new(drop))),
        );
        let first = groups.admit(admission(1)).await;
        assert!(
            matches!(first, Err(QueueError::WriterStopped)),
            "never a false queued"
        );
        let second = groups.admit(admission(2)).await;
        assert!(
            second.is_ok(),
            "the writer admits the next group: {second:?}"
        );
    }

    /// With writers side by side, what arrives while a round commits waits for it and goes in
    /// one round after it, not a round each beside it; from `SIDE_BY_SIDE_FROM` waiting, or after
    /// `GATHER_AT_MOST`, a round starts beside it.
    #[tokio::test(start_paused = true)]
    async fn writers_side_by_side_gather_while_a_round_commits() {
        let gate = Arc::new(Gate::default());
        let store = PanicsOnce {
            gate: Some(gate.clone()),
            writers: 4,
            ..PanicsOnce::default()
        };
        let rounds = store.rounds.clone();
        let groups = Arc::new(GroupCommit::start(
            store,
            Arc::new(orca_push_storage::SystemClock),
            3000,
            Arc::new(Wake::new()),
            Arc::new(Handoff::new(Box::new(drop))),
        ));
        let admit = |seq| {
            let groups = groups.clone();
            tokio::spawn(async move { groups.admit(admission(seq)).await })
        };
        let first = admit(1);
        gate.entered.notified().await;
        let few: Vec<_> = (2..5).map(admit).collect();
        let within = GATHER_AT_MOST - Duration::from_millis(1);
        let began_beside = tokio::time::timeout(within, gate.entered.notified());
        assert!(
            began_beside.await.is_err(),
            "a round of a few began beside the first: {:?}",
            rounds.lock().unwrap()
        );
        gate.open.notify_one();
        first.await.unwrap().unwrap();
        gate.entered.notified().await;
        gate.open.notify_one();
        for one in few {
            one.await.unwrap().unwrap();
        }
        assert_eq!(*rounds.lock().unwrap(), [(1, 0), (3, 0)]);

        // Enough waiting: a round begins beside the one committing.
        rounds.lock().unwrap().clear();
        let first = admit(10);
        gate.entered.notified().await;
        let many: Vec<_> = (11..11 + SIDE_BY_SIDE_FROM as i64).map(admit).collect();
        // At once, not after `GATHER_AT_MOST`.
        let began_beside = tokio::time::timeout(within, gate.entered.notified());
        assert!(
            began_beside.await.is_ok(),
            "no round began beside the first"
        );
        assert_eq!(rounds.lock().unwrap()[1].0, SIDE_BY_SIDE_FROM);
        gate.open.notify_one();
        gate.open.notify_one();
        first.await.unwrap().unwrap();
        for one in many {
            one.await.unwrap().unwrap();
        }

        // A slow round holds the next back for `GATHER_AT_MOST` only.
        rounds.lock().unwrap().clear();
        let first = admit(30);
        gate.entered.notified().await;
        let since = tokio::time::Instant::now();
        let next = admit(31);
        tokio::time::timeout(Duration::from_secs(5), gate.entered.notified())
            .await
            .expect("the next round waited for the slow one");
        assert!(since.elapsed() >= GATHER_AT_MOST, "{:?}", since.elapsed());
        assert_eq!(*rounds.lock().unwrap(), [(1, 0), (1, 0)]);
        gate.open.notify_one();
        gate.open.notify_one();
        first.await.unwrap().unwrap();
        next.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_refusal_is_counted_when_its_caller_has_gone() {
        // One thread: the writer (not on a thread of its own for this store) records here.
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let _local = metrics::set_default_local_recorder(&recorder);
        let refusals = || {
            recorder
                .handle()
                .render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("orca_push_quota_refusals_total{kind=\"alert\"} ")?
                        .parse::<f64>()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        let gate = Arc::new(Gate::default());
        let groups = Arc::new(GroupCommit::start(
            PanicsOnce {
                refuse: true,
                gate: Some(gate.clone()),
                ..PanicsOnce::default()
            },
            Arc::new(orca_push_storage::SystemClock),
            3000,
            Arc::new(Wake::new()),
            Arc::new(Handoff::new(Box::new(drop))),
        ));
        // The caller goes (as an `Enqueue` call does when its HTTP client hangs up) once the
        // writer has its admission, before the answer.
        let caller = tokio::spawn({
            let groups = groups.clone();
            async move { groups.admit(admission(1)).await }
        });
        gate.entered.notified().await;
        caller.abort();
        assert!(caller.await.unwrap_err().is_cancelled());
        gate.open.notify_one();
        let counted = tokio::time::timeout(Duration::from_secs(5), async {
            while refusals() == 0.0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(counted.is_ok(), "the refusal was never counted");
        // A caller that stays hears it, and it is counted once.
        let heard = {
            let groups = groups.clone();
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.entered.notified().await;
                gate.open.notify_one();
            });
            groups.admit(admission(2)).await.unwrap()
        };
        assert_eq!(
            heard.statuses,
            vec![("r".to_owned(), crate::model::AdmissionStatus::RateLimited)]
        );
        assert_eq!(refusals(), 2.0);
    }

    #[test]
    fn a_round_counts_each_refused_admission_once_by_kind() {
        let enqueued = |statuses: &[crate::model::AdmissionStatus]| {
            Ok(Enqueued {
                statuses: statuses.iter().map(|s| ("r".to_owned(), *s)).collect(),
                next_due_at: None,
            })
        };
        use crate::model::AdmissionStatus::{Queued, RateLimited};
        let alert = admission(1);
        let dismiss = Admission {
            kind: Kind::Dismiss,
            ..admission(2)
        };
        let admissions = [&alert, &alert, &dismiss, &alert, &dismiss];
        let admitted = [
            enqueued(&[RateLimited, RateLimited]),
            enqueued(&[Queued]),
            enqueued(&[Queued, RateLimited]),
            Err(QueueError::WriterStopped),
            enqueued(&[]),
        ];
        assert_eq!(
            Refused::of(&admissions, &admitted),
            Refused {
                alerts: 1,
                dismissals: 1
            }
        );
    }

    fn report(batch_id: &str) -> Completion {
        Completion {
            batch_id: batch_id.into(),
            lease_token: "token".into(),
            outcome: crate::store::Outcome::Sent,
            reason: "sent".into(),
            answered: true,
        }
    }

    #[tokio::test]
    async fn reports_ride_the_admissions_round_and_each_gets_its_own_flags() {
        let store = PanicsOnce::default();
        let groups = GroupCommit::start(
            store.clone(),
            Arc::new(orca_push_storage::SystemClock),
            0,
            Arc::new(Wake::new()),
            Arc::new(Handoff::new(Box::new(drop))),
        );
        // All three wait before the writer runs (one thread): one round carries them.
        let (admitted, first, second) = tokio::join!(
            groups.admit(admission(1)),
            groups.report(vec![report("a-held"), report("b-lost")]),
            groups.report(vec![report("c-held")]),
        );
        assert!(admitted.is_ok());
        assert_eq!(first.unwrap(), vec![true, false]);
        assert_eq!(second.unwrap(), vec![true]);
        assert_eq!(*store.rounds.lock().unwrap(), vec![(1, 3)]);
        assert_eq!(groups.groups(), 1);
        // Reports alone make a round of their own.
        assert_eq!(
            groups.report(vec![report("d-held")]).await.unwrap(),
            vec![true]
        );
        assert_eq!(store.rounds.lock().unwrap()[1], (0, 1));
        assert!(groups.report(Vec::new()).await.unwrap().is_empty());
    }
}
