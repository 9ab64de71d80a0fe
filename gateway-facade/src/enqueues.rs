//! Sends to a queue across a socket, several to a call. In split mode every send was an `Enqueue`
//! call of its own: its HTTP/2 stream, headers and frames, and a `writev` and a read at each end.
//! When a send wakes the task that calls the queue, the task lets the runtime take one turn first
//! (no timer), and every send that reached it meanwhile (up to one commit round's worth,
//! [`MAX_BATCH`]) goes in the same `EnqueueMany`, each admitted or refused on its own; a lone send
//! still goes as a plain `Enqueue`. At 32 and 64 connections this carried 4-7 sends a call and cut
//! the five processes' CPU per send by a fifth to a third (docs/benchmarks.md, round 38). The queue
//! in this process (all in one, unless `ORCA_PUSH_INTERNAL_TRANSPORT=loopback`) has no socket to
//! save: sends call it directly.
//!
//! A send handed to the task is admitted even if its HTTP request is dropped meanwhile, as one
//! whose `Enqueue` call had gone out was before (admission runs to completion; a retry of the same
//! identity is answered `queued` again).
//!
//! Each send keeps its trace: a lone one's call is a child of its span, as before; a batched one
//! carries its `traceparent`, which the queue's span for its admission continues (that span is the
//! parent of the admission's `queue.group_commit` or linked from it), and the call's own span links
//! to every send's. A queue that predates `EnqueueMany` answers it `Unimplemented`: sends then go one
//! by one, and the facade asks again a minute later. A call refused whole for any other reason than
//! a lost connection is made again one send at a time, so each send gets its own answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use orca_push_internal_auth::{CALL_TIMEOUT, InternalChannel};
use orca_push_proto::queue::v1 as pb;
use pb::queue_service_client::QueueServiceClient;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tonic::Status;
use tracing::Instrument as _;

type QueueClient = QueueServiceClient<InternalChannel>;

/// Calls out at once at most.
pub const MAX_IN_FLIGHT: usize = 64;
/// Sends one call carries at most: one commit round's worth (the queue takes up to 256).
pub const MAX_BATCH: usize = orca_push_queue::group_commit::MAX_GROUP;
/// Sends waiting for a call; past it a send waits to be taken.
const WAITING: usize = 4096;
/// How long sends go one by one after a queue answered `EnqueueMany` `Unimplemented`.
const UNOFFERED_RETRY: Duration = Duration::from_secs(60);

struct Waiting {
    request: pb::EnqueueRequest,
    /// The send's span: a lone call's parent, a batched one's `traceparent`.
    span: tracing::Span,
    answer: oneshot::Sender<Result<pb::EnqueueResponse, Status>>,
}

/// Hands sends to the batching task. Cloned freely.
#[derive(Clone)]
pub struct Enqueues {
    waiting: mpsc::Sender<Waiting>,
}

impl Enqueues {
    /// Starts the task that calls `queue`. It ends once every handle is dropped.
    pub fn spawn(queue: QueueClient) -> Self {
        let (waiting, taken) = mpsc::channel(WAITING);
        tokio::spawn(run(queue, taken));
        Self { waiting }
    }

    /// What `Enqueue` answers for `request`, as one call or within a batch.
    pub async fn enqueue(
        &self,
        request: pb::EnqueueRequest,
    ) -> Result<pb::EnqueueResponse, Status> {
        let (answer, answered) = oneshot::channel();
        let waiting = Waiting {
            request,
            span: tracing::Span::current(),
            answer,
        };
        let ended = || Status::unavailable("the queue call ended without an answer");
        // As long as a call of its own could have taken, waiting for a free call included.
        let answer = async {
            self.waiting.send(waiting).await.map_err(|_| ended())?;
            answered.await.unwrap_or_else(|_| Err(ended()))
        };
        tokio::time::timeout(CALL_TIMEOUT, answer)
            .await
            .unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(
                    "no answer from the queue in time",
                ))
            })
    }
}

