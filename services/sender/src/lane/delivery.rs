//! One delivery: a claimed batch's attempt at its provider, the breaker's view of the answer,
//! and the report of its outcome; its lease renewed meanwhile.

use std::sync::atomic::Ordering;
use std::time::Duration;

use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument as _;

use super::renewal::{renew_lease, while_renewing};
use super::{HELD_FOR, SATURATED_RETRY, Sender, now_ms};
use crate::breaker::{Breaker, Change, FIRST_HOLD, Gate, ProbeGuard, ProbeWait};
use crate::payload::Job;
use crate::providers::Target;
use crate::report::{ANSWER_WITHIN, Reporter, until_answered};
use crate::verdict::{Verdict, at_ms, gives_up};

/// What the registry said of a batch's device when its claim was read: the device (None when the
/// registration is gone), or the code of the failed call.
type Lookup = Result<Option<registry_pb::DeliveryDevice>, tonic::Code>;

/// What became of one attempt.
enum Outcome {
    Verdict(Verdict, Option<Target>),
    /// Not tried: back to the queue, at this time, as neither an attempt nor a retry (the
    /// earliest member's deadline passed: the queue drops what expired and keeps the rest; a
    /// provider on hold; a provider's share of the lane full).
    HandBack(i64, &'static str),
    Gone(&'static str),
}

impl Sender {
    pub(super) async fn hand_back(
        &self,
        job: &Job,
        at: i64,
        reason: &'static str,
    ) -> Result<bool, tonic::Status> {
        self.hand_back_trying(job, at, reason, ANSWER_WITHIN).await
    }

    /// [`Sender::hand_back`], making the call again while the queue does not answer for at
    /// most `within` (zero: once; a stopping lane, whose batches' leases lapse anyway, must not
    /// outlast the hard stop waiting).
    pub(super) async fn hand_back_trying(
        &self,
        job: &Job,
        at: i64,
        reason: &'static str,
        within: Duration,
    ) -> Result<bool, tonic::Status> {
        metrics::counter!("orca_push_delivery_hand_backs_total", "reason" => reason).increment(1);
        let request = queue_pb::RetryRequest {
            batch_id: job.batch_id.clone(),
            lease_token: job.lease_token.clone(),
            retry_at_ms: at,
            reason: reason.to_owned(),
            provider_answered: false,
            hand_back: true,
        };
        // Not answered, the batch would wait out its lease, or come back before a hold ends.
        let answer = self.retry_trying(request, within).await?;
        Ok(answer.expired)
    }

    /// A `Retry` call, made again while the queue does not answer, for at most `within`.
    async fn retry_trying(
        &self,
        request: queue_pb::RetryRequest,
        within: Duration,
    ) -> Result<queue_pb::RetryResponse, tonic::Status> {
        until_answered(within, || {
            let mut queue = self.queue.clone();
            let request = request.clone();
            async move { queue.retry(request).await }
        })
        .await
        .map(tonic::Response::into_inner)
    }

    pub(super) async fn deliver(
        &self,
        job: Job,
        device: Lookup,
        place: Option<OwnedSemaphorePermit>,
        reporter: &Reporter,
    ) {
        // Its own trace, linked to the trace of every event it carries.
        let span = tracing::info_span!(
            "delivery",
            otel.name = "deliver batch",
            otel.kind = "consumer",
            orca.members = job.member_traceparents.len(),
            orca.attempt = job.attempt,
        );
        orca_push_telemetry::link_traces(&span, &job.member_traceparents);
        self.deliver_in_span(job, device, place, reporter)
            .instrument(span)
            .await;
    }

    async fn deliver_in_span(
        &self,
        job: Job,
        device: Lookup,
        place: Option<OwnedSemaphorePermit>,
        reporter: &Reporter,
    ) {
        let renew = |done| {
            renew_lease(
                self.queue.clone(),
                job.batch_id.clone(),
                job.lease_token.clone(),
                self.lease_ms,
                job.deadline_ms,
                self.clock.clone(),
                done,
            )
        };
        let outcome = while_renewing(renew, self.attempt(&job, device, place)).await;
        if let Err(status) = self.report(&job, outcome, reporter).await {
            // The lease lapses and another lane repeats the attempt.
            tracing::warn!(code = ?status.code(), "could not record a delivery outcome");
        }
    }

    /// `place` is the batch's place in its provider's share of the lane (None if it was full).
    async fn attempt(
        &self,
        job: &Job,
        device: Lookup,
        place: Option<OwnedSemaphorePermit>,
    ) -> Outcome {
        let now = now_ms(&*self.clock);
        if now >= job.deadline_ms {
            return Outcome::HandBack(now, "deadline");
        }
        let device = match device {
            Ok(device) => device,
            Err(code) => {
                // The registry, not the provider, failed: a retry that is not an attempt.
                return Outcome::Verdict(Verdict::unanswered(format!("registry_{code:?}")), None);
            }
        };
        let Some(device) = device else {
            return Outcome::Gone("registration_deleted");
        };
        // The queue takes its recipients as the facade resolved them for the host; a direct caller
        // could name another host's phone, which would get this host's text.
        if device.host_fingerprint != job.host_fingerprint {
            return Outcome::Gone("registration_not_owned");
        }
        if device.dead {
            return Outcome::Gone("dead");
        }
        let target = Target::from_device(device);
        let (breaker, provider) = self.breakers.of(&target);
        // A probe whose result is never recorded (handed back, cancelled, or an answer that
        // says nothing of the provider) lets the next attempt probe instead.
        let probe = match breaker.gate(std::time::Instant::now()) {
            Gate::Pass => None,
            Gate::Probe => Some(ProbeGuard::new(breaker)),
            Gate::Hold(until) => {
                let wait = until.saturating_duration_since(std::time::Instant::now());
                return Outcome::HandBack(at_ms(now, wait), "provider_held");
            }
        };
        let Some(_place) = place else {
            return Outcome::HandBack(at_ms(now, SATURATED_RETRY), "provider_saturated");
        };
        // Nothing is sent past the earliest member's deadline, however the provider stalls.
        let left = Duration::from_millis(u64::try_from(job.deadline_ms - now).unwrap_or(0));
        let (verdict, cut_after) =
            tokio::time::timeout(left, self.providers.send(job, &target, now, &self.counters))
                .await
                .map_or_else(
                    |_| (Verdict::unanswered("deadline"), Some(left)),
                    |v| (v, None),
                );
        let recorded = tells_of_the_provider(&verdict, cut_after)
            && self
                .record_health(breaker, provider, &verdict, probe.is_some())
                .await;
        if let Some(probe) = probe.filter(|_| recorded) {
            probe.recorded();
        }
        Outcome::Verdict(verdict, Some(target))
    }

    /// Feeds the provider's breaker with a verdict that tells of the provider
    /// ([`tells_of_the_provider`]); holds or releases the provider's queued work when it opens or
    /// closes. True: recorded.
    async fn record_health(
        &self,
        breaker: &Breaker,
        provider: Option<queue_pb::Provider>,
        verdict: &Verdict,
        probe: bool,
    ) -> bool {
        let change = match verdict {
            Verdict::Retry { .. } => breaker.failure_of(std::time::Instant::now(), probe),
            _ => breaker.success(),
        };
        // A breaker whose work the queue cannot hold apart (APNs's sandbox) holds it batch by
        // batch, at its gate.
        let Some(provider) = provider else {
            return true;
        };
        let now = now_ms(&*self.clock);
        let request = match change {
            Change::None => return true,
            Change::Opened(until) => {
                let wait = until.saturating_duration_since(std::time::Instant::now());
                // The probe: when the hold is over, one held batch is made due again. The rest
                // stay held until the provider answers (or their deadline), so a large backlog
                // is written once, not at every probe.
                let queue = self.queue.clone();
                let breakers = self.breakers.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(wait).await;
                    let release = || {
                        let mut queue = queue.clone();
                        async move {
                            let probe = queue_pb::HoldProviderRequest {
                                provider: provider as i32,
                                release: true,
                                release_limit: 1,
                                ..Default::default()
                            };
                            if let Err(status) = queue.hold_provider(probe).await {
                                tracing::warn!(code = ?status.code(), "could not release a probe");
                            }
                        }
                    };
                    let wait = || breakers.by(provider).probe_wait(std::time::Instant::now());
                    release_probes(release, wait, FIRST_HOLD, PROBE_RELEASES).await;
                });
                queue_pb::HoldProviderRequest {
                    provider: provider as i32,
                    until_ms: at_ms(now, HELD_FOR),
                    due_before_ms: at_ms(now, wait),
                    ..Default::default()
                }
            }
            Change::Closed => queue_pb::HoldProviderRequest {
                provider: provider as i32,
                release: true,
                ..Default::default()
            },
        };
        if let Err(status) = self.queue.clone().hold_provider(request).await {
            // Holding saves work; a missed hold or release costs at most HELD_FOR: without a hold
            // the provider's batches are claimed and handed back one by one.
            tracing::warn!(code = ?status.code(), "could not hold or release a provider's work");
        }
        true
    }

