//! The facade's defences against the open internet, per instance and in memory: who a client is,
//! token buckets per client IP and per host (governor), the forged-bearer budget, and bounded
//! admission to session look-ups. Every map here has a hard cap, so a flood of distinct keys cannot
//! grow memory without bound.

use std::hash::Hash;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::error::ApiError;

/// Challenge and session share one bucket per client IP.
pub const UNAUTHENTICATED_PER_MINUTE: u32 = 30;
/// Each host's authenticated requests.
pub const HOST_PER_MINUTE: u32 = 600;
/// Requests with a missing, malformed, unknown or expired bearer, per client IP.
pub const INVALID_BEARER_PER_MINUTE: u32 = 30;
/// Most keys one bucket map holds; past it, idle keys are swept and, if it is still full, new keys
/// share one overflow bucket.
pub const MAX_KEYS_PER_MAP: usize = 100_000;
/// Concurrent session look-ups, and how many more may wait for one.
pub const LOOKUP_CONCURRENCY: usize = 64;
pub const LOOKUP_QUEUE: usize = 256;
/// How long a request waits in that queue before it is told `busy`.
pub const LOOKUP_WAIT: Duration = Duration::from_secs(2);

/// The buckets that answer `rate_limited`, as `orca_push_rate_limit_refusals_total` labels them.
pub const RATE_LIMIT_BUCKETS: [&str; 3] = ["unauthenticated", "host", "invalid_bearer"];
/// Why a request was answered `busy`, as `orca_push_busy_refusals_total` labels it: the session
/// look-up queue was full, or the wait in it ran out.
pub const BUSY_REASONS: [&str; 2] = ["lookup_queue_full", "lookup_wait_timeout"];

/// A refusal by `bucket` (one of [`RATE_LIMIT_BUCKETS`]), counted.
fn rate_limited(bucket: &'static str) -> ApiError {
    metrics::counter!("orca_push_rate_limit_refusals_total", "bucket" => bucket).increment(1);
    ApiError::RateLimited
}

/// A `busy` answer for `reason` (one of [`BUSY_REASONS`]), counted.
fn busy(reason: &'static str) -> ApiError {
    metrics::counter!("orca_push_busy_refusals_total", "reason" => reason).increment(1);
    ApiError::Busy
}

/// Who a request is, for the per-IP buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientKey {
    Ip(IpAddr),
    /// No trustworthy address: every such request shares one bucket.
    Shared,
}

fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<std::net::SocketAddr>().ok().map(|a| a.ip()))
        .map(bucket_address)
}

/// The IPv6 prefix that shares one bucket: a single subscriber is routinely handed a whole /64, so
/// keying by address would give a flood 2^64 buckets.
pub const IPV6_BUCKET_PREFIX: u32 = 64;

/// The address a bucket is keyed by: an IPv4 address as itself (also when written IPv4-mapped,
/// `::ffff:a.b.c.d`), an IPv6 address by its /64.
pub fn bucket_address(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mask = u128::MAX << (128 - IPV6_BUCKET_PREFIX);
                IpAddr::V6(std::net::Ipv6Addr::from(v6.to_bits() & mask))
            }
        },
    }
}

/// The client address: the last `x-forwarded-for` hop after skipping `trusted_hops` appenders (a
/// shorter header is not trusted at all), then `x-real-ip`, then the shared bucket. Everything left
/// of the chosen hop is caller-supplied and never earns a bucket of its own.
///
/// A header with a value that is not visible ASCII is not trusted at all either: a proxy that
/// appends the client to the caller's line would have its hop dropped with the caller's bytes, and
/// the caller would pick its own bucket with `x-real-ip` (or with the hops of another line).
pub fn client_key(headers: &HeaderMap, trusted_hops: usize) -> ClientKey {
    let values = headers.get_all("x-forwarded-for");
    if values.iter().any(|v| v.to_str().is_err()) {
        return ClientKey::Shared;
    }
    let hops: Vec<&str> = values
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .collect();
    if !hops.is_empty() {
        if hops.len() > trusted_hops
            && let Some(ip) = parse_hop(hops[hops.len() - 1 - trusted_hops])
        {
            return ClientKey::Ip(ip);
        }
        // Present but too short (or unparsable at the trusted depth): not trusted at all.
    } else if let Some(ip) = headers
        .get("x-real-ip")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_hop)
    {
        return ClientKey::Ip(ip);
    }
    ClientKey::Shared
}