async fn run(queue: QueueClient, mut taken: mpsc::Receiver<Waiting>) {
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let unoffered = Arc::new(Unoffered::default());
    loop {
        // A slot first: while every call is out (a queue that stopped answering), sends wait in
        // the channel.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = taken.recv().await else {
            return;
        };
        let mut batch = vec![first];
        // One turn of the runtime first: sends being handled on it now join this call.
        tokio::task::yield_now().await;
        while batch.len() < MAX_BATCH {
            match taken.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        tokio::spawn(call(queue.clone(), batch, unoffered.clone(), slot));
    }
}

async fn call(
    queue: QueueClient,
    batch: Vec<Waiting>,
    unoffered: Arc<Unoffered>,
    _slot: OwnedSemaphorePermit,
) {
    if batch.len() == 1 || unoffered.now() {
        one_by_one(queue, batch).await;
        return;
    }
    let span = tracing::info_span!("queue.enqueue_many", orca.sends = batch.len());
    orca_push_telemetry::link_spans(&span, batch.iter().map(|w| &w.span));
    let requests = batch
        .iter()
        .map(|w| pb::BatchedEnqueue {
            request: Some(w.request.clone()),
            traceparent: orca_push_telemetry::traceparent_of(&w.span),
        })
        .collect();
    let answered = queue
        .clone()
        .enqueue_many(pb::EnqueueManyRequest { requests })
        .instrument(span)
        .await;
    match answered {
        Ok(response) => {
            let mut outcomes = response.into_inner().outcomes.into_iter();
            for waiting in batch {
                let answer = match outcomes.next().and_then(|o| o.outcome) {
                    Some(pb::enqueue_outcome::Outcome::Admitted(response)) => Ok(response),
                    Some(pb::enqueue_outcome::Outcome::Refused(refused)) => {
                        Err(orca_push_proto::refused_status(refused))
                    }
                    None => Err(Status::internal("the queue left a send unanswered")),
                };
                let _ = waiting.answer.send(answer);
            }
        }
        Err(status) => match on_call_failure(&status) {
            CallFailure::EachFails => {
                for waiting in batch {
                    let _ = waiting.answer.send(Err(status.clone()));
                }
            }
            CallFailure::OneByOne { unimplemented } => {
                if unimplemented {
                    unoffered.mark();
                }
                one_by_one(queue, batch).await;
            }
        },
    }
}

/// Each send as a call of its own, all at once, each a child of its send's span.
async fn one_by_one(queue: QueueClient, batch: Vec<Waiting>) {
    let calls = batch.into_iter().map(|waiting| {
        let mut queue = queue.clone();
        async move {
            let answer = queue
                .enqueue(waiting.request)
                .instrument(waiting.span)
                .await
                .map(tonic::Response::into_inner);
            let _ = waiting.answer.send(answer);
        }
    });
    futures::future::join_all(calls).await;
}

/// What a failure of a whole `EnqueueMany` call means for its sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallFailure {
    /// Each send's own call would have met it (a lost connection, a queue going away): each is
    /// answered with it, and retried on its own as before.
    EachFails,
    /// The call itself was refused (`unimplemented`: the queue does not know `EnqueueMany`): each send
    /// goes again as a call of its own, for its own answer.
    OneByOne { unimplemented: bool },
}

fn on_call_failure(status: &Status) -> CallFailure {
    use tonic::Code::{Cancelled, DeadlineExceeded, Internal, Unavailable, Unimplemented, Unknown};
    match status.code() {
        Unimplemented => CallFailure::OneByOne {
            unimplemented: true,
        },
        Unavailable | Unknown | Internal | Cancelled | DeadlineExceeded
            if orca_push_proto::error_code(status).is_none() =>
        {
            CallFailure::EachFails
        }
        _ => CallFailure::OneByOne {
            unimplemented: false,
        },
    }
}

/// Until when `EnqueueMany` is not asked for (ms since `origin`; 0: it is).
struct Unoffered {
    origin: Instant,
    until_ms: AtomicU64,
}

impl Default for Unoffered {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            until_ms: AtomicU64::new(0),
        }
    }
}

impl Unoffered {
    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn now(&self) -> bool {
        self.at(self.elapsed_ms())
    }

    fn mark(&self) {
        self.mark_at(self.elapsed_ms());
    }