    async fn report(
        &self,
        job: &Job,
        outcome: Outcome,
        reporter: &Reporter,
    ) -> Result<(), tonic::Status> {
        let answered = matches!(&outcome, Outcome::Verdict(v, Some(_)) if v.answered());
        let complete = |outcome: queue_pb::Outcome, reason: String| queue_pb::CompleteRequest {
            batch_id: job.batch_id.clone(),
            lease_token: job.lease_token.clone(),
            outcome: outcome as i32,
            reason,
            provider_answered: answered,
        };
        let provider = match &outcome {
            Outcome::Verdict(_, Some(target)) => target.provider(),
            _ => "none",
        };
        let delivered = |outcome: &'static str| {
            metrics::counter!("orca_push_deliveries_total", "provider" => provider, "outcome" => outcome).increment(1);
        };
        let c = &self.counters;
        let request = match outcome {
            Outcome::HandBack(at, reason) => {
                if self.hand_back(job, at, reason).await? {
                    c.expired.fetch_add(1, Ordering::Relaxed);
                    delivered("expired");
                }
                return Ok(());
            }
            Outcome::Gone("dead") => {
                c.dead.fetch_add(1, Ordering::Relaxed);
                delivered("dead");
                complete(queue_pb::Outcome::Dead, "dead".into())
            }
            Outcome::Gone(reason) => {
                c.failed.fetch_add(1, Ordering::Relaxed);
                delivered("failed");
                complete(queue_pb::Outcome::Failed, reason.into())
            }
            Outcome::Verdict(Verdict::Sent, _) => {
                c.sent.fetch_add(1, Ordering::Relaxed);
                delivered("sent");
                complete(queue_pb::Outcome::Sent, "sent".into())
            }
            Outcome::Verdict(Verdict::Dead(reason), target) => {
                if let Some(target) = target {
                    // Its next look-up asks the registry, which answers what this mark made it.
                    if let Some(kept) = &self.devices {
                        kept.changed(&job.host_fingerprint);
                    }
                    let marked = self
                        .registry
                        .clone()
                        .mark_dead(target.mark_dead_request(&job.registration_id))
                        .await?
                        .into_inner()
                        .marked;
                    if !marked {
                        // The registration no longer holds what was sent to (the phone
                        // registered a new token since the look-up, was removed, or another
                        // lane marked it first): the provider refused a token the phone has left.
                        // The batch goes back, due at once, and its next attempt looks the phone
                        // up again, so a new token still gets the alert.
                        if self
                            .hand_back(job, now_ms(&*self.clock), "token_replaced")
                            .await?
                        {
                            c.expired.fetch_add(1, Ordering::Relaxed);
                            delivered("expired");
                        }
                        return Ok(());
                    }
                }
                // Counted once the registry took the mark: a token the phone had left is not.
                metrics::counter!("orca_push_dead_tokens_total", "provider" => provider)
                    .increment(1);
                c.dead.fetch_add(1, Ordering::Relaxed);
                delivered("dead");
                complete(queue_pb::Outcome::Dead, reason)
            }
            Outcome::Verdict(Verdict::Failed(reason), _) => {
                c.failed.fetch_add(1, Ordering::Relaxed);
                delivered("failed");
                complete(queue_pb::Outcome::Failed, reason)
            }
            Outcome::Verdict(
                Verdict::Retry {
                    reason,
                    not_before,
                    class,
                    answered,
                },
                target,
            ) => {
                if gives_up(class, answered, job.attempt) {
                    c.failed.fetch_add(1, Ordering::Relaxed);
                    delivered("failed");
                    complete(
                        queue_pb::Outcome::Failed,
                        format!("attempts_exhausted_{reason}"),
                    )
                } else {
                    c.retried.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("orca_push_delivery_retries_total", "provider" => provider)
                        .increment(1);
                    let delay =
                        self.backoff
                            .delay(job.retries + 1, not_before, &mut rand::thread_rng());
                    let request = queue_pb::RetryRequest {
                        batch_id: job.batch_id.clone(),
                        lease_token: job.lease_token.clone(),
                        retry_at_ms: at_ms(now_ms(&*self.clock), delay),
                        reason,
                        provider_answered: answered && target.is_some(),
                        hand_back: false,
                    };
                    // Not answered, the batch would come back when its lease lapses: sooner
                    // than a Retry-After or a quota's minute says.
                    let answer = self.retry_trying(request, ANSWER_WITHIN).await?;
                    if answer.expired {
                        c.expired.fetch_add(1, Ordering::Relaxed);
                        delivered("expired");
                    }
                    return Ok(());
                }
            }
        };
        if !reporter.complete(request).await? {
            tracing::warn!(
                "the lease of a delivered batch was lost before its outcome was recorded"
            );
        }
        Ok(())
    }
}

