//! Delivery lanes: claim due batches under a lease, re-read their devices (kept while the
//! registry's device watch vouches for them, else one registry call per claim), call each device's
//! provider, report the outcomes (grouped, see [`crate::report`]). A
//! lane renews the lease of every batch it holds; if the process dies, the leases lapse and another
//! lane delivers.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use orca_push_internal_auth::InternalChannel;
use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use orca_push_registry::watched::WatchedHosts;
use orca_push_storage::Clock;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;
use crate::payload::Job;
use crate::providers::{Providers, Target};
use crate::report::Reporter;
use crate::verdict::Backoff;

pub type QueueClient = queue_pb::queue_service_client::QueueServiceClient<InternalChannel>;
pub type RegistryClient =
    registry_pb::registry_service_client::RegistryServiceClient<InternalChannel>;

/// The phones of hosts this sender delivered to, by host, as the registry's look-up answered them
/// (see [`orca_push_registry::watched`]).
pub type Devices = WatchedHosts<registry_pb::DeliveryDevice>;
/// Hosts whose phones are kept at most; when full, the copy starts again empty.
pub const MAX_KEPT_HOSTS: usize = 50_000;
/// What the kept phones may take (ids, hosts, tokens and a share of the maps): a host may register
/// 64 phones with tokens of up to 4 KiB, so a count of hosts alone would not bound it.
pub const MAX_KEPT_BYTES: usize = 32 << 20;

/// An empty copy of the phones lanes look up, within [`MAX_KEPT_HOSTS`] and [`MAX_KEPT_BYTES`]:
/// [`WatchedHosts::follow`] must follow the registry's watch for it to serve anything.
pub fn kept_devices() -> Arc<Devices> {
    Arc::new(WatchedHosts::with_limits(
        "sender",
        MAX_KEPT_HOSTS,
        MAX_KEPT_BYTES,
    ))
}

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
/// How long a lane's claim of a provider's probe waits for a batch of it, and for its turn: short,
/// since this lane's other work waits meanwhile.
const PROBE_CLAIM_WAIT_MS: u32 = 100;
/// How long a lane whose share of a provider is (nearly) full waits, at most, before it asks again
/// for the other provider's work, when its last claim found none.
const SATURATED_POLL: Duration = Duration::from_millis(100);

/// The providers other than `provider`, for a claim of `provider`'s work alone.
fn others(provider: queue_pb::Provider) -> Vec<i32> {
    [queue_pb::Provider::Apns, queue_pb::Provider::Fcm]
        .into_iter()
        .filter(|other| *other != provider)
        .map(|other| other as i32)
        .collect()
}

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
    /// The phones lanes looked up, kept while the registry's device watch vouches for them
    /// ([`Sender::look_up`]), when the registry is across a socket (`None` in one process, where
    /// the registry's own cache answers the call exactly and skipping it measured no gain).
    pub devices: Option<Arc<Devices>>,
    pub providers: Providers,
    pub clock: Arc<dyn Clock>,
    pub counters: Counters,
    pub instance: String,
    pub lease_ms: u32,
    pub backoff: Backoff,
    pub breakers: Arc<Breakers>,
}

/// One circuit breaker per provider, and one more for APNs's sandbox: its endpoint fails apart
/// from production's (separate hosts, separate connections).
#[derive(Debug)]
pub struct Breakers {
    pub apns: Breaker,
    pub apns_sandbox: Breaker,
    pub fcm: Breaker,
}

