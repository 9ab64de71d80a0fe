//! Delivery lanes: claim due batches under a lease, re-read their devices (one registry call per
//! claim), call each device's provider, report the outcomes (grouped, see [`crate::report`]). A
//! lane renews the lease of every batch it holds; if the process dies, the leases lapse and another
//! lane delivers.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use orca_push_internal_auth::InternalChannel;
use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use orca_push_storage::Clock;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::payload::Job;
use crate::providers::{Providers, Target};
use crate::report::Reporter;
use crate::verdict::{MAX_ATTEMPTS, Verdict, retry_delay};

pub type QueueClient = queue_pb::queue_service_client::QueueServiceClient<InternalChannel>;
pub type RegistryClient =
    registry_pb::registry_service_client::RegistryServiceClient<InternalChannel>;

/// Lanes per sender instance.
pub const LANES: usize = 4;
/// A batch's lease by default (`ORCA_PUSH_LEASE_MS`), renewed every third of it while a lane works
/// on it. It bounds how long the work of a killed sender waits before another lane takes it.
pub const DEFAULT_LEASE_MS: u32 = 30_000;
/// Deliveries one lane keeps in flight at once.
pub const IN_FLIGHT_PER_LANE: usize = 256;
/// Batches one claim takes at most. A claim is one write transaction with a few statements per
/// batch; at 64 it held SQLite's writer (and PostgreSQL's row locks) long enough to stall
/// admissions, and the benchmark measured 20-50% more accepted sends at 16.
const CLAIM_BATCHES: usize = 16;
/// After the hard stop, how long a lane still lets its reporter send the reports already made.
/// The drain grace (8 s) plus this stays under the platform's 10 s.
const REPORT_GRACE: Duration = Duration::from_secs(1);
/// How long a claim waits for due work before asking again.
const CLAIM_WAIT_MS: u32 = 10_000;

/// Aggregate counters (no labels that could carry personal data).
#[derive(Debug, Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub dead: AtomicU64,
    pub failed: AtomicU64,
    pub expired: AtomicU64,
    pub retried: AtomicU64,
    pub not_configured: AtomicU64,
}

pub struct Sender {
    pub queue: QueueClient,
    pub registry: RegistryClient,
    pub providers: Providers,
    pub clock: Arc<dyn Clock>,
    pub counters: Counters,
    pub instance: String,
    pub lease_ms: u32,
}

fn now_ms(clock: &dyn Clock) -> i64 {
    i64::try_from(clock.now_ms()).unwrap_or(i64::MAX)
}

/// What the registry said of a batch's device when its claim was read: the device (None when the
/// registration is gone), or the code of the failed call.
type Lookup = Result<Option<registry_pb::DeliveryDevice>, tonic::Code>;

/// What became of one attempt.
enum Outcome {
    Verdict(Verdict, Option<Target>),
    Expired,
    Gone(&'static str),
}

impl Sender {
    /// Runs `LANES` lanes until `stop` (stop taking work), then lets in-flight deliveries finish
    /// until `hard_stop`; whatever is still running then is dropped, its lease left to lapse.
    pub async fn run(self: Arc<Self>, stop: CancellationToken, hard_stop: CancellationToken) {
        let lanes: Vec<_> = (0..LANES)
            .map(|i| tokio::spawn(self.clone().lane(i, stop.clone(), hard_stop.clone())))
            .collect();
        for lane in lanes {
            let _ = lane.await;
        }
        self.providers.close().await;
    }

