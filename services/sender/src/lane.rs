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
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::breaker::{Breaker, Change, Gate, ProbeGuard};
use crate::payload::Job;
use crate::providers::{Providers, Target};
use crate::report::Reporter;
use crate::verdict::{Backoff, Verdict, at_ms, gives_up};

pub type QueueClient = queue_pb::queue_service_client::QueueServiceClient<InternalChannel>;
pub type RegistryClient =
    registry_pb::registry_service_client::RegistryServiceClient<InternalChannel>;

/// Lanes per sender instance.
pub const LANES: usize = 4;
/// A batch's lease by default (`ORCA_PUSH_LEASE_MS`), renewed every third of it while a lane works
/// on it. It bounds how long the work of a killed sender waits before another lane takes it.
pub const DEFAULT_LEASE_MS: u32 = 30_000;
/// Deliveries one lane keeps in flight at once. At 256, the four lanes' share of one provider (768)
/// was less than the benchmark's 1,000 end-to-end flows: the rest were claimed, found their
/// provider's share full and were handed back for a second, each hand-back a write (1,526 in one
/// 1,000-flow run), and the work waited in the table where the writer's rounds could not hand it
/// over (docs/benchmarks.md, round 17). The peak RSS of that run rose by 10-15 MiB.
pub const IN_FLIGHT_PER_LANE: usize = 384;
/// Deliveries of one provider a lane keeps in flight at most: a provider that stalls (every
/// request waiting out its timeout) leaves the other a quarter of the lane.
pub const IN_FLIGHT_PER_PROVIDER: usize = IN_FLIGHT_PER_LANE * 3 / 4;
/// How long a failing provider's work is held in one go: twice the longest breaker hold. A probe's
/// success releases it at once; should that release never come (the sender restarted, the probe
/// went to another replica, an RPC failed), the work comes back on its own this soon, where the
/// next probe finds it. Each failed probe re-holds only what would come due before the next one.
const HELD_FOR: Duration = Duration::from_secs(60);
/// A batch handed back because its provider's share of the lane was full waits this long.
const SATURATED_RETRY: Duration = Duration::from_secs(1);
/// Batches one claim takes at first, and again whenever a claim comes back with less than it
/// asked for. A claim is one write transaction with a few statements per batch; at 64 it held
/// SQLite's writer (and PostgreSQL's row locks) long enough to stall admissions, and the benchmark
/// measured 20-50% more accepted sends at 16.
const CLAIM_BATCHES: usize = 16;
/// Batches one claim takes at most, once claims keep coming back full: the work waiting is then
/// more than the lanes' claims of 16 could take (at 1,000 end-to-end flows, sends waited some
/// 400 ms between `queued` and the provider), and a claim costs a wait for the writer however
/// much it takes (docs/benchmarks.md, round 9).
const CLAIM_BATCHES_BACKLOGGED: usize = 64;
/// After the hard stop, how long a lane still lets its reporter send the reports already made.
/// The drain grace (8 s) plus this stays under the platform's 10 s.
const REPORT_GRACE: Duration = Duration::from_secs(1);
/// How long a claim waits for due work before asking again.
const CLAIM_WAIT: Duration = Duration::from_secs(10);
/// How long a lane whose share of a provider is (nearly) full waits, at most, before it asks again
/// for the other provider's work, when its last claim found none.
const SATURATED_POLL: Duration = Duration::from_millis(100);

/// How many batches the lane's claims ask for at most (never more than it has room for), after
/// one that could ask for `size`, asked for `asked` and got `got`: twice as many (up to
/// `CLAIM_BATCHES_BACKLOGGED`) while claims come back full, else back to `CLAIM_BATCHES`.
fn next_claim_size(size: usize, asked: usize, got: usize) -> usize {
    if got >= asked {
        (size * 2).clamp(CLAIM_BATCHES, CLAIM_BATCHES_BACKLOGGED)
    } else {
        CLAIM_BATCHES
    }
}

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
    pub backoff: Backoff,
    pub breakers: Breakers,
}

/// One circuit breaker per provider.
#[derive(Debug)]
pub struct Breakers {
    pub apns: Breaker,
    pub fcm: Breaker,
}

impl Default for Breakers {
    fn default() -> Self {
        Self {
            apns: Breaker::new("apns"),
            fcm: Breaker::new("fcm"),
        }
    }
}