/// A keyed token bucket with a hard cap on its keys. governor keeps one small state per key; a key
/// whose bucket has refilled carries no information and is swept. If the map is still full of
/// active keys after a sweep (a flood of distinct keys within seconds), every request shares one
/// overflow bucket until the flood subsides: memory stays bounded and the flood stays blunted.
pub struct BoundedBuckets<K: Hash + Eq + Clone> {
    keyed: DefaultKeyedRateLimiter<K>,
    overflow: DefaultDirectRateLimiter,
    max_keys: usize,
    sweeps: SweepSpacing,
}

/// A sweep walks a whole map: at most one per 500 ms, or a flood at a map's cap would turn every
/// request into a full scan. Shared by the limiter's maps and the session cache.
#[derive(Debug, Default)]
pub struct SweepSpacing {
    last: std::sync::Mutex<Option<Instant>>,
}

impl SweepSpacing {
    const SPACING: Duration = Duration::from_millis(500);

    /// True (and the time taken) when a sweep may run now.
    pub fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let due = last.is_none_or(|at| at.elapsed() >= Self::SPACING);
        if due {
            *last = Some(Instant::now());
        }
        due
    }
}

impl<K: Hash + Eq + Clone> BoundedBuckets<K> {
    pub fn per_minute(per_minute: u32, max_keys: usize) -> Self {
        let quota = Quota::per_minute(NonZeroU32::new(per_minute).unwrap_or(NonZeroU32::MIN));
        Self {
            keyed: RateLimiter::keyed(quota),
            overflow: RateLimiter::direct(quota),
            max_keys,
            sweeps: SweepSpacing::default(),
        }
    }

    /// Takes one token for `key`; false when its bucket is empty.
    pub fn try_take(&self, key: &K) -> bool {
        if self.keyed.len() >= self.max_keys {
            if self.sweeps.due() {
                self.sweep();
            }
            if self.keyed.len() >= self.max_keys {
                return self.overflow.check().is_ok();
            }
        }
        self.keyed.check_key(key).is_ok()
    }

    /// Drops buckets whose state is indistinguishable from a fresh one (governor: unused for two
    /// emission intervals, 4 s at 30 per minute).
    pub fn sweep(&self) {
        self.keyed.retain_recent();
        self.keyed.shrink_to_fit();
    }

    pub fn len(&self) -> usize {
        self.keyed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keyed.is_empty()
    }
}

/// IPs whose forged-bearer budget ran out, refused before any session look-up until the budget
/// has a token again (one token refills every 2 s at 30 per minute).
#[derive(Default)]
struct Penalties {
    until: dashmap::DashMap<ClientKey, Instant>,
    sweeps: SweepSpacing,
}

const PENALTY: Duration = Duration::from_secs(2);

impl Penalties {
    fn is_penalised(&self, key: &ClientKey) -> bool {
        self.until
            .get(key)
            .is_some_and(|until| *until > Instant::now())
    }

    fn penalise(&self, key: ClientKey) {
        if self.until.len() >= MAX_KEYS_PER_MAP {
            if self.sweeps.due() {
                self.sweep();
            }
            if self.until.len() >= MAX_KEYS_PER_MAP {
                // Full of live penalties: the oldest-expiring are not worth tracking more than new
                // ones; the invalid-bearer bucket still charges every look-up from this key.
                return;
            }
        }
        self.until.insert(key, Instant::now() + PENALTY);
    }

    fn sweep(&self) {
        let now = Instant::now();
        self.until.retain(|_, until| *until > now);
        self.until.shrink_to_fit();
    }
}

