//! A delivery's lease, renewed every third of it while its lane works on the batch, and the
//! renewer stopped however the delivery ends.

use std::sync::Arc;
use std::time::Duration;

use orca_push_proto::queue::v1 as queue_pb;
use orca_push_storage::Clock;
use tokio_util::sync::CancellationToken;

use super::{QueueClient, now_ms};

/// Runs `work` while the task `renew` starts keeps its lease. The renewer stops when the work
/// ends, and also when the work's future is dropped unfinished (its task aborted, or a panic
/// unwinding through it): an abandoned lease then lapses and another lane takes the batch, where a
/// renewer left running would hold it until its deadline.
pub(super) async fn while_renewing<T, R>(
    renew: impl FnOnce(CancellationToken) -> R,
    work: impl Future<Output = T>,
) -> T
where
    R: Future<Output = ()> + Send + 'static,
{
    let done = CancellationToken::new();
    let stop = done.clone().drop_guard();
    let renewer = tokio::spawn(renew(done));
    let outcome = work.await;
    drop(stop);
    let _ = renewer.await;
    outcome
}

/// Renews a batch's lease every third of it while its lane works on it, until `done` or the
/// batch's deadline: past that, nothing will be sent, and the lease is left to lapse.
pub(super) async fn renew_lease(
    queue: QueueClient,
    batch_id: String,
    token: String,
    lease_ms: u32,
    deadline_ms: i64,
    clock: Arc<dyn Clock>,
    done: CancellationToken,
) {
    let renew = || {
        let mut queue = queue.clone();
        let request = queue_pb::RenewLeaseRequest {
            batch_id: batch_id.clone(),
            lease_token: token.clone(),
            lease_ms,
        };
        async move {
            queue
                .renew_lease(request)
                .await
                .map(|r| r.get_ref().renewed)
        }
    };
    keep_renewed(renew, lease_ms, deadline_ms, &*clock, done).await;
}

/// [`renew_lease`]'s loop: `renew` answers whether the lease still held. A renewal the queue did
/// not answer (restarting, a dropped connection) is tried again at the next third: the lease
/// still has two thirds of its time, and giving up would let it lapse under an attempt in
/// flight, for another lane to send the batch again.
async fn keep_renewed<R, F>(
    mut renew: R,
    lease_ms: u32,
    deadline_ms: i64,
    clock: &dyn Clock,
    done: CancellationToken,
) where
    R: FnMut() -> F,
    F: Future<Output = Result<bool, tonic::Status>>,
{
    let every = Duration::from_millis(u64::from(lease_ms) / 3);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if now_ms(clock) >= deadline_ms {
            return;
        }
        // A delivery that ends while a renewal is on its way does not wait for its answer: its
        // report would otherwise wait as long as a queue that stalled takes to time out (40 s),
        // past the lease it holds.
        let answer = tokio::select! {
            _ = done.cancelled() => return,
            answer = renew() => answer,
        };
        match answer {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!("lost the lease of a batch in flight");
                return;
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), "a lease renewal went unanswered; trying again");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A renewer that counts its renewals every 10 ms until told to stop.
    fn counting(renewals: Arc<AtomicUsize>) -> impl FnOnce(CancellationToken) -> BoxedRenewer {
        move |done| {
            Box::pin(async move {
                loop {
                    tokio::select! {
                        _ = done.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                    }
                    renewals.fetch_add(1, Ordering::Relaxed);
                }
            })
        }
    }

    type BoxedRenewer = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

    /// A renewal the queue did not answer is tried again; one that found the lease gone ends it.
    #[tokio::test(start_paused = true)]
    async fn a_lease_renewal_that_went_unanswered_is_tried_again() {
        let run = |answers: Vec<Result<bool, tonic::Status>>| async move {
            let calls = AtomicUsize::new(0);
            let answers = std::sync::Mutex::new(answers.into_iter());
            let renew = || {
                calls.fetch_add(1, Ordering::Relaxed);
                let answer = answers.lock().unwrap().next().unwrap_or(Ok(true));
                async move { answer }
            };
            let done = CancellationToken::new();
            let stop = done.clone();
            let clock = orca_push_storage::clock::SystemClock;
            let renewing = keep_renewed(renew, 300, i64::MAX, &clock, done);
            let stopping = async {
                tokio::time::sleep(Duration::from_millis(1_050)).await;
                stop.cancel();
            };
            tokio::join!(renewing, stopping);
            calls.load(Ordering::Relaxed)
        };
        let unavailable = || Err(tonic::Status::unavailable("queue restarting"));
        assert_eq!(
            run(vec![unavailable(), unavailable()]).await,
            10,
            "every 100 ms"
        );
        assert_eq!(
            run(vec![Ok(true), Ok(false)]).await,
            2,
            "a lost lease ends it"
        );
    }

    /// A delivery that ends while a renewal is unanswered stops its renewer at once.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_on_its_way_does_not_hold_the_end_of_its_delivery() {
        let renew = || std::future::pending::<Result<bool, tonic::Status>>();
        let done = CancellationToken::new();
        let stop = done.clone();
        let clock = orca_push_storage::clock::SystemClock;
        let started = tokio::time::Instant::now();
        let renewing = keep_renewed(renew, 300, i64::MAX, &clock, done);
        let stopping = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            stop.cancel();
        };
        let ended = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::join!(renewing, stopping);
        })
        .await;
        assert!(ended.is_ok(), "the renewer waited for its renewal");
        assert_eq!(started.elapsed(), Duration::from_millis(150));
    }

    async fn renewals_go_on(renewals: &AtomicUsize) -> bool {
        let before = renewals.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(100)).await;
        renewals.load(Ordering::Relaxed) > before
    }

    #[tokio::test]
    async fn the_renewer_stops_with_its_work_however_that_ends() {
        // The work ends.
        let renewals = Arc::new(AtomicUsize::new(0));
        let answer = while_renewing(
            counting(renewals.clone()),
            tokio::time::sleep(Duration::from_millis(50)),
        )
        .await;
        assert_eq!(answer, ());
        assert!(renewals.load(Ordering::Relaxed) > 0, "it renewed meanwhile");
        assert!(!renewals_go_on(&renewals).await);

        // The delivery's task is aborted mid-attempt (a lane stopping at once).
        let renewals = Arc::new(AtomicUsize::new(0));
        let delivery = tokio::spawn(while_renewing(
            counting(renewals.clone()),
            std::future::pending::<()>(),
        ));
        assert!(renewals_go_on(&renewals).await);
        delivery.abort();
        let _ = delivery.await;
        assert!(
            !renewals_go_on(&renewals).await,
            "an aborted delivery's renewer stops"
        );

        // The attempt panics.
        let renewals = Arc::new(AtomicUsize::new(0));
        let delivery = tokio::spawn(while_renewing(counting(renewals.clone()), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            panic!("an attempt that panics");
        }));
        assert!(delivery.await.is_err());
        assert!(
            !renewals_go_on(&renewals).await,
            "a panicked delivery's renewer stops"
        );
    }
}