/// How many times one hold's probe task looks, every `FIRST_HOLD`: until the work's hold
/// (`HELD_FOR`) ends on its own.
const PROBE_RELEASES: u32 = 30;

/// Releases one held batch to be the provider's probe, then looks every `every` (at most `times`
/// times) and releases another whenever the breaker waits for one again (`ProbeWait::Needed`): a
/// released batch that never reaches the provider (its phone removed meanwhile, its look-up
/// failed), or a probe that ends telling nothing, would otherwise leave the whole backlog held
/// until its hold ends, a minute, with the provider answering again. Ends once the breaker
/// closes or holds the work again (a new hold releases its own probes).
async fn release_probes<R>(
    release: impl Fn() -> R,
    wait: impl Fn() -> ProbeWait,
    every: Duration,
    times: u32,
) where
    R: Future<Output = ()>,
{
    release().await;
    for _ in 1..times {
        tokio::time::sleep(every).await;
        match wait() {
            ProbeWait::Done => return,
            ProbeWait::Out => {}
            ProbeWait::Needed => release().await,
        }
    }
}

/// A request cut off by its batch's deadline counts against the provider only if it had at least
/// this long: a provider that answers at all answers well within it, so a shorter cut says only
/// that the deadline was near (a backlog drained at the end of its time, an `expiresAt` set a few
/// milliseconds out), and enough of them would hold every host's work.
const STALL_EVIDENCE: Duration = Duration::from_secs(5);

