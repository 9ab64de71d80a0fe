//! Group reporting: a lane's final answers go to the queue in one `CompleteMany` call per flush,
//! one flush in flight at a time. Whatever finished while a flush was on its way goes in the next,
//! so under load many answers share one call and one transaction, and a lone answer waits for no
//! timer.

use orca_push_proto::queue::v1 as queue_pb;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument as _;

use crate::lane::QueueClient;

/// Reports one flush carries at most (the queue accepts 256).
pub const MAX_FLUSH: usize = 128;

/// Where flushes go: the queue, or a test's double.
pub trait Flush: Send + Sync + 'static {
    /// Several reports in one call (`CompleteMany`): one flag per report, in order.
    fn report_many(
        &self,
        reports: Vec<queue_pb::CompleteRequest>,
    ) -> impl std::future::Future<Output = Result<Vec<bool>, tonic::Status>> + Send;

    /// One report (`Complete`), for a queue that does not know `CompleteMany` yet.
    fn report_one(
        &self,
        report: queue_pb::CompleteRequest,
    ) -> impl std::future::Future<Output = Result<bool, tonic::Status>> + Send;
}

impl Flush for QueueClient {
    async fn report_many(
        &self,
        reports: Vec<queue_pb::CompleteRequest>,
    ) -> Result<Vec<bool>, tonic::Status> {
        let expected = reports.len();
        let recorded = self
            .clone()
            .complete_many(queue_pb::CompleteManyRequest { reports })
            .await?
            .into_inner()
            .recorded;
        if recorded.len() != expected {
            return Err(tonic::Status::internal("queue answered a different count"));
        }
        Ok(recorded)
    }

    async fn report_one(&self, report: queue_pb::CompleteRequest) -> Result<bool, tonic::Status> {
        Ok(self.clone().complete(report).await?.into_inner().recorded)
    }
}

/// How long a report, retry or hand-back keeps calling a queue that does not answer: past a
/// PostgreSQL restart (8.4 s measured, docs/reliability.md) or a lone queue replica's, and within
/// the lease a delivery still holds when it ends (two thirds of it at least: 20 s of the default
/// 30). Given up, the batch waits for its lease to lapse and is sent again, or, for a retry, comes
/// back sooner than the provider asked.
pub(crate) const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(15);

/// Whether a queue call's failure may be the queue not answering (restarting, its database
/// restarting or aborting a transaction, a connection lost, a call that timed out) rather than
/// refusing the call: worth making again. Each of these calls is checked against its lease, so a
/// repeat of one that did commit changes nothing.
fn not_answered(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::Cancelled
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unknown
    )
}

/// Makes `call` until the queue answers it, or for `within` ([`ANSWER_WITHIN`] but at a stop):
/// 100 ms between tries, doubling to 2 s.
pub(crate) async fn until_answered<T, F, Fut>(
    within: std::time::Duration,
    mut call: F,
) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let give_up = tokio::time::Instant::now() + within;
    let mut pause = std::time::Duration::from_millis(100);
    loop {
        match call().await {
            Err(status)
                if not_answered(&status) && tokio::time::Instant::now() + pause < give_up =>
            {
                tracing::debug!(code = ?status.code(), "the queue did not answer; calling again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

/// How long a queue that answered `Unimplemented` to `CompleteMany` gets single `Complete` calls
/// before it is asked again: a rollout that put the sender first upgrades the queue meanwhile.
const ASK_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Sends one flush: an answer per report, in order. A queue that answers `Unimplemented` (an
/// older build, mid-rollout) gets single `Complete` calls for [`ASK_AGAIN_AFTER`] (`singly` holds
/// since when); a call the queue did not answer ([`not_answered`]: a storage error such as a
/// PostgreSQL deadlock abort or restart, a dropped connection, a timeout) is made again until it
/// is, within [`ANSWER_WITHIN`] for the whole flush, since each failed report means a redelivery
/// once its lease lapses. A single report that fails fails alone.
async fn send_flush(
    flush: &impl Flush,
    reports: Vec<queue_pb::CompleteRequest>,
    singly: &mut Option<tokio::time::Instant>,
) -> Vec<Result<bool, tonic::Status>> {
    let give_up = tokio::time::Instant::now() + ANSWER_WITHIN;
    if singly.is_none_or(|since| since.elapsed() >= ASK_AGAIN_AFTER) {
        match until_answered(ANSWER_WITHIN, || flush.report_many(reports.clone())).await {
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                if singly.is_none() {
                    tracing::warn!("the queue has no CompleteMany; reporting one batch per call");
                }
                *singly = Some(tokio::time::Instant::now());
            }
            Ok(recorded) => {
                *singly = None;
                return recorded.into_iter().map(Ok).collect();
            }
            Err(status) => return vec![Err(status); reports.len()],
        }
    }
    let mut recorded = Vec::with_capacity(reports.len());
    for report in reports {
        // The flush's time bounds its calls too: once spent, the rest are answered without one.
        let within = give_up.saturating_duration_since(tokio::time::Instant::now());
        let answered = tokio::time::timeout(
            within,
            until_answered(within, || flush.report_one(report.clone())),
        )
        .await;
        recorded.push(answered.unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(
                "the queue did not answer the flush in time",
            ))
        }));
    }
    recorded
}

type Pending = (
    queue_pb::CompleteRequest,
    tracing::Span,
    oneshot::Sender<Result<bool, tonic::Status>>,
);

/// The sending side; clone it into each delivery.
#[derive(Clone)]
pub struct Reporter {
    tx: mpsc::UnboundedSender<Pending>,
}

impl Reporter {
    /// Starts the flushing task; it ends once every `Reporter` clone is dropped and the last
    /// flush is done.
    pub fn spawn(flush: impl Flush) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, tokio::spawn(run(flush, rx)))
    }

    /// Records one batch's final answer; true when the lease still held it. The current span
    /// (the delivery's) is linked from the flush's span.
    pub async fn complete(&self, report: queue_pb::CompleteRequest) -> Result<bool, tonic::Status> {
        let (answer, answered) = oneshot::channel();
        self.tx
            .send((report, tracing::Span::current(), answer))
            .map_err(|_| tonic::Status::unavailable("reporter stopped"))?;
        answered
            .await
            .map_err(|_| tonic::Status::unavailable("reporter stopped"))?
    }
}