/// Every limit the facade applies, shared by all requests of this instance.
pub struct Limits {
    pub trusted_proxy_hops: usize,
    unauthenticated: BoundedBuckets<ClientKey>,
    hosts: BoundedBuckets<String>,
    invalid_bearers: BoundedBuckets<ClientKey>,
    penalties: Penalties,
    lookups: Semaphore,
    waiting: AtomicUsize,
}

impl Limits {
    pub fn new(trusted_proxy_hops: usize) -> Arc<Self> {
        // At zero from the start, so a rate over them is defined before the first refusal.
        for bucket in RATE_LIMIT_BUCKETS {
            metrics::counter!("orca_push_rate_limit_refusals_total", "bucket" => bucket)
                .increment(0);
        }
        for reason in BUSY_REASONS {
            metrics::counter!("orca_push_busy_refusals_total", "reason" => reason).increment(0);
        }
        Arc::new(Self {
            trusted_proxy_hops,
            unauthenticated: BoundedBuckets::per_minute(
                UNAUTHENTICATED_PER_MINUTE,
                MAX_KEYS_PER_MAP,
            ),
            hosts: BoundedBuckets::per_minute(HOST_PER_MINUTE, MAX_KEYS_PER_MAP),
            invalid_bearers: BoundedBuckets::per_minute(
                INVALID_BEARER_PER_MINUTE,
                MAX_KEYS_PER_MAP,
            ),
            penalties: Penalties::default(),
            lookups: Semaphore::new(LOOKUP_CONCURRENCY),
            waiting: AtomicUsize::new(0),
        })
    }

    pub fn client(&self, headers: &HeaderMap) -> ClientKey {
        client_key(headers, self.trusted_proxy_hops)
    }

    /// Challenge and session: one bucket per client IP.
    pub fn admit_unauthenticated(&self, client: &ClientKey) -> Result<(), ApiError> {
        if self.unauthenticated.try_take(client) {
            Ok(())
        } else {
            Err(rate_limited("unauthenticated"))
        }
    }

    /// Before a session look-up: an IP that spent its forged-bearer budget waits it out (a
    /// refusal of the invalid-bearer bucket).
    pub fn check_bearer_penalty(&self, client: &ClientKey) -> Result<(), ApiError> {
        if self.penalties.is_penalised(client) {
            Err(rate_limited("invalid_bearer"))
        } else {
            Ok(())
        }
    }

    /// After a bearer was refused: charge the IP's budget. `Err(RateLimited)` once it is spent.
    pub fn charge_invalid_bearer(&self, client: ClientKey) -> Result<(), ApiError> {
        if self.invalid_bearers.try_take(&client) {
            Ok(())
        } else {
            self.penalties.penalise(client);
            Err(rate_limited("invalid_bearer"))
        }
    }

    /// After a bearer resolved: the host's own bucket.
    pub fn admit_host(&self, host_fingerprint: &str) -> Result<(), ApiError> {
        if self.hosts.try_take(&host_fingerprint.to_owned()) {
            Ok(())
        } else {
            Err(rate_limited("host"))
        }
    }