    fn at(&self, elapsed_ms: u64) -> bool {
        let until = self.until_ms.load(Ordering::Relaxed);
        until != 0 && elapsed_ms < until
    }

    fn mark_at(&self, elapsed_ms: u64) {
        let retry = u64::try_from(UNOFFERED_RETRY.as_millis()).unwrap_or(u64::MAX);
        let until = elapsed_ms.saturating_add(retry).max(1);
        self.until_ms.store(until, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use orca_push_internal_auth::{InternalKey, Target};
    use pb::queue_service_server::{QueueService, QueueServiceServer};
    use tonic::{Request, Response};

    use super::*;

    /// What the fake queue was asked: the method and the sends it carried.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Asked {
        One,
        Many(usize),
    }

    /// How the fake queue answers `EnqueueMany`.
    #[derive(Debug, Clone, Copy)]
    enum Many {
        Answers,
        /// An older queue.
        Unimplemented,
        /// The whole call fails with this code.
        Fails(tonic::Code),
    }

    /// A queue that admits every send and refuses those of host `refused` as a quota would.
    struct FakeQueue {
        many: Many,
        asked: Arc<Mutex<Vec<Asked>>>,
        traceparents: Arc<Mutex<Vec<Option<String>>>>,
    }

    fn answer(request: &pb::EnqueueRequest) -> Result<pb::EnqueueResponse, Status> {
        if request.host_fingerprint == "refused" {
            return Err(orca_push_proto::status_with_code(
                tonic::Code::ResourceExhausted,
                "rate_limited",
            ));
        }
        Ok(pb::EnqueueResponse {
            results: request
                .recipients
                .iter()
                .map(|r| pb::RecipientResult {
                    registration_id: format!("{}:{}", request.host_fingerprint, r.registration_id),
                    status: pb::EnqueueStatus::Queued as i32,
                })
                .collect(),
        })
    }

    #[tonic::async_trait]
    impl QueueService for FakeQueue {
        async fn enqueue(
            &self,
            request: Request<pb::EnqueueRequest>,
        ) -> Result<Response<pb::EnqueueResponse>, Status> {
            self.asked.lock().unwrap().push(Asked::One);
            answer(request.get_ref()).map(Response::new)
        }
        async fn enqueue_many(
            &self,
            request: Request<pb::EnqueueManyRequest>,
        ) -> Result<Response<pb::EnqueueManyResponse>, Status> {
            let requests = request.into_inner().requests;
            self.asked.lock().unwrap().push(Asked::Many(requests.len()));
            let mut traceparents = self.traceparents.lock().unwrap();
            traceparents.extend(requests.iter().map(|b| b.traceparent.clone()));
            match self.many {
                Many::Answers => {}
                Many::Unimplemented => return Err(Status::unimplemented("EnqueueMany")),
                Many::Fails(code) => return Err(Status::new(code, "refused")),
            }
            let outcomes = requests
                .iter()
                .map(|b| pb::EnqueueOutcome {
                    outcome: Some(match answer(b.request.as_ref().unwrap()) {
                        Ok(response) => pb::enqueue_outcome::Outcome::Admitted(response),
                        Err(status) => pb::enqueue_outcome::Outcome::Refused(
                            orca_push_proto::refused_call(&status),
                        ),
                    }),
                })
                .collect();
            Ok(Response::new(pb::EnqueueManyResponse { outcomes }))
        }
        async fn claim(
            &self,
            _: Request<pb::ClaimRequest>,
        ) -> Result<Response<pb::ClaimResponse>, Status> {
            Err(Status::unimplemented(""))
        }
        async fn renew_lease(
            &self,
            _: Request<pb::RenewLeaseRequest>,
        ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
            Err(Status::unimplemented(""))
        }
        async fn complete(
            &self,
            _: Request<pb::CompleteRequest>,
        ) -> Result<Response<pb::CompleteResponse>, Status> {
            Err(Status::unimplemented(""))
        }
        async fn complete_many(
            &self,
            _: Request<pb::CompleteManyRequest>,
        ) -> Result<Response<pb::CompleteManyResponse>, Status> {
            Err(Status::unimplemented(""))
        }
        async fn retry(
            &self,
            _: Request<pb::RetryRequest>,
        ) -> Result<Response<pb::RetryResponse>, Status> {
            Err(Status::unimplemented(""))
        }
        async fn hold_provider(
            &self,
            _: Request<pb::HoldProviderRequest>,
        ) -> Result<Response<pb::HoldProviderResponse>, Status> {
            Err(Status::unimplemented(""))
        }
        async fn get_event_outcomes(
            &self,
            _: Request<pb::GetEventOutcomesRequest>,
        ) -> Result<Response<pb::GetEventOutcomesResponse>, Status> {
            Err(Status::unimplemented(""))
        }
        async fn get_queue_depth(
            &self,
            _: Request<pb::GetQueueDepthRequest>,
        ) -> Result<Response<pb::GetQueueDepthResponse>, Status> {
            Err(Status::unimplemented(""))
        }
    }

    /// Batching in front of a fake queue across a real socket, and what the queue was asked.
    async fn batching_to(many: Many) -> (Enqueues, Arc<Mutex<Vec<Asked>>>) {
        let (enqueues, asked, _) = batching_with_traces(many).await;
        (enqueues, asked)
    }

    type Traceparents = Arc<Mutex<Vec<Option<String>>>>;

    async fn batching_with_traces(many: Many) -> (Enqueues, Arc<Mutex<Vec<Asked>>>, Traceparents) {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let traceparents = Traceparents::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let fake = FakeQueue {
            many,
            asked: asked.clone(),
            traceparents: traceparents.clone(),
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(QueueServiceServer::new(fake))
                .serve_with_incoming(orca_push_internal_auth::incoming(listener)),
        );
        let key = InternalKey::generate();
        let channel =
            orca_push_internal_auth::channel_to(&Target::Url(url), &key, "facade", "queue")
                .unwrap();
        let enqueues = Enqueues::spawn(QueueServiceClient::new(channel));
        (enqueues, asked, traceparents)
    }

    fn send_of(host: &str) -> pb::EnqueueRequest {
        pb::EnqueueRequest {
            host_fingerprint: host.to_owned(),
            notification: Some(pb::Notification::default()),
            recipients: vec![pb::Recipient {
                registration_id: "r".to_owned(),
                ..Default::default()
            }],
        }
    }

    /// `n` sends made at once, the fourth of host `refused`. On the tests' current-thread runtime
    /// every one is waiting before the batching task first runs, so they go in one call.
    async fn burst(enqueues: &Enqueues, n: usize) -> Vec<Result<pb::EnqueueResponse, Status>> {
        let sends = (0..n).map(|i| {
            let host = if i == 3 {
                "refused".to_owned()
            } else {
                format!("h{i}")
            };
            enqueues.enqueue(send_of(&host))
        });
        futures::future::join_all(sends).await
    }

    fn check_answers(answers: &[Result<pb::EnqueueResponse, Status>]) {
        for (i, answer) in answers.iter().enumerate() {
            if i == 3 {
                let status = answer.as_ref().unwrap_err();
                assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                assert_eq!(orca_push_proto::error_code(status), Some("rate_limited"));
            } else {
                let results = &answer.as_ref().unwrap().results;
                assert_eq!(results.len(), 1);
                assert_eq!(results[0].registration_id, format!("h{i}:r"), "in order");
            }
        }
    }

    #[tokio::test]
    async fn sends_made_together_go_in_one_call_each_with_its_own_answer() {
        let (enqueues, asked) = batching_to(Many::Answers).await;
        let answers = burst(&enqueues, 20).await;
        check_answers(&answers);
        assert_eq!(*asked.lock().unwrap(), [Asked::Many(20)]);
        // A lone send goes as a plain Enqueue.
        let alone = enqueues.enqueue(send_of("h0")).await.unwrap();
        assert_eq!(alone.results[0].registration_id, "h0:r");
        assert_eq!(*asked.lock().unwrap(), [Asked::Many(20), Asked::One]);
    }

    #[tokio::test]
    async fn each_batched_send_carries_its_own_trace() {
        orca_push_telemetry::install_propagator();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = orca_push_telemetry::subscriber(
            &provider,
            orca_push_telemetry::LogFormat::Text,
            std::io::sink,
        );
        let _scoped = tracing::subscriber::set_default(subscriber);
        let (enqueues, asked, traceparents) = batching_with_traces(Many::Answers).await;
        let spans: Vec<_> = (0..3)
            .map(|i| tracing::info_span!("send", orca.i = i))
            .collect();
        let sends = spans
            .iter()
            .map(|span| enqueues.enqueue(send_of("h")).instrument(span.clone()));
        for answer in futures::future::join_all(sends).await {
            answer.unwrap();
        }
        assert_eq!(*asked.lock().unwrap(), [Asked::Many(3)]);
        let expected: Vec<_> = spans
            .iter()
            .map(orca_push_telemetry::traceparent_of)
            .collect();
        assert!(expected.iter().all(Option::is_some), "{expected:?}");
        assert_ne!(expected[0], expected[1]);
        assert_eq!(*traceparents.lock().unwrap(), expected);
    }

    #[tokio::test]
    async fn a_queue_without_enqueue_many_gets_the_sends_one_by_one() {
        let (enqueues, asked) = batching_to(Many::Unimplemented).await;
        check_answers(&burst(&enqueues, 5).await);
        let mut expected = vec![Asked::Many(5)];
        expected.extend([Asked::One; 5]);
        assert_eq!(*asked.lock().unwrap(), expected);
        // Not asked again for a while: the next burst goes one by one at once.
        check_answers(&burst(&enqueues, 5).await);
        expected.extend([Asked::One; 5]);
        assert_eq!(*asked.lock().unwrap(), expected);
    }

    #[tokio::test]
    async fn a_call_refused_whole_goes_again_one_send_at_a_time() {
        let (enqueues, asked) = batching_to(Many::Fails(tonic::Code::InvalidArgument)).await;
        check_answers(&burst(&enqueues, 5).await);
        let mut expected = vec![Asked::Many(5)];
        expected.extend([Asked::One; 5]);
        // Not taken for an older queue: the next burst asks for EnqueueMany again.
        check_answers(&burst(&enqueues, 5).await);
        expected.push(Asked::Many(5));
        expected.extend([Asked::One; 5]);
        assert_eq!(*asked.lock().unwrap(), expected);
    }

    #[tokio::test]
    async fn a_call_lost_whole_fails_each_of_its_sends_as_their_own_would_have() {
        let (enqueues, asked) = batching_to(Many::Fails(tonic::Code::Unavailable)).await;
        for answer in burst(&enqueues, 5).await {
            assert_eq!(answer.unwrap_err().code(), tonic::Code::Unavailable);
        }
        assert_eq!(*asked.lock().unwrap(), [Asked::Many(5)]);
    }

    #[test]
    fn a_failed_call_is_shared_only_when_the_connection_failed() {
        use tonic::Code;
        for code in [
            Code::Unavailable,
            Code::Unknown,
            Code::Internal,
            Code::Cancelled,
        ] {
            assert_eq!(
                on_call_failure(&Status::new(code, "")),
                CallFailure::EachFails
            );
        }
        assert_eq!(
            on_call_failure(&Status::unimplemented("")),
            CallFailure::OneByOne {
                unimplemented: true
            }
        );
        // A service's own refusal names its contract code: not a lost connection.
        let refused =
            orca_push_proto::status_with_code(Code::Unavailable, "dependency_unavailable");
        for status in [
            refused,
            Status::invalid_argument(""),
            Status::resource_exhausted(""),
            Status::permission_denied(""),
        ] {
            assert_eq!(
                on_call_failure(&status),
                CallFailure::OneByOne {
                    unimplemented: false
                }
            );
        }
    }

    #[test]
    fn an_older_queue_is_asked_again_a_minute_later() {
        let unoffered = Unoffered::default();
        assert!(!unoffered.at(0));
        unoffered.mark_at(5_000);
        assert!(unoffered.at(5_000));
        assert!(unoffered.at(64_999));
        assert!(!unoffered.at(65_000));
    }
}