async fn run(flush: impl Flush, mut rx: mpsc::UnboundedReceiver<Pending>) {
    let mut pending = Vec::with_capacity(MAX_FLUSH);
    let mut singly = None;
    while rx.recv_many(&mut pending, MAX_FLUSH).await > 0 {
        let span = tracing::info_span!(
            "report outcomes",
            otel.kind = "client",
            orca.reports = pending.len(),
        );
        orca_push_telemetry::link_spans(&span, pending.iter().map(|(_, delivery, _)| delivery));
        let (reports, answers): (Vec<_>, Vec<_>) = pending
            .drain(..)
            .map(|(report, _, answer)| (report, answer))
            .unzip();
        let recorded = send_flush(&flush, reports, &mut singly)
            .instrument(span)
            .await;
        for (answer, recorded) in answers.into_iter().zip(recorded) {
            let _ = answer.send(recorded);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::sync::Semaphore;

    use super::*;

    /// Records each flush's batch ids; holds every flush until the test lets it go.
    #[derive(Clone)]
    struct Recording {
        flushes: Arc<Mutex<Vec<Vec<String>>>>,
        singles: Arc<Mutex<Vec<String>>>,
        gate: Arc<Semaphore>,
        /// Answers to the next `CompleteMany` calls, before the recorded default.
        failures: Arc<Mutex<Vec<tonic::Code>>>,
        /// The same for the next `Complete` calls.
        single_failures: Arc<Mutex<Vec<tonic::Code>>>,
        /// `Complete` calls never answered (a queue that stalled).
        singles_stall: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Default for Recording {
        fn default() -> Self {
            Self {
                flushes: Default::default(),
                singles: Default::default(),
                gate: Arc::new(Semaphore::new(0)),
                failures: Default::default(),
                single_failures: Default::default(),
                singles_stall: Default::default(),
            }
        }
    }

    /// The lease holds for even-numbered batches only.
    fn held(report: &queue_pb::CompleteRequest) -> bool {
        report
            .batch_id
            .trim_start_matches('b')
            .parse::<u32>()
            .unwrap()
            % 2
            == 0
    }

    impl Flush for Recording {
        async fn report_many(
            &self,
            reports: Vec<queue_pb::CompleteRequest>,
        ) -> Result<Vec<bool>, tonic::Status> {
            self.flushes
                .lock()
                .unwrap()
                .push(reports.iter().map(|r| r.batch_id.clone()).collect());
            self.gate.acquire().await.unwrap().forget();
            let failure = {
                let mut failures = self.failures.lock().unwrap();
                (!failures.is_empty()).then(|| failures.remove(0))
            };
            if let Some(code) = failure {
                return Err(tonic::Status::new(code, "refused"));
            }
            Ok(reports.iter().map(held).collect())
        }

        async fn report_one(
            &self,
            report: queue_pb::CompleteRequest,
        ) -> Result<bool, tonic::Status> {
            self.singles.lock().unwrap().push(report.batch_id.clone());
            if self.singles_stall.load(std::sync::atomic::Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            let failure = {
                let mut failures = self.single_failures.lock().unwrap();
                (!failures.is_empty()).then(|| failures.remove(0))
            };
            if let Some(code) = failure {
                return Err(tonic::Status::new(code, "refused"));
            }
            Ok(held(&report))
        }
    }

    fn report(i: u32) -> queue_pb::CompleteRequest {
        queue_pb::CompleteRequest {
            batch_id: format!("b{i}"),
            lease_token: format!("t{i}"),
            outcome: queue_pb::Outcome::Sent as i32,
            reason: "sent".into(),
            provider_answered: true,
        }
    }

    async fn flushes_seen(recording: &Recording, n: usize) {
        while recording.flushes.lock().unwrap().len() < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn answers_that_finish_during_a_flush_share_the_next_one() {
        let recording = Recording::default();
        let (reporter, task) = Reporter::spawn(recording.clone());
        let first = tokio::spawn({
            let reporter = reporter.clone();
            async move { reporter.complete(report(0)).await }
        });
        flushes_seen(&recording, 1).await;
        // Nine more finish while the first flush is on its way.
        let rest: Vec<_> = (1..10)
            .map(|i| {
                let reporter = reporter.clone();
                tokio::spawn(async move { reporter.complete(report(i)).await })
            })
            .collect();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        recording.gate.add_permits(2);
        assert!(first.await.unwrap().unwrap());
        for (i, answer) in (1..10).zip(rest) {
            assert_eq!(answer.await.unwrap().unwrap(), i % 2 == 0, "b{i}");
        }
        let flushes = recording.flushes.lock().unwrap().clone();
        assert_eq!(flushes.len(), 2, "{flushes:?}");
        assert_eq!(flushes[0], ["b0"]);
        assert_eq!(
            flushes[1],
            (1..10).map(|i| format!("b{i}")).collect::<Vec<_>>()
        );
        drop(reporter);
        task.await.unwrap();
    }

    /// With no time to try again (a stopping lane's hand-backs), a call is made once.
    #[tokio::test(start_paused = true)]
    async fn with_no_time_a_call_the_queue_did_not_answer_is_made_once() {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let call = || {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Err::<(), _>(tonic::Status::unavailable("restarting")) }
        };
        let started = tokio::time::Instant::now();
        assert!(
            until_answered(std::time::Duration::ZERO, call)
                .await
                .is_err()
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(started.elapsed(), std::time::Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_the_queue_did_not_answer_is_sent_again_until_it_does() {
        let recording = Recording::default();
        recording.gate.add_permits(usize::MAX >> 4);
        // A queue restarting for a few seconds: its failures and timeouts, then an answer.
        *recording.failures.lock().unwrap() = vec![
            tonic::Code::Unavailable,
            tonic::Code::Cancelled,
            tonic::Code::Unavailable,
            tonic::Code::DeadlineExceeded,
            tonic::Code::Unavailable,
        ];
        let (reporter, task) = Reporter::spawn(recording.clone());
        assert!(reporter.complete(report(2)).await.unwrap(), "the sixth try");
        assert_eq!(recording.flushes.lock().unwrap().len(), 6);
        // One that never answers fails once ANSWER_WITHIN has passed.
        *recording.failures.lock().unwrap() = vec![tonic::Code::Unavailable; 1_000];
        let started = tokio::time::Instant::now();
        let status = reporter.complete(report(4)).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(
            started.elapsed() <= ANSWER_WITHIN,
            "{:?}",
            started.elapsed()
        );
        assert!(
            started.elapsed() >= ANSWER_WITHIN / 2,
            "{:?}",
            started.elapsed()
        );
        recording.failures.lock().unwrap().clear();
        let flushes = recording.flushes.lock().unwrap().len();
        *recording.failures.lock().unwrap() = vec![tonic::Code::InvalidArgument];
        let status = reporter.complete(report(6)).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "not retried");
        assert_eq!(recording.flushes.lock().unwrap().len(), flushes + 1);
        drop(reporter);
        task.await.unwrap();
    }

    #[tokio::test]
    async fn a_queue_without_complete_many_gets_single_reports() {
        let recording = Recording::default();
        recording.gate.add_permits(usize::MAX >> 4);
        *recording.failures.lock().unwrap() = vec![tonic::Code::Unimplemented];
        let (reporter, task) = Reporter::spawn(recording.clone());
        assert!(reporter.complete(report(2)).await.unwrap());
        assert!(!reporter.complete(report(3)).await.unwrap());
        assert_eq!(recording.flushes.lock().unwrap().len(), 1, "asked once");
        assert_eq!(*recording.singles.lock().unwrap(), ["b2", "b3"]);
        drop(reporter);
        task.await.unwrap();
    }

    /// Single reports the queue did not answer are made again; one refused fails alone; and after
    /// `ASK_AGAIN_AFTER` the queue (upgraded since) is asked for `CompleteMany` again.
    #[tokio::test(start_paused = true)]
    async fn single_reports_are_retried_alone_and_complete_many_is_asked_for_again() {
        let recording = Recording::default();
        recording.gate.add_permits(usize::MAX >> 4);
        *recording.failures.lock().unwrap() = vec![tonic::Code::Unimplemented];
        let (reporter, task) = Reporter::spawn(recording.clone());
        assert!(reporter.complete(report(2)).await.unwrap());
        *recording.single_failures.lock().unwrap() = vec![
            tonic::Code::Unavailable,
            tonic::Code::Unavailable,
            tonic::Code::InvalidArgument,
        ];
        let answers: Vec<_> = [4, 6]
            .into_iter()
            .map(|i| {
                let reporter = reporter.clone();
                tokio::spawn(async move { reporter.complete(report(i)).await })
            })
            .collect();
        let mut answers = answers.into_iter();
        let first = answers.next().unwrap().await.unwrap();
        let second = answers.next().unwrap().await.unwrap();
        let (failed, fine) = match first {
            Ok(held) => (second, held),
            Err(status) => (Err(status), second.unwrap()),
        };
        assert_eq!(failed.unwrap_err().code(), tonic::Code::InvalidArgument);
        assert!(fine, "the other report of the flush is answered");
        assert_eq!(recording.flushes.lock().unwrap().len(), 1);
        tokio::time::advance(ASK_AGAIN_AFTER).await;
        assert!(reporter.complete(report(8)).await.unwrap());
        assert!(reporter.complete(report(10)).await.unwrap());
        assert_eq!(
            recording.flushes.lock().unwrap().len(),
            3,
            "asked again, then kept"
        );
        drop(reporter);
        task.await.unwrap();
    }

    /// A queue that stalls holds a flush of single reports for `ANSWER_WITHIN` in all, not for
    /// each report's call.
    #[tokio::test(start_paused = true)]
    async fn a_flush_of_single_reports_ends_within_its_time() {
        let recording = Recording::default();
        recording.gate.add_permits(usize::MAX >> 4);
        *recording.failures.lock().unwrap() = vec![tonic::Code::Unimplemented];
        let (reporter, task) = Reporter::spawn(recording.clone());
        assert!(reporter.complete(report(2)).await.unwrap());
        recording
            .singles_stall
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        let answers: Vec<_> = (0..4)
            .map(|i| {
                let reporter = reporter.clone();
                tokio::spawn(async move { reporter.complete(report(10 + i)).await })
            })
            .collect();
        let ended = tokio::time::timeout(ANSWER_WITHIN * 4, async {
            for answer in answers {
                let status = answer.await.unwrap().unwrap_err();
                assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
            }
        })
        .await;
        assert!(ended.is_ok(), "the flush waited on a call that never ends");
        assert!(
            started.elapsed() <= ANSWER_WITHIN + std::time::Duration::from_millis(1),
            "{:?}",
            started.elapsed()
        );
        drop(reporter);
        task.abort();
    }

    #[tokio::test]
    async fn a_flush_carries_at_most_max_flush_reports() {
        let recording = Recording::default();
        recording.gate.add_permits(usize::MAX >> 4);
        let (reporter, task) = Reporter::spawn(recording.clone());
        let answers: Vec<_> = (0..(MAX_FLUSH as u32 * 2 + 1))
            .map(|i| {
                let reporter = reporter.clone();
                tokio::spawn(async move { reporter.complete(report(i)).await })
            })
            .collect();
        for answer in answers {
            answer.await.unwrap().unwrap();
        }
        let flushes = recording.flushes.lock().unwrap().clone();
        assert!(flushes.iter().all(|f| f.len() <= MAX_FLUSH));
        assert_eq!(
            flushes.iter().map(Vec::len).sum::<usize>(),
            MAX_FLUSH * 2 + 1
        );
        drop(reporter);
        task.await.unwrap();
    }
}