    async fn lane(
        self: Arc<Self>,
        index: usize,
        stop: CancellationToken,
        hard_stop: CancellationToken,
    ) {
        let name = format!("{}/lane-{index}", self.instance);
        let (reporter, reporting) = Reporter::spawn(self.queue.clone());
        let capacity = Arc::new(Semaphore::new(IN_FLIGHT_PER_LANE));
        let mut in_flight = tokio::task::JoinSet::new();
        loop {
            // Wait for room before asking for more work.
            let room = tokio::select! {
                _ = stop.cancelled() => break,
                permit = capacity.clone().acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let want = (capacity.available_permits() + 1).min(CLAIM_BATCHES) as u32;
            let mut queue = self.queue.clone();
            let claimed = tokio::select! {
                _ = stop.cancelled() => break,
                r = queue.claim(queue_pb::ClaimRequest {
                    lane: name.clone(),
                    max_batches: want,
                    lease_ms: self.lease_ms,
                    wait_ms: CLAIM_WAIT_MS,
                }) => r,
            };
            let batches = match claimed {
                Ok(r) => r.into_inner().batches,
                Err(status) => {
                    tracing::warn!(lane = index, code = ?status.code(), "claim failed; retrying shortly");
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            let devices = self.look_up(&batches).await;
            let mut room = Some(room);
            for batch in batches {
                // Several batches of one claim may go to the same phone.
                let device = match &devices {
                    Ok(found) => Ok(found.get(&batch.registration_id).cloned()),
                    Err(code) => Err(*code),
                };
                let permit = match room.take() {
                    Some(p) => p,
                    None => match capacity.clone().acquire_owned().await {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                };
                let sender = self.clone();
                let reporter = reporter.clone();
                in_flight.spawn(async move {
                    sender
                        .deliver(Job::from_claim(batch), device, &reporter)
                        .await;
                    drop(permit);
                });
            }
            while in_flight.try_join_next().is_some() {}
        }
        // Stop taking work; finish what is in flight within the grace.
        tokio::select! {
            _ = async { while in_flight.join_next().await.is_some() {} } => {}
            _ = hard_stop.cancelled() => {
                tracing::warn!(lane = index, left = in_flight.len(), "grace over; leaving the rest to lease expiry");
                in_flight.abort_all();
            }
        }
        // The last reports go out before the lane ends. Past the grace, reports already made get
        // one more second (a dropped report is a redelivery once its lease lapses); what is still
        // left then is left to lease expiry.
        drop(reporter);
        let mut reporting = reporting;
        tokio::select! {
            _ = &mut reporting => return,
            _ = hard_stop.cancelled() => {}
        }
        if tokio::time::timeout(REPORT_GRACE, &mut reporting)
            .await
            .is_err()
        {
            tracing::warn!(
                lane = index,
                "reports still unsent at the hard stop; leaving them to lease expiry"
            );
            reporting.abort();
        }
    }

    /// The devices of a claim's batches, by registration id, in one registry call. The registry is
    /// the truth: a device deleted, marked dead or given a new token since admission is seen here,
    /// just before the attempts.
    async fn look_up(
        &self,
        batches: &[queue_pb::ClaimedBatch],
    ) -> Result<HashMap<String, registry_pb::DeliveryDevice>, tonic::Code> {
        if batches.is_empty() {
            return Ok(HashMap::new());
        }
        let mut registration_ids: Vec<String> =
            batches.iter().map(|b| b.registration_id.clone()).collect();
        registration_ids.sort_unstable();
        registration_ids.dedup();
        let span = tracing::info_span!(
            "look up devices",
            otel.kind = "client",
            orca.devices = registration_ids.len(),
        );
        // Nothing renews the claim's leases yet: a slow registry becomes a retry well before
        // they could lapse.
        let within = Duration::from_millis(u64::from(self.lease_ms) / 3);
        let devices = tokio::time::timeout(
            within,
            self.registry.clone().get_devices_for_delivery(
                registry_pb::GetDevicesForDeliveryRequest { registration_ids },
            ),
        )
        .instrument(span)
        .await
        .map_err(|_| tonic::Code::DeadlineExceeded)?
        .map_err(|status| status.code())?
        .into_inner()
        .devices;
        Ok(devices
            .into_iter()
            .map(|d| (d.registration_id.clone(), d))
            .collect())
    }

    async fn deliver(&self, job: Job, device: Lookup, reporter: &Reporter) {
        // Its own trace, linked to the trace of every event it carries.
        let span = tracing::info_span!(
            "delivery",
            otel.name = "deliver batch",
            otel.kind = "consumer",
            orca.members = job.member_traceparents.len(),
            orca.attempt = job.attempt,
        );
        orca_push_telemetry::link_traces(&span, &job.member_traceparents);
        self.deliver_in_span(job, device, reporter)
            .instrument(span)
            .await;
    }

    async fn deliver_in_span(&self, job: Job, device: Lookup, reporter: &Reporter) {
        let renewing = CancellationToken::new();
        let renewer = tokio::spawn(renew_lease(
            self.queue.clone(),
            job.batch_id.clone(),
            job.lease_token.clone(),
            self.lease_ms,
            renewing.clone(),
        ));
        let outcome = self.attempt(&job, device).await;
        renewing.cancel();
        let _ = renewer.await;
        if let Err(status) = self.report(&job, outcome, reporter).await {
            // The lease lapses and another lane repeats the attempt.
            tracing::warn!(code = ?status.code(), "could not record a delivery outcome");
        }
    }

    async fn attempt(&self, job: &Job, device: Lookup) -> Outcome {
        if now_ms(&*self.clock) >= job.deadline_ms {
            return Outcome::Expired;
        }
        let device = match device {
            Ok(device) => device,
            Err(code) => {
                return Outcome::Verdict(
                    Verdict::Retry {
                        reason: format!("registry_{code:?}"),
                        not_before: Duration::ZERO,
                    },
                    None,
                );
            }
        };
        let Some(device) = device else {
            return Outcome::Gone("registration_deleted");
        };
        if device.dead {
            return Outcome::Gone("dead");
        }
        let target = Target::from_device(device);
        let verdict = self
            .providers
            .send(job, &target, now_ms(&*self.clock), &self.counters)
            .await;
        Outcome::Verdict(verdict, Some(target))
    }

    async fn report(
        &self,
        job: &Job,
        outcome: Outcome,
        reporter: &Reporter,
    ) -> Result<(), tonic::Status> {
        let complete = |outcome: queue_pb::Outcome, reason: String| queue_pb::CompleteRequest {
            batch_id: job.batch_id.clone(),
            lease_token: job.lease_token.clone(),
            outcome: outcome as i32,
            reason,
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
            Outcome::Expired => {
                c.expired.fetch_add(1, Ordering::Relaxed);
                delivered("expired");
                complete(queue_pb::Outcome::Expired, "deadline".into())
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
                c.dead.fetch_add(1, Ordering::Relaxed);
                delivered("dead");
                metrics::counter!("orca_push_dead_tokens_total", "provider" => provider)
                    .increment(1);
                if let Some(target) = target {
                    self.registry
                        .clone()
                        .mark_dead(target.mark_dead_request(&job.registration_id))
                        .await?;
                }
                complete(queue_pb::Outcome::Dead, reason)
            }
            Outcome::Verdict(Verdict::Failed(reason), _) => {
                c.failed.fetch_add(1, Ordering::Relaxed);
                delivered("failed");
                complete(queue_pb::Outcome::Failed, reason)
            }
            Outcome::Verdict(Verdict::Retry { reason, not_before }, target) => {
                // Only provider attempts count towards the cap: a registry outage (no target was
                // read) retries until the deadline instead.
                if job.attempt >= MAX_ATTEMPTS && target.is_some() {
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
                    let delay = retry_delay(job.attempt, not_before);
                    let at = now_ms(&*self.clock)
                        + i64::try_from(delay.as_millis()).unwrap_or(i64::MAX / 2);
                    let answer = self
                        .queue
                        .clone()
                        .retry(queue_pb::RetryRequest {
                            batch_id: job.batch_id.clone(),
                            lease_token: job.lease_token.clone(),
                            retry_at_ms: at,
                            reason,
                        })
                        .await?
                        .into_inner();
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

async fn renew_lease(
    queue: QueueClient,
    batch_id: String,
    token: String,
    lease_ms: u32,
    done: CancellationToken,
) {
    let every = Duration::from_millis(u64::from(lease_ms) / 3);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let renewed = queue
            .clone()
            .renew_lease(queue_pb::RenewLeaseRequest {
                batch_id: batch_id.clone(),
                lease_token: token.clone(),
                lease_ms,
            })
            .await;
        if !matches!(renewed, Ok(ref r) if r.get_ref().renewed) {
            tracing::warn!("lost the lease of a batch in flight");
            return;
        }
    }
}