impl Breakers {
    /// The providers whose work is held now, and the earliest end of those holds: a claim leaves
    /// their work alone and waits no longer than that.
    fn held(&self, now: std::time::Instant) -> (Vec<i32>, Option<Duration>) {
        let mut providers = Vec::new();
        let mut first_end: Option<Duration> = None;
        for (breaker, provider) in [
            (&self.apns, queue_pb::Provider::Apns),
            (&self.fcm, queue_pb::Provider::Fcm),
        ] {
            if let Some(until) = breaker.held_until(now) {
                providers.push(provider as i32);
                let left = until.saturating_duration_since(now);
                first_end = Some(first_end.map_or(left, |end| end.min(left)));
            }
        }
        (providers, first_end)
    }

    fn of(&self, target: &Target) -> (&Breaker, queue_pb::Provider) {
        if target.provider() == "apns" {
            (&self.apns, queue_pb::Provider::Apns)
        } else {
            (&self.fcm, queue_pb::Provider::Fcm)
        }
    }
}

/// A lane's room for each provider (see [`IN_FLIGHT_PER_PROVIDER`]).
#[derive(Clone)]
struct ProviderRoom {
    apns: Arc<Semaphore>,
    fcm: Arc<Semaphore>,
}

impl ProviderRoom {
    fn new() -> Self {
        Self {
            apns: Arc::new(Semaphore::new(IN_FLIGHT_PER_PROVIDER)),
            fcm: Arc::new(Semaphore::new(IN_FLIGHT_PER_PROVIDER)),
        }
    }

    fn each(&self) -> [(queue_pb::Provider, &Arc<Semaphore>); 2] {
        [
            (queue_pb::Provider::Apns, &self.apns),
            (queue_pb::Provider::Fcm, &self.fcm),
        ]
    }

    /// A place in the share of the provider of a device of `platform`, if one is free.
    fn try_take(&self, platform: i32) -> Option<OwnedSemaphorePermit> {
        let room = if platform == registry_pb::Platform::Ios as i32 {
            &self.apns
        } else {
            &self.fcm
        };
        room.clone().try_acquire_owned().ok()
    }

    /// What the lane's next claim may take: the providers to leave alone (`held` ones and those
    /// with fewer than `CLAIM_BATCHES` places free) and the fewest places free among the rest,
    /// so that no batch it brings back finds its provider's share full. None when every provider
    /// is left alone.
    fn claimable(&self, held: &[i32]) -> (Vec<i32>, Option<usize>) {
        let mut skip = held.to_vec();
        let mut least: Option<usize> = None;
        for (provider, room) in self.each() {
            let provider = provider as i32;
            if skip.contains(&provider) {
                continue;
            }
            let free = room.available_permits();
            if free < CLAIM_BATCHES {
                skip.push(provider);
            } else {
                least = Some(least.map_or(free, |l| l.min(free)));
            }
        }
        (skip, least)
    }