impl Default for Breakers {
    fn default() -> Self {
        Self {
            apns: Breaker::new("apns"),
            apns_sandbox: Breaker::new("apns_sandbox"),
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

    /// A provider whose probe the caller now claims alone ([`Breaker::claim_probe`]), if one
    /// is due and `room` says the caller has a place for it.
    fn claim_probe(
        &self,
        now: std::time::Instant,
        room: impl Fn(queue_pb::Provider) -> bool,
    ) -> Option<queue_pb::Provider> {
        [queue_pb::Provider::Apns, queue_pb::Provider::Fcm]
            .into_iter()
            .find(|provider| room(*provider) && self.by(*provider).claim_probe(now))
    }

    /// The breaker of `provider`'s work.
    fn by(&self, provider: queue_pb::Provider) -> &Breaker {
        if provider == queue_pb::Provider::Apns {
            &self.apns
        } else {
            &self.fcm
        }
    }

    /// The breaker of `target`'s endpoint, and the provider whose queued work it holds: none for
    /// APNs's sandbox, whose batches the queue does not tell from production's (a failing sandbox
    /// must not hold production's work). While the sandbox's breaker is open, its batches are
    /// handed back one by one until its probe is due (development phones: a few).
    fn of(&self, target: &Target) -> (&Breaker, Option<queue_pb::Provider>) {
        if target.provider() != "apns" {
            (&self.fcm, Some(queue_pb::Provider::Fcm))
        } else if target.apns_environment == registry_pb::ApnsEnvironment::Sandbox as i32 {
            (&self.apns_sandbox, None)
        } else {
            (&self.apns, Some(queue_pb::Provider::Apns))
        }
    }
}

mod delivery;
mod kept;
mod renewal;
mod room;

use room::ProviderRoom;

fn now_ms(clock: &dyn Clock) -> i64 {
    i64::try_from(clock.now_ms()).unwrap_or(i64::MAX)
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
            // would only hand it back (a claim and a retry per new send during an outage). Once
            // it is due, one lane claims one batch to be the probe, and the provider's work stays
            // held for the others meanwhile.
            let now = std::time::Instant::now();
            let probe = self
                .breakers
                .claim_probe(now, |provider| provider_room.has_room(provider));
            let (held, hold_ends) = self.breakers.held(now);
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
            if probe.is_none() && !saturated.is_empty() && least_free.is_none() {
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
            // The probe's claim: one batch, of that provider only (or of no known provider),
            // waiting briefly (for its turn among the lanes' claims, too: a claim that may not
            // wait at all comes back empty while another lane claims). None due: the lanes look
            // again once the claim is stale (`breaker::PROBE_CLAIM_FOR`).
            let (want, wait_ms, skip_providers) = match probe {
                Some(provider) => (1, PROBE_CLAIM_WAIT_MS, others(provider)),
                None => (want, wait_ms, skip_providers),
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
                    if probe.is_none() {
                        claim_size = next_claim_size(claim_size, want, batches.len());
                    }
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
            if probe.is_none() && !saturated.is_empty() && batches.is_empty() {
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

    /// Gives claimed batches back untried (a stopping lane), so another lane can take them at
    /// once instead of after their lease.
    async fn hand_back_all(&self, batches: impl Iterator<Item = queue_pb::ClaimedBatch>) {
        let now = now_ms(&*self.clock);
        for batch in batches {
            let job = Job::from_claim(batch);
            if let Err(status) = self
                .hand_back_trying(&job, now, "stopping", Duration::ZERO)
                .await
            {
                tracing::warn!(code = ?status.code(), "could not hand back a batch; its lease will lapse");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::kept::{from_kept, keep_answered};
    use super::*;

    fn batch(host: &str, id: &str) -> queue_pb::ClaimedBatch {
        queue_pb::ClaimedBatch {
            host_fingerprint: host.into(),
            registration_id: id.into(),
            ..Default::default()
        }
    }

    fn device(host: &str, id: &str) -> registry_pb::DeliveryDevice {
        registry_pb::DeliveryDevice {
            registration_id: id.into(),
            host_fingerprint: host.into(),
            token: format!("token-of-{id}"),
            ..Default::default()
        }
    }

    fn ids(found: &HashMap<String, registry_pb::DeliveryDevice>) -> Vec<&str> {
        let mut ids: Vec<&str> = found.keys().map(String::as_str).collect();
        ids.sort_unstable();
        ids
    }

    /// APNs's sandbox endpoint failing for everyone opens a breaker of its own: production's
    /// iOS work goes on, and no provider's work is held in the queue for it.
    #[test]
    fn a_failing_apns_sandbox_holds_no_production_work() {
        use crate::breaker::{Gate, TRIP_AFTER};
        let breakers = Breakers::default();
        let ios = |environment: registry_pb::ApnsEnvironment| Target {
            platform: registry_pb::Platform::Ios as i32,
            token: "aa".into(),
            apns_environment: environment as i32,
        };
        let now = std::time::Instant::now();
        let (sandbox, held) = breakers.of(&ios(registry_pb::ApnsEnvironment::Sandbox));
        assert_eq!(held, None);
        for _ in 0..TRIP_AFTER {
            sandbox.failure(now);
        }
        assert!(matches!(sandbox.gate(now), Gate::Hold(_)));
        let (production, held) = breakers.of(&ios(registry_pb::ApnsEnvironment::Production));
        assert_eq!(held, Some(queue_pb::Provider::Apns));
        assert_eq!(production.gate(now), Gate::Pass);
        assert!(
            breakers.held(now).0.is_empty(),
            "the lanes skip no provider"
        );
    }

    #[test]
    fn a_claim_takes_kept_hosts_from_memory_and_asks_for_the_rest_once_each() {
        let kept = kept_devices();
        kept.opened();
        kept.heard(&registry_pb::DeviceEvent::default());
        let read = kept.begin().unwrap();
        // The registry answered for hosts a and b; each phone is kept under its own host.
        keep_answered(
            &kept,
            &read,
            &[device("a", "a1"), device("a", "a2"), device("b", "b1")],
        );
        let claim = [
            batch("a", "a1"),
            batch("c", "c2"),
            batch("a", "a1"),
            batch("c", "c1"),
            batch("a", "a2"),
            batch("c", "c2"),
        ];
        let (found, missing) = from_kept(Some((&kept, &read)), &claim);
        assert_eq!(ids(&found), ["a1", "a2"]);
        assert_eq!(found["a1"].token, "token-of-a1");
        assert_eq!(missing, ["c1", "c2"], "sorted, each once");
        // A host is served only whole: one phone not kept asks for all of its phones.
        let (found, missing) =
            from_kept(Some((&kept, &read)), &[batch("a", "a1"), batch("a", "a3")]);
        assert!(found.is_empty());
        assert_eq!(missing, ["a1", "a3"]);
        // A batch naming another host than the phone's is not answered from memory.
        let (found, missing) = from_kept(Some((&kept, &read)), &[batch("x", "b1")]);
        assert!(found.is_empty());
        assert_eq!(missing, ["b1"]);
        // News of host a: its phones are asked for again; b's are still kept.
        kept.changed("a");
        let read = kept.begin().unwrap();
        let (found, missing) =
            from_kept(Some((&kept, &read)), &[batch("a", "a1"), batch("b", "b1")]);
        assert_eq!(ids(&found), ["b1"]);
        assert_eq!(missing, ["a1"]);
        // Without a copy (one process), everything is asked for.
        let (found, missing) = from_kept(None, &[batch("b", "b1")]);
        assert!(found.is_empty());
        assert_eq!(missing, ["b1"]);
    }

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
}
