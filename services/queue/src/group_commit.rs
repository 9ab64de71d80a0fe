//! Group commit: admissions that arrive together commit together. Each admission waits on a
//! channel; a writer takes everything waiting (up to `MAX_GROUP`) and admits it in one transaction,
//! then answers each caller, so `queued` still means committed. While one group commits, the next
//! gathers. Callers of one host that wait for each other's answers are in successive groups, in
//! order; within a group admissions run in arrival order, so quota counts what went before.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use orca_push_storage::Clock;
use tokio::sync::{Mutex, mpsc, oneshot};
use tracing::Instrument as _;

use crate::error::QueueError;
use crate::handoff::Handoff;
use crate::model::Admission;
use crate::store::{Enqueued, QueueStore};
use crate::wake::Wake;

/// The most admissions one transaction carries.
pub const MAX_GROUP: usize = 128;
/// Admissions waiting for a writer before callers wait to hand theirs over.
const WAITING: usize = 4 * MAX_GROUP;

struct Waiting {
    admission: Admission,
    answer: oneshot::Sender<Result<Enqueued, QueueError>>,
    /// The caller's span: the group's work is traced under the first caller's and linked from
    /// every other's.
    span: tracing::Span,
}

/// Hands admissions to the writers.
pub struct GroupCommit {
    waiting: mpsc::Sender<Waiting>,
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
        for _ in 0..store.group_writers().max(1) {
            let writer = Writer {
                store: store.clone(),
                clock: clock.clone(),
                coalesce_ms,
                wake: wake.clone(),
                handoff: handoff.clone(),
                queue: queue.clone(),
                groups: groups.clone(),
            };
            if store.writer_thread() {
                spawn_on_own_thread(writer);
            } else {
                tokio::spawn(writer.run());
            }
        }
        Self { waiting, groups }
    }

    /// Groups handed to the store so far.
    pub fn groups(&self) -> u64 {
        self.groups.load(Ordering::Relaxed)
    }

    /// Admits `admission` with whatever else is waiting; answers once its group has committed.
    pub async fn admit(&self, admission: Admission) -> Result<Enqueued, QueueError> {
        let (answer, answered) = oneshot::channel();
        self.waiting
            .send(Waiting {
                admission,
                answer,
                span: tracing::Span::current(),
            })
            .await
            .map_err(|_| QueueError::WriterStopped)?;
        answered.await.map_err(|_| QueueError::WriterStopped)?
    }
}

/// Runs `writer` on a thread of its own, with a runtime of its own. Every statement of a group is
/// a round trip to sqlx's SQLite worker thread; on the shared runtime the writer then waits behind
/// every ready request task before it sends the next one (profiled: 3-4 ms per group of 30 on two
/// busy cores before anything was written). On its own thread it is woken at once.
fn spawn_on_own_thread<S: QueueStore>(writer: Writer<S>) {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => {
            let thread = std::thread::Builder::new()
                .name("queue-writer".into())
                .spawn(move || runtime.block_on(writer.run()));
            if let Err(error) = thread {
                tracing::error!(%error, "the admission writer's thread did not start");
            }
        }
        Err(error) => {
            tracing::warn!(%error, "no runtime for the admission writer; it shares the main one");
            tokio::spawn(writer.run());
        }
    }
}

struct Writer<S> {
    store: S,
    clock: Arc<dyn Clock>,
    coalesce_ms: i64,
    wake: Arc<Wake>,
    handoff: Arc<Handoff>,
    queue: Arc<Mutex<mpsc::Receiver<Waiting>>>,
    groups: Arc<AtomicU64>,
}

impl<S: QueueStore> Writer<S> {
    async fn run(self) {
        while let Some(group) = self.next_group().await {
            let span = tracing::info_span!(
                parent: &group[0].span,
                "queue.group_commit",
                otel.kind = "internal",
                admissions = group.len(),
            );
            for other in &group[1..] {
                span.follows_from(&other.span);
            }
            // A panic while committing (a bug, or a driver's) must not stop admission for good:
            // the group's callers get `WriterStopped` (their answers are dropped: never a false
            // `queued`), and this writer goes on with the next group.
            let commit = std::panic::AssertUnwindSafe(self.commit(group).instrument(span));
            if futures::FutureExt::catch_unwind(commit).await.is_err() {
                tracing::error!("the admission writer panicked committing a group; it goes on");
                metrics::counter!("orca_push_queue_writer_panics_total").increment(1);
            }
        }
    }

    /// Waits for one admission, then takes whatever else is already waiting. None: stopped.
    async fn next_group(&self) -> Option<Vec<Waiting>> {
        let mut queue = self.queue.lock().await;
        let first = queue.recv().await?;
        let mut group = Vec::with_capacity(queue.len().min(MAX_GROUP - 1) + 1);
        group.push(first);
        while group.len() < MAX_GROUP {
            match queue.try_recv() {
                Ok(next) => group.push(next),
                Err(_) => break,
            }
        }
        Some(group)
    }

    async fn commit(&self, group: Vec<Waiting>) {
        metrics::histogram!("orca_push_queue_admission_group_size").record(group.len() as f64);
        self.groups.fetch_add(1, Ordering::Relaxed);
        let now = i64::try_from(self.clock.now_ms()).unwrap_or(i64::MAX);
        let admissions: Vec<&Admission> = group.iter().map(|w| &w.admission).collect();
        let results = self
            .store
            .enqueue_group(&admissions, now, self.coalesce_ms, Some(&self.handoff))
            .await;
        let admitted = admissions
            .iter()
            .zip(&results)
            .filter_map(|(a, r)| Some((*a, r.as_ref().ok()?)));
        self.wake.work_for(crate::wake::providers_due(admitted));
        for (waiting, result) in group.into_iter().zip(results) {
            // A caller that went away misses its answer; the admission stands.
            let _ = waiting.answer.send(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::model::{AdmissionRecipient, Content, Kind, Provider};
    use crate::store::{
        ClaimedBatch, Cleaned, Completion, Depth, EventRecord, Retry, RetryResult, Skip,
    };

    /// What the store answers to everything but admission, which is all a writer asks of it.
    const ONLY_ADMITS: QueueError = QueueError::InvalidRequest("this store only admits");

    /// A store whose first group commit panics; every later one admits.
    #[derive(Clone, Default)]
    struct PanicsOnce(Arc<AtomicBool>);

    impl QueueStore for PanicsOnce {
        async fn enqueue_group(
            &self,
            group: &[&Admission],
            _now: i64,
            _coalesce_ms: i64,
            _handoff: Option<&Handoff>,
        ) -> Vec<Result<Enqueued, QueueError>> {
            if !self.0.swap(true, Ordering::SeqCst) {
                panic!("a bug while committing");
            }
            group
                .iter()
                .map(|_| {
                    Ok(Enqueued {
                        statuses: Vec::new(),
                        next_due_at: None,
                    })
                })
                .collect()
        }
        fn group_writers(&self) -> usize {
            1
        }
        fn writer_thread(&self) -> bool {
            true
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
            PanicsOnce::default(),
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
}