    /// Bounded admission to session look-ups: a permit now, a short bounded wait, or `busy`.
    pub async fn admit_lookup(&self) -> Result<SemaphorePermit<'_>, ApiError> {
        if let Ok(permit) = self.lookups.try_acquire() {
            return Ok(permit);
        }
        // Counted out on drop, so a request cancelled while waiting (client gone) frees its place.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let waiting = Waiting(&self.waiting);
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= LOOKUP_QUEUE {
            return Err(busy("lookup_queue_full"));
        }
        let permit = tokio::time::timeout(LOOKUP_WAIT, self.lookups.acquire()).await;
        drop(waiting);
        match permit {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(busy("lookup_wait_timeout")),
        }
    }

    /// Drops idle state; run on a timer so memory follows the live client set.
    pub fn sweep(&self) {
        self.unauthenticated.sweep();
        self.hosts.sweep();
        self.invalid_bearers.sweep();
        self.penalties.sweep();
    }

    /// Keys held across all maps, for tests and metrics.
    pub fn tracked_keys(&self) -> usize {
        self.unauthenticated.len()
            + self.hosts.len()
            + self.invalid_bearers.len()
            + self.penalties.until.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn ip(s: &str) -> ClientKey {
        ClientKey::Ip(s.parse().unwrap())
    }

    #[test]
    fn the_last_hop_is_the_client_with_no_trusted_proxies() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 1.2.3.4")]);
        assert_eq!(client_key(&h, 0), ip("1.2.3.4"));
        // Forged left-hand hops change nothing.
        let h = headers(&[("x-forwarded-for", "7.7.7.7, 8.8.8.8, 1.2.3.4")]);
        assert_eq!(client_key(&h, 0), ip("1.2.3.4"));
    }

    #[test]
    fn trusted_hops_skip_that_many_appenders() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 1.2.3.4, 10.0.0.1")]);
        assert_eq!(client_key(&h, 1), ip("1.2.3.4"));
        let h = headers(&[
            ("x-forwarded-for", "1.2.3.4"),
            ("x-forwarded-for", "10.0.0.1"),
        ]);
        assert_eq!(client_key(&h, 1), ip("1.2.3.4"));
    }

    #[test]
    fn a_header_shorter_than_the_trusted_depth_is_not_trusted() {
        let h = headers(&[("x-forwarded-for", "1.2.3.4"), ("x-real-ip", "5.5.5.5")]);
        assert_eq!(client_key(&h, 1), ClientKey::Shared);
    }

    #[test]
    fn a_header_that_is_not_visible_ascii_is_not_trusted() {
        let mut h = HeaderMap::new();
        h.append(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"\xff, 1.2.3.4").unwrap(),
        );
        h.append("x-real-ip", HeaderValue::from_static("5.5.5.5"));
        assert_eq!(
            client_key(&h, 0),
            ClientKey::Shared,
            "x-real-ip does not rescue it"
        );
        // Nor do the hops of another line.
        h.append("x-forwarded-for", HeaderValue::from_static("6.6.6.6"));
        assert_eq!(client_key(&h, 0), ClientKey::Shared);
    }

    /// A map full of live penalties is swept at most once per `SweepSpacing`: a flood at the cap
    /// must not make every refusal a scan of 100,000 keys.
    #[test]
    fn penalties_at_the_cap_are_swept_at_most_once_per_spacing() {
        let penalties = Penalties::default();
        let past = Instant::now() - Duration::from_secs(1);
        let fill = |from: u32| {
            for i in from..from + MAX_KEYS_PER_MAP as u32 {
                penalties
                    .until
                    .insert(ClientKey::Ip(std::net::Ipv4Addr::from(i).into()), past);
            }
        };
        fill(0);
        let first = ip("203.0.113.1");
        penalties.penalise(first);
        assert!(penalties.is_penalised(&first), "swept, then kept");
        fill(1 << 20);
        // As if that sweep had just run, whatever the fill took.
        *penalties.sweeps.last.lock().unwrap() = Some(Instant::now());
        let second = ip("203.0.113.2");
        penalties.penalise(second);
        assert!(
            !penalties.is_penalised(&second),
            "no second sweep within the spacing: the map stays full"
        );
    }

    #[test]
    fn x_real_ip_then_shared() {
        assert_eq!(
            client_key(&headers(&[("x-real-ip", "5.5.5.5")]), 0),
            ip("5.5.5.5")
        );
        assert_eq!(
            client_key(&headers(&[("x-real-ip", "junk")]), 0),
            ClientKey::Shared
        );
        assert_eq!(client_key(&headers(&[]), 0), ClientKey::Shared);
        assert_eq!(
            client_key(&headers(&[("x-forwarded-for", "[::1]:443")]), 0),
            ip("::")
        );
    }

    #[test]
    fn ipv6_clients_share_a_bucket_per_64_and_mapped_ipv4_is_ipv4() {
        let key = |v: &'static str| client_key(&headers(&[("x-forwarded-for", v)]), 0);
        assert_eq!(key("2001:db8:1:2::1"), ip("2001:db8:1:2::"));
        assert_eq!(
            key("2001:db8:1:2:ffff:ffff:ffff:ffff"),
            ip("2001:db8:1:2::")
        );
        assert_eq!(key("[2001:db8:1:2:aaaa::5]:443"), ip("2001:db8:1:2::"));
        assert_ne!(key("2001:db8:1:3::1"), key("2001:db8:1:2::1"));
        assert_eq!(key("::ffff:203.0.113.7"), ip("203.0.113.7"));
        assert_eq!(key("203.0.113.7"), ip("203.0.113.7"));
        assert_eq!(
            client_key(&headers(&[("x-real-ip", "2001:db8:9:9:1:2:3:4")]), 0),
            ip("2001:db8:9:9::")
        );
        // One /64 is one bucket however many addresses a flood rotates through.
        let limits = Limits::new(0);
        for i in 0..30u16 {
            let addr = IpAddr::from([0x2001, 0xdb8, 7, 7, i, i, i, i]);
            limits
                .admit_unauthenticated(&ClientKey::Ip(bucket_address(addr)))
                .unwrap();
        }
        let fresh = bucket_address(IpAddr::from([0x2001, 0xdb8, 7, 7, 99, 0, 0, 1]));
        assert_eq!(
            limits.admit_unauthenticated(&ClientKey::Ip(fresh)),
            Err(ApiError::RateLimited)
        );
        let neighbour = bucket_address(IpAddr::from([0x2001, 0xdb8, 7, 8, 0, 0, 0, 1]));
        limits
            .admit_unauthenticated(&ClientKey::Ip(neighbour))
            .unwrap();
    }

    #[test]
    fn thirty_per_minute_per_ip() {
        let limits = Limits::new(0);
        let a = ip("1.1.1.1");
        for _ in 0..30 {
            limits.admit_unauthenticated(&a).unwrap();
        }
        assert_eq!(limits.admit_unauthenticated(&a), Err(ApiError::RateLimited));
        limits.admit_unauthenticated(&ip("2.2.2.2")).unwrap();
    }

    #[tokio::test]
    async fn session_lookups_are_bounded_in_flight_and_in_waiting() {
        let limits = Limits::new(0);
        let mut held = Vec::new();
        for _ in 0..LOOKUP_CONCURRENCY {
            held.push(limits.admit_lookup().await.unwrap());
        }
        // The queue fills up with waiters; the next one is told `busy` at once.
        // Each waiter releases its permit as soon as it has it, as a finished look-up does.
        let waiters: Vec<_> = (0..LOOKUP_QUEUE)
            .map(|_| async { limits.admit_lookup().await.map(drop) })
            .collect();
        let waiting = futures::future::join_all(waiters);
        tokio::pin!(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert_eq!(limits.admit_lookup().await.err(), Some(ApiError::Busy));
        // Freed permits go to the waiters.
        drop(held);
        let admitted = waiting.await;
        assert!(admitted.iter().all(Result::is_ok));
    }

    #[tokio::test]
    async fn a_cancelled_waiter_frees_its_place_in_the_queue() {
        let limits = Limits::new(0);
        let _held: Vec<_> =
            futures::future::join_all((0..LOOKUP_CONCURRENCY).map(|_| limits.admit_lookup()))
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
        // A full queue of waiters whose clients all go away...
        for _ in 0..LOOKUP_QUEUE {
            let waiter = limits.admit_lookup();
            tokio::pin!(waiter);
            assert!(futures::poll!(waiter.as_mut()).is_pending());
        }
        // ...leaves no ghost behind: the next one waits rather than being told `busy` at once.
        let next = limits.admit_lookup();
        tokio::pin!(next);
        assert!(futures::poll!(next.as_mut()).is_pending());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gives_up_with_busy_after_the_bound() {
        let limits = Limits::new(0);
        let _held: Vec<_> =
            futures::future::join_all((0..LOOKUP_CONCURRENCY).map(|_| limits.admit_lookup()))
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
        let started = tokio::time::Instant::now();
        assert_eq!(limits.admit_lookup().await.err(), Some(ApiError::Busy));
        assert_eq!(
            started.elapsed(),
            LOOKUP_WAIT,
            "waited the bound, no more, no less"
        );
    }

    /// The value of `name{label="value"}` in what `recorder` renders now.
    fn counted(
        recorder: &metrics_exporter_prometheus::PrometheusRecorder,
        name: &str,
        label: (&str, &str),
    ) -> Option<f64> {
        let series = format!("{name}{{{}=\"{}\"}} ", label.0, label.1);
        recorder
            .handle()
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.parse().ok())
    }

    #[test]
    fn every_buckets_refusals_are_counted_under_its_name() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let _local = metrics::set_default_local_recorder(&recorder);
        let refusals = |bucket| {
            counted(
                &recorder,
                "orca_push_rate_limit_refusals_total",
                ("bucket", bucket),
            )
        };
        let limits = Limits::new(0);
        for bucket in RATE_LIMIT_BUCKETS {
            assert_eq!(
                refusals(bucket),
                Some(0.0),
                "{bucket} is there before any refusal"
            );
        }
        let a = ip("1.1.1.1");
        for _ in 0..UNAUTHENTICATED_PER_MINUTE {
            limits.admit_unauthenticated(&a).unwrap();
        }
        assert_eq!(limits.admit_unauthenticated(&a), Err(ApiError::RateLimited));
        assert_eq!(refusals("unauthenticated"), Some(1.0));

        for _ in 0..HOST_PER_MINUTE {
            limits.admit_host("host-a").unwrap();
        }
        assert_eq!(limits.admit_host("host-a"), Err(ApiError::RateLimited));
        assert_eq!(refusals("host"), Some(1.0));

        // The budget spent, and then the penalty it earned: both the invalid-bearer bucket's.
        for _ in 0..INVALID_BEARER_PER_MINUTE {
            limits.charge_invalid_bearer(a).unwrap();
        }
        assert_eq!(limits.charge_invalid_bearer(a), Err(ApiError::RateLimited));
        assert_eq!(limits.check_bearer_penalty(&a), Err(ApiError::RateLimited));
        assert_eq!(refusals("invalid_bearer"), Some(2.0));
        assert_eq!(refusals("unauthenticated"), Some(1.0));
        assert_eq!(refusals("host"), Some(1.0));
    }

    #[tokio::test(start_paused = true)]
    async fn every_busy_answer_is_counted_with_its_reason() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let _local = metrics::set_default_local_recorder(&recorder);
        let busy = |reason| {
            counted(
                &recorder,
                "orca_push_busy_refusals_total",
                ("reason", reason),
            )
        };
        let limits = Limits::new(0);
        assert_eq!(busy("lookup_queue_full"), Some(0.0));
        assert_eq!(busy("lookup_wait_timeout"), Some(0.0));
        let _held: Vec<_> =
            futures::future::join_all((0..LOOKUP_CONCURRENCY).map(|_| limits.admit_lookup()))
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
        // A waiter that never gets a permit gives up after the bound.
        assert_eq!(limits.admit_lookup().await.err(), Some(ApiError::Busy));
        assert_eq!(busy("lookup_wait_timeout"), Some(1.0));
        assert_eq!(busy("lookup_queue_full"), Some(0.0));
        // A full queue turns the next one away at once.
        let waiters = futures::future::join_all((0..LOOKUP_QUEUE).map(|_| limits.admit_lookup()));
        tokio::pin!(waiters);
        assert!(futures::poll!(waiters.as_mut()).is_pending());
        assert_eq!(limits.admit_lookup().await.err(), Some(ApiError::Busy));
        assert_eq!(busy("lookup_queue_full"), Some(1.0));
        assert_eq!(busy("lookup_wait_timeout"), Some(1.0));
    }

    #[test]
    fn a_million_distinct_ips_keep_the_maps_bounded() {
        let buckets = BoundedBuckets::<ClientKey>::per_minute(30, 10_000);
        for i in 0..1_000_000u32 {
            buckets.try_take(&ClientKey::Ip(IpAddr::from(i.to_be_bytes())));
            assert!(buckets.len() <= 10_000);
        }
    }
}