/// Whether `verdict` tells anything of the provider's health, for its breaker. `cut_after`: how
/// long the request had when the batch's deadline cut it off.
fn tells_of_the_provider(verdict: &Verdict, cut_after: Option<Duration>) -> bool {
    if cut_after.is_some_and(|had| had < STALL_EVIDENCE) {
        return false;
    }
    match verdict {
        // A provider throttling one device or token: APNs's `TooManyRequests`, FCM's 429
        // (`QUOTA_EXCEEDED`, which covers a single device's message rate too; every such retry
        // already waits a minute). And APNs refusing our own provider token once it is stale,
        // re-signed at once for the retry.
        Verdict::Retry { reason, .. } => !matches!(
            reason.as_str(),
            "TooManyRequests"
                | "QUOTA_EXCEEDED"
                | "RESOURCE_EXHAUSTED"
                | "http_429"
                | "ExpiredProviderToken"
        ),
        // Not-configured failures say nothing of the provider.
        Verdict::Failed(reason) => !reason.ends_with("_not_configured"),
        Verdict::Sent | Verdict::Dead(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn throttles_of_one_target_and_near_deadlines_tell_nothing_of_the_provider() {
        use crate::verdict::RetryClass::Transient;
        let retry = |reason: &str| Verdict::answered_retry(reason, Duration::ZERO, Transient);
        for reason in [
            "TooManyRequests",
            "QUOTA_EXCEEDED",
            "RESOURCE_EXHAUSTED",
            "http_429",
            "ExpiredProviderToken",
        ] {
            assert!(!tells_of_the_provider(&retry(reason), None), "{reason}");
        }
        for reason in ["ServiceUnavailable", "INTERNAL", "http_503"] {
            assert!(tells_of_the_provider(&retry(reason), None), "{reason}");
        }
        assert!(tells_of_the_provider(
            &Verdict::unanswered("connection"),
            None
        ));
        let deadline = Verdict::unanswered("deadline");
        assert!(!tells_of_the_provider(
            &deadline,
            Some(Duration::from_millis(20))
        ));
        assert!(tells_of_the_provider(
            &deadline,
            Some(Duration::from_secs(20))
        ));
        assert!(!tells_of_the_provider(
            &Verdict::Failed("apns_not_configured".into()),
            None
        ));
        assert!(tells_of_the_provider(
            &Verdict::Failed("http_400".into()),
            None
        ));
        assert!(tells_of_the_provider(&Verdict::Sent, None));
    }

    /// A probe batch is released again whenever the breaker waits for a probe, not while one is
    /// out, and no more once the breaker closed or held the work again.
    #[tokio::test]
    async fn probes_are_released_until_one_goes_out() {
        let run = |answers: Vec<ProbeWait>, times| async move {
            let released = Arc::new(AtomicUsize::new(0));
            let looked = AtomicUsize::new(0);
            let release = || {
                let released = released.clone();
                async move {
                    released.fetch_add(1, Ordering::Relaxed);
                }
            };
            let wait = || {
                let at = looked.fetch_add(1, Ordering::Relaxed);
                answers.get(at).copied().unwrap_or(ProbeWait::Done)
            };
            release_probes(release, wait, Duration::from_millis(5), times).await;
            released.load(Ordering::Relaxed)
        };
        use ProbeWait::{Done, Needed, Out};
        // The first two never reach the gate; the third is the probe, and it closes the breaker.
        assert_eq!(run(vec![Needed, Needed, Out, Done], 30).await, 3);
        // A probe out at once, and answered.
        assert_eq!(run(vec![Out, Done], 30).await, 1);
        // A probe out, then ended telling nothing: another goes.
        assert_eq!(run(vec![Out, Out, Needed, Out, Done], 30).await, 2);
        // Never more than `times` looks.
        assert_eq!(run(vec![Needed; 10], 4).await, 4);
    }
}