    /// Resolves once one of the `saturated` providers has `CLAIM_BATCHES` places free again (at
    /// once if one has; never if none is named). The places are only looked at, not kept: the
    /// claim that follows counts them again.
    async fn freed(&self, saturated: &[i32]) {
        let freed = |provider: queue_pb::Provider, room: &Arc<Semaphore>| {
            let room = room.clone();
            let named = saturated.contains(&(provider as i32));
            async move {
                if !named {
                    std::future::pending::<()>().await;
                }
                let _ = room.acquire_many(CLAIM_BATCHES as u32).await;
            }
        };
        tokio::select! {
            _ = freed(queue_pb::Provider::Apns, &self.apns) => {}
            _ = freed(queue_pb::Provider::Fcm, &self.fcm) => {}
        }
    }
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
    /// Not tried: back to the queue, at this time, as neither an attempt nor a retry (the
    /// earliest member's deadline passed: the queue drops what expired and keeps the rest; a
    /// provider on hold; a provider's share of the lane full).
    HandBack(i64, &'static str),
    Gone(&'static str),
}

impl Sender {
    /// Runs `LANES` lanes until `stop` (stop taking work), then lets in-flight deliveries finish
    /// until `hard_stop`; whatever is still running then is dropped, its lease left to lapse.
    pub async fn run(self: Arc<Self>, stop: CancellationToken, hard_stop: CancellationToken) {
        // A sender that stopped while a breaker was open left its provider's work held: a new
        // one starts closed, so that work is due again now rather than when the hold ends.
        for provider in [queue_pb::Provider::Apns, queue_pb::Provider::Fcm] {
            let release = queue_pb::HoldProviderRequest {
                provider: provider as i32,
                release: true,
                ..Default::default()
            };
            if let Err(status) = self.queue.clone().hold_provider(release).await {
                tracing::warn!(code = ?status.code(), "could not release held work at start");
            }
        }
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
        let provider_room = ProviderRoom::new();
        let mut in_flight = tokio::task::JoinSet::new();
        let mut claim_size = CLAIM_BATCHES;
        loop {
            // Wait for room before asking for more work.
            let room = tokio::select! {
                _ = stop.cancelled() => break,
                permit = capacity.clone().acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            // A held provider's work stays in the queue until its probe is due: claiming it
            // would only hand it back (a claim and a retry per new send during an outage).
            let (held, hold_ends) = self.breakers.held(std::time::Instant::now());
            let hold_wait = hold_ends.map_or(CLAIM_WAIT, |left| left.min(CLAIM_WAIT));
            // So is the work of a provider whose share of this lane is (nearly) full: another
            // lane takes it, or this one once places free. Taken and found with no place, it
            // would go back for `SATURATED_RETRY`.
            let (skip_providers, least_free) = provider_room.claimable(&held);
            let saturated: Vec<i32> = skip_providers
                .iter()
                .filter(|provider| !held.contains(provider))
                .copied()
                .collect();
            if !saturated.is_empty() && least_free.is_none() {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    () = provider_room.freed(&saturated) => {}
                    () = tokio::time::sleep(hold_wait) => {}
                }
                continue;
            }
            let want = (capacity.available_permits() + 1)
                .min(claim_size)
                .min(least_free.unwrap_or(usize::MAX));
            // With a provider left alone for its share, the claim does not wait for work: if it
            // finds none, the lane waits for that provider's places or `SATURATED_POLL`,
            // whichever comes first.
            let wait_ms = if !saturated.is_empty() {
                0
            } else {
                u32::try_from(hold_wait.as_millis()).unwrap_or(u32::MAX)
            };
            let mut queue = self.queue.clone();
            let claimed = tokio::select! {
                _ = stop.cancelled() => break,
                r = queue.claim(queue_pb::ClaimRequest {
                    lane: name.clone(),
                    max_batches: want as u32,
                    lease_ms: self.lease_ms,
                    wait_ms,
                    skip_providers,
                }) => r,
            };
            let batches = match claimed {
                Ok(r) => {
                    let batches = r.into_inner().batches;
                    claim_size = next_claim_size(claim_size, want, batches.len());
                    batches
                }
                Err(status) => {
                    claim_size = CLAIM_BATCHES;
                    tracing::warn!(lane = index, code = ?status.code(), "claim failed; retrying shortly");
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            if !saturated.is_empty() && batches.is_empty() {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    () = provider_room.freed(&saturated) => {}
                    () = tokio::time::sleep(SATURATED_POLL) => {}
                }
                continue;
            }
            let devices = self.look_up(&batches).await;
            let mut room = Some(room);
            let mut batches = batches.into_iter();
            while let Some(batch) = batches.next() {
                // Several batches of one claim may go to the same phone.
                let device = match &devices {
                    Ok(found) => Ok(found.get(&batch.registration_id).cloned()),
                    Err(code) => Err(*code),
                };
                let permit = match room.take() {
                    Some(p) => p,
                    None => tokio::select! {
                        permit = capacity.clone().acquire_owned() => match permit {
                            Ok(p) => p,
                            Err(_) => break,
                        },
                        // Stopping: work not started yet goes back to the queue now rather than
                        // waiting out its lease.
                        _ = stop.cancelled() => {
                            self.hand_back_all(std::iter::once(batch).chain(batches.by_ref())).await;
                            break;
                        }
                    },
                };
                // Its place in the provider's share, taken here so that the next claim counts it.
                let place = match &device {
                    Ok(Some(device)) if !device.dead => provider_room.try_take(device.platform),
                    _ => None,
                };
                let sender = self.clone();
                let reporter = reporter.clone();
                in_flight.spawn(async move {
                    // A delivery's state is some 10 KiB: boxed, the task's cell holds a pointer,
                    // and spawning and finishing move that rather than the whole state.
                    Box::pin(sender.deliver(Job::from_claim(batch), device, place, &reporter))
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
    /// just before the attempts (on PostgreSQL a replica's kept copy of a host follows another
    /// replica's write by the time its relay takes to hear of it; a token the provider then
    /// refuses is marked dead only while it is still the registration's).
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

    /// Gives claimed batches back untried (a stopping lane), so another lane can take them at
    /// once instead of after their lease.
    async fn hand_back_all(&self, batches: impl Iterator<Item = queue_pb::ClaimedBatch>) {
        let now = now_ms(&*self.clock);
        for batch in batches {
            let job = Job::from_claim(batch);
            if let Err(status) = self.hand_back(&job, now, "stopping").await {
                tracing::warn!(code = ?status.code(), "could not hand back a batch; its lease will lapse");
            }
        }
    }

    async fn hand_back(&self, job: &Job, at: i64, reason: &str) -> Result<bool, tonic::Status> {
        let answer = self
            .queue
            .clone()
            .retry(queue_pb::RetryRequest {
                batch_id: job.batch_id.clone(),
                lease_token: job.lease_token.clone(),
                retry_at_ms: at,
                reason: reason.to_owned(),
                provider_answered: false,
                hand_back: true,
            })
            .await?
            .into_inner();
        Ok(answer.expired)
    }

    async fn deliver(
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
        let renewing = CancellationToken::new();
        let renewer = tokio::spawn(renew_lease(
            self.queue.clone(),
            job.batch_id.clone(),
            job.lease_token.clone(),
            self.lease_ms,
            job.deadline_ms,
            self.clock.clone(),
            renewing.clone(),
        ));
        let outcome = self.attempt(&job, device, place).await;
        renewing.cancel();
        let _ = renewer.await;
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
        let verdict =
            tokio::time::timeout(left, self.providers.send(job, &target, now, &self.counters))
                .await
                .unwrap_or_else(|_| Verdict::unanswered("deadline"));
        let recorded = self.record_health(breaker, provider, &verdict).await;
        if let Some(probe) = probe.filter(|_| recorded) {
            probe.recorded();
        }
        Outcome::Verdict(verdict, Some(target))
    }

    /// Feeds the provider's breaker; holds or releases the provider's queued work when it opens or
    /// closes. False when the verdict said nothing of the provider (nothing recorded).
    async fn record_health(
        &self,
        breaker: &Breaker,
        provider: queue_pb::Provider,
        verdict: &Verdict,
    ) -> bool {
        let change = match verdict {
            // APNs throttles one device token this way: that says nothing of the provider.
            Verdict::Retry { reason, .. } if reason == "TooManyRequests" => return false,
            Verdict::Retry { .. } => breaker.failure(std::time::Instant::now()),
            // Not-configured failures say nothing of the provider.
            Verdict::Failed(reason) if reason.ends_with("_not_configured") => return false,
            _ => breaker.success(),
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
                tokio::spawn(async move {
                    tokio::time::sleep(wait).await;
                    let probe = queue_pb::HoldProviderRequest {
                        provider: provider as i32,
                        release: true,
                        release_limit: 1,
                        ..Default::default()
                    };
                    if let Err(status) = queue.clone().hold_provider(probe).await {
                        tracing::warn!(code = ?status.code(), "could not release a probe");
                    }
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
                    let answer = self
                        .queue
                        .clone()
                        .retry(queue_pb::RetryRequest {
                            batch_id: job.batch_id.clone(),
                            lease_token: job.lease_token.clone(),
                            retry_at_ms: at_ms(now_ms(&*self.clock), delay),
                            reason,
                            provider_answered: answered && target.is_some(),
                            hand_back: false,
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

/// Renews a batch's lease every third of it while its lane works on it, until `done` or the
/// batch's deadline: past that, nothing will be sent, and the lease is left to lapse.
async fn renew_lease(
    queue: QueueClient,
    batch_id: String,
    token: String,
    lease_ms: u32,
    deadline_ms: i64,
    clock: Arc<dyn Clock>,
    done: CancellationToken,
) {
    let every = Duration::from_millis(u64::from(lease_ms) / 3);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if now_ms(&*clock) >= deadline_ms {
            return;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_grow_while_they_come_back_full_and_start_over_when_not() {
        assert_eq!(next_claim_size(16, 16, 16), 32);
        assert_eq!(next_claim_size(32, 32, 32), 64);
        assert_eq!(
            next_claim_size(64, 64, 64),
            64,
            "never past the backlog's bound"
        );
        assert_eq!(
            next_claim_size(64, 64, 63),
            CLAIM_BATCHES,
            "short: back to 16"
        );
        assert_eq!(next_claim_size(16, 16, 0), CLAIM_BATCHES);
        // Short of room, the lane asked for less than it could: a full answer still grows it.
        assert_eq!(next_claim_size(64, 20, 20), 64);
        assert_eq!(next_claim_size(16, 3, 3), 32);
    }

    const IOS: i32 = registry_pb::Platform::Ios as i32;
    const ANDROID: i32 = registry_pb::Platform::Android as i32;
    const APNS: i32 = queue_pb::Provider::Apns as i32;
    const FCM: i32 = queue_pb::Provider::Fcm as i32;

    #[test]
    fn a_claim_takes_no_more_than_the_fullest_providers_share_has_room_for() {
        let room = ProviderRoom::new();
        assert_eq!(room.claimable(&[]), (vec![], Some(IN_FLIGHT_PER_PROVIDER)));
        let apns: Vec<_> = (0..IN_FLIGHT_PER_PROVIDER - 20)
            .map(|_| room.try_take(IOS).unwrap())
            .collect();
        assert_eq!(
            room.claimable(&[]),
            (vec![], Some(20)),
            "20 places left for APNs"
        );
        let fcm = room.try_take(ANDROID).unwrap();
        assert_eq!(room.claimable(&[]), (vec![], Some(20)));
        drop(fcm);
        // Under CLAIM_BATCHES places: APNs work is left to other lanes, FCM's still taken.
        let more: Vec<_> = (0..5).map(|_| room.try_take(IOS).unwrap()).collect();
        assert_eq!(
            room.claimable(&[]),
            (vec![APNS], Some(IN_FLIGHT_PER_PROVIDER))
        );
        // A held provider is skipped as before, and counts for nothing.
        assert_eq!(room.claimable(&[FCM]), (vec![FCM, APNS], None));
        drop(more);
        assert_eq!(room.claimable(&[FCM]), (vec![FCM], Some(20)));
        drop(apns);
    }

    #[test]
    fn a_full_share_has_no_place_to_give() {
        let room = ProviderRoom::new();
        let taken: Vec<_> = (0..IN_FLIGHT_PER_PROVIDER)
            .map(|_| room.try_take(IOS).unwrap())
            .collect();
        assert!(room.try_take(IOS).is_none());
        assert!(
            room.try_take(ANDROID).is_some(),
            "the other provider's share is apart"
        );
        drop(taken);
        assert!(room.try_take(IOS).is_some());
    }

    #[tokio::test]
    async fn a_saturated_lane_wakes_when_its_share_has_room_again() {
        let room = ProviderRoom::new();
        let mut apns: Vec<_> = (0..IN_FLIGHT_PER_PROVIDER)
            .map(|_| room.try_take(IOS).unwrap())
            .collect();
        let soon = Duration::from_millis(50);
        // FCM's share is empty, but the lane waits for APNs places, not for FCM's.
        assert!(
            tokio::time::timeout(soon, room.freed(&[APNS]))
                .await
                .is_err(),
            "APNs full"
        );
        apns.truncate(apns.len() - (CLAIM_BATCHES - 1));
        assert!(
            tokio::time::timeout(soon, room.freed(&[APNS]))
                .await
                .is_err(),
            "one place short of a claim"
        );
        apns.pop();
        tokio::time::timeout(soon, room.freed(&[APNS]))
            .await
            .expect("a claim's worth of places");
        assert!(
            tokio::time::timeout(soon, room.freed(&[])).await.is_err(),
            "nothing to wait for: only the lane's timer ends the wait"
        );
        assert_eq!(
            room.claimable(&[]),
            (vec![], Some(CLAIM_BATCHES)),
            "the places looked at were given back"
        );
    }
}
