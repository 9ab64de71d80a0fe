//! What sends resolved, kept in the facade, so a send to ids its host sent to before costs no call to
//! the registry. In split mode that call was some 115 µs of the facade's and the registry's CPU per
//! send, about a fifth of a send's CPU; in one process, where the registry's own cache answers the
//! call, skipping the in-process call still saved 6-8% of the gateway's CPU per send on SQLite
//! (docs/benchmarks.md, round 29).
//!
//! The facade follows the registry's `WatchDevices` stream: a host whose registrations change is
//! dropped as the news arrives, and entries are served only while the stream's heartbeat was heard
//! within [`WATCH_SILENCE`] (the registry sends one every 200 ms, after every change it relayed
//! before), and only those read under the stream open now. A read that raced a change is never
//! kept: every change bumps a generation, and a read is kept only if none arrived since it began.
//! A register or delete through this facade drops its host as the registry answers, before the host
//! hears back.
//!
//! With several registry replicas, a resolve may be answered by one that has not heard a write yet,
//! after the news of it reached this facade through another. So a read of a host that began within
//! [`CHANGE_SETTLES_IN`] of news of it is not kept, and an entry is served for at most
//! [`TRUST_FOR`] whatever happens.
//!
//! Only ids the host owns are kept (a host owns at most 64): a send naming another id asks the
//! registry. It holds no push token (a resolve carries none) and logs no host.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use orca_push_proto::registry::v1 as pb;
use tokio_util::sync::CancellationToken;

/// How long a kept answer is served at most (see the module's documentation).
pub const TRUST_FOR: Duration = Duration::from_secs(10);
/// Entries are served only while the watch's heartbeat was heard this recently.
pub const WATCH_SILENCE: Duration = Duration::from_millis(600);
/// How long to wait before opening the watch again after it ended or was refused.
const WATCH_RETRY: Duration = Duration::from_secs(1);
/// How long to wait before asking again a registry that does not offer the watch.
const WATCH_UNOFFERED_RETRY: Duration = Duration::from_secs(60);
/// How often entries past [`TRUST_FOR`] are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// Hosts kept at most; when full, the cache starts again empty.
pub const MAX_CACHED_HOSTS: usize = 50_000;
/// What the kept answers may take (ids, hosts and a share of the maps); past it the cache starts
/// again empty.
pub const MAX_CACHED_BYTES: usize = 16 << 20;
/// A read of a host that began this soon after news of a change to it is not kept: another registry
/// replica may not have heard the change yet (relays take milliseconds).
pub const CHANGE_SETTLES_IN: Duration = Duration::from_secs(1);
/// What a kept id takes besides its text: its answer and its place in the map (an estimate; it only
/// bounds the cache).
const ID_OVERHEAD: usize = 64;

type RegistryClient =
    pb::registry_service_client::RegistryServiceClient<orca_push_internal_auth::InternalChannel>;

/// What an id resolved to, when the host owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owned {
    platform: i32,
    dead: bool,
}

struct HostEntry {
    /// The host's ids asked for, and what each resolved to.
    ids: HashMap<String, Owned>,
    /// When the oldest read in it began.
    read_at: Instant,
    /// The watch stream it was read under.
    stream: u64,
    bytes: usize,
}

impl HostEntry {
    fn fresh(&self, stream: u64) -> bool {
        self.stream == stream && self.read_at.elapsed() < TRUST_FOR
    }
}

#[derive(Default)]
struct Kept {
    hosts: HashMap<String, HostEntry>,
    bytes: usize,
    /// When news of a change to each host last arrived (for [`CHANGE_SETTLES_IN`]).
    changed_at: HashMap<String, Instant>,
}

impl Kept {
    fn clear(&mut self) {
        self.hosts.clear();
        self.bytes = 0;
    }

    /// Whether news of a change to `host` arrived less than [`CHANGE_SETTLES_IN`] before `read_at`
    /// (or after it).
    fn settling(&self, host: &str, read_at: Instant) -> bool {
        self.changed_at
            .get(host)
            .is_some_and(|at| read_at.saturating_duration_since(*at) < CHANGE_SETTLES_IN)
    }

    fn remove(&mut self, host: &str) {
        if let Some(entry) = self.hosts.remove(host) {
            self.bytes = self.bytes.saturating_sub(entry.bytes);
        }
    }
}

/// The resolves this facade kept, and what it knows of the registry's device watch.
pub struct ResolvedHosts {
    kept: Mutex<Kept>,
    /// Bumped by every change heard, before its host is dropped.
    generation: AtomicU64,
    /// Which stream is open (0: none yet); every new stream takes the next number.
    stream: AtomicU64,
    /// When it was last heard from, in nanoseconds after `epoch` (0: not since it opened).
    heard_at: AtomicU64,
    epoch: Instant,
    max_hosts: usize,
    max_bytes: usize,
}

impl Default for ResolvedHosts {
    fn default() -> Self {
        Self::with_limits(MAX_CACHED_HOSTS, MAX_CACHED_BYTES)
    }
}

impl ResolvedHosts {
    pub fn with_limits(max_hosts: usize, max_bytes: usize) -> Self {
        Self {
            kept: Mutex::default(),
            generation: AtomicU64::new(0),
            stream: AtomicU64::new(0),
            heard_at: AtomicU64::new(0),
            epoch: Instant::now(),
            max_hosts,
            max_bytes,
        }
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        // No code that can panic runs between a change to the map and to its byte count.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn nanos(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// The stream that vouches now, if one does.
    fn live(&self) -> Option<u64> {
        let stream = self.stream.load(Ordering::SeqCst);
        let heard = self.heard_at.load(Ordering::SeqCst);
        let silence = u64::try_from(WATCH_SILENCE.as_nanos()).unwrap_or(u64::MAX);
        (stream != 0 && heard != 0 && self.nanos().saturating_sub(heard) < silence)
            .then_some(stream)
    }

    /// A new stream opened: nothing kept before it is served.
    pub fn opened(&self) {
        self.heard_at.store(0, Ordering::SeqCst);
        self.stream.fetch_add(1, Ordering::SeqCst);
        self.kept().clear();
    }

    /// The stream ended: nothing is served until another opens and is heard from.
    pub fn closed(&self) {
        self.heard_at.store(0, Ordering::SeqCst);
        self.kept().clear();
    }

    /// News from the stream: a heartbeat, or a host whose registrations changed. Only a heartbeat
    /// proves the stream current: the registry tells its own writes at once, whether or not its
    /// relay of the other replicas' still works.
    pub fn heard(&self, event: &pb::DeviceEvent) {
        if event.changed_host_fingerprint.is_empty() {
            self.heard_at.store(self.nanos(), Ordering::SeqCst);
        } else {
            self.changed(&event.changed_host_fingerprint);
        }
    }

    /// What `host` resolves to may have changed: its entry goes, and reads under way, or begun
    /// within [`CHANGE_SETTLES_IN`], are not kept.
    pub fn changed(&self, host: &str) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        let mut kept = self.kept();
        kept.remove(host);
        if kept.changed_at.len() >= self.max_hosts {
            kept.changed_at
                .retain(|_, at| at.elapsed() < CHANGE_SETTLES_IN);
        }
        kept.changed_at.insert(host.to_owned(), Instant::now());
    }

    /// What `ids` of `host` resolve to: kept answers while the watch vouches for them, else
    /// `read`'s, which are kept if no change was heard while it ran.
    pub async fn resolve<F, Fut, E>(
        &self,
        host: &str,
        ids: &[String],
        read: F,
    ) -> Result<Vec<pb::ResolvedRegistration>, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<pb::ResolvedRegistration>, E>>,
    {
        let live = self.live();
        if let Some(stream) = live
            && let Some(answer) = self.answer(host, ids, stream)
        {
            metrics::counter!("orca_push_facade_resolves_total", "source" => "memory").increment(1);
            tracing::Span::current().record("orca.resolve.source", "memory");
            return Ok(answer);
        }
        metrics::counter!("orca_push_facade_resolves_total", "source" => "registry").increment(1);
        tracing::Span::current().record("orca.resolve.source", "registry");
        let began = self.generation.load(Ordering::SeqCst);
        let read_at = Instant::now();
        let registrations = read().await?;
        if let Some(stream) = live {
            self.keep(host, ids, &registrations, stream, began, read_at);
        }
        Ok(registrations)
    }

    /// The kept answer for every one of `ids`, or `None` if any is not kept.
    fn answer(
        &self,
        host: &str,
        ids: &[String],
        stream: u64,
    ) -> Option<Vec<pb::ResolvedRegistration>> {
        let kept = self.kept();
        let entry = kept.hosts.get(host).filter(|e| e.fresh(stream))?;
        ids.iter()
            .map(|id| {
                let owned = entry.ids.get(id)?;
                Some(pb::ResolvedRegistration {
                    registration_id: id.clone(),
                    platform: owned.platform,
                    dead: owned.dead,
                })
            })
            .collect()
    }

    fn keep(
        &self,
        host: &str,
        ids: &[String],
        registrations: &[pb::ResolvedRegistration],
        stream: u64,
        began: u64,
        read_at: Instant,
    ) {
        let mut kept = self.kept();
        // Checked under the lock that `changed` takes after bumping: a change heard after this read
        // began either shows here or drops the entry after it is inserted.
        if self.generation.load(Ordering::SeqCst) != began
            || self.stream.load(Ordering::SeqCst) != stream
            || kept.settling(host, read_at)
        {
            return;
        }
        let kept = &mut *kept;
        let mut entry = match kept.hosts.remove(host) {
            // Both reads hold: no change to the host was heard since the older began.
            Some(older) if older.fresh(stream) => {
                kept.bytes = kept.bytes.saturating_sub(older.bytes);
                older
            }
            older => {
                if let Some(older) = older {
                    kept.bytes = kept.bytes.saturating_sub(older.bytes);
                }
                HostEntry {
                    ids: HashMap::with_capacity(registrations.len()),
                    read_at,
                    stream,
                    bytes: host.len() + ID_OVERHEAD,
                }
            }
        };
        // Only what the host owns: the registry answers only ids asked, and a host owns at most 64.
        for r in registrations
            .iter()
            .filter(|r| ids.contains(&r.registration_id))
        {
            let owned = Owned {
                platform: r.platform,
                dead: r.dead,
            };
            if entry.ids.insert(r.registration_id.clone(), owned).is_none() {
                entry.bytes += r.registration_id.len() + ID_OVERHEAD;
            }
        }
        if entry.ids.is_empty() {
            return;
        }
        if kept.hosts.len() >= self.max_hosts || kept.bytes + entry.bytes > self.max_bytes {
            kept.clear();
        }
        if entry.bytes <= self.max_bytes {
            kept.bytes += entry.bytes;
            kept.hosts.insert(host.to_owned(), entry);
        }
    }

    /// Drops entries no longer served.
    pub fn sweep(&self) {
        let mut kept = self.kept();
        let stream = self.stream.load(Ordering::SeqCst);
        kept.hosts.retain(|_, entry| entry.fresh(stream));
        kept.bytes = kept.hosts.values().map(|e| e.bytes).sum();
        kept.hosts.shrink_to_fit();
        kept.changed_at
            .retain(|_, at| at.elapsed() < CHANGE_SETTLES_IN);
        kept.changed_at.shrink_to_fit();
    }

    pub fn len(&self) -> usize {
        self.kept().hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Follows the registry's device watch until `shutdown`, opening it again whenever it ends,
    /// and sweeps now and then. A registry that does not offer it (an older one) is asked again
    /// each minute; meanwhile every send asks the registry.
    pub async fn follow(self: Arc<Self>, registry: RegistryClient, shutdown: CancellationToken) {
        use futures::StreamExt as _;
        let mut sweeps = tokio::time::interval(SWEEP_EVERY);
        loop {
            let mut client = registry.clone();
            let opened = tokio::select! {
                () = shutdown.cancelled() => return,
                opened = client.watch_devices(pb::WatchDevicesRequest {}) => opened,
            };
            let wait = match opened {
                Ok(response) => {
                    let mut events = response.into_inner();
                    self.opened();
                    tracing::debug!("following the registry's device watch");
                    let ended = loop {
                        tokio::select! {
                            () = shutdown.cancelled() => {
                                self.closed();
                                return;
                            }
                            _ = sweeps.tick() => self.sweep(),
                            event = events.next() => match event {
                                Some(Ok(event)) => self.heard(&event),
                                Some(Err(status)) => break Some(status),
                                None => break None,
                            },
                        }
                    };
                    self.closed();
                    if let Some(status) = ended {
                        tracing::info!(code = ?status.code(), "the registry's device watch ended; opening it again");
                    }
                    WATCH_RETRY
                }
                Err(status) if status.code() == tonic::Code::Unimplemented => {
                    tracing::info!("the registry offers no device watch: every send asks it");
                    WATCH_UNOFFERED_RETRY
                }
                Err(status) => {
                    tracing::info!(code = ?status.code(), "the registry's device watch not opened; retrying");
                    WATCH_RETRY
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(id: &str, dead: bool) -> pb::ResolvedRegistration {
        pb::ResolvedRegistration {
            registration_id: id.to_owned(),
            platform: pb::Platform::Android as i32,
            dead,
        }
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    fn heartbeat() -> pb::DeviceEvent {
        pb::DeviceEvent::default()
    }

    fn change(host: &str) -> pb::DeviceEvent {
        pb::DeviceEvent {
            changed_host_fingerprint: host.to_owned(),
        }
    }

    fn watched() -> ResolvedHosts {
        let cache = ResolvedHosts::default();
        cache.opened();
        cache.heard(&heartbeat());
        cache
    }

    /// As if news of `host` had arrived longer ago than it takes a change to settle.
    fn settled(cache: &ResolvedHosts, host: &str) {
        let long_ago = Instant::now().checked_sub(CHANGE_SETTLES_IN * 2);
        let mut kept = cache.kept();
        match long_ago {
            Some(at) => {
                kept.changed_at.insert(host.to_owned(), at);
            }
            None => {
                kept.changed_at.remove(host);
            }
        }
    }

    /// Resolves through the cache, counting the reads it makes.
    async fn resolve(
        cache: &ResolvedHosts,
        host: &str,
        asked: &[&str],
        answer: Vec<pb::ResolvedRegistration>,
        reads: &AtomicU64,
    ) -> Vec<pb::ResolvedRegistration> {
        cache
            .resolve(host, &ids(asked), || async {
                reads.fetch_add(1, Ordering::SeqCst);
                Ok::<_, ()>(answer)
            })
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_watched_answer_is_kept_for_the_ids_the_host_owns() {
        let cache = watched();
        let reads = AtomicU64::new(0);
        let first = resolve(&cache, "h", &["a", "b"], vec![owned("a", false)], &reads).await;
        assert_eq!(first, vec![owned("a", false)]);
        // Answered from memory, in the order asked.
        resolve(&cache, "h", &["c"], vec![owned("c", true)], &reads).await;
        let both = resolve(&cache, "h", &["c", "a"], vec![], &reads).await;
        assert_eq!(both, vec![owned("c", true), owned("a", false)]);
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        // An id the host does not own is not kept: asking for it asks the registry.
        let with_b = resolve(&cache, "h", &["a", "b"], vec![owned("a", false)], &reads).await;
        assert_eq!(with_b, vec![owned("a", false)]);
        assert_eq!(reads.load(Ordering::SeqCst), 3);
        // A host that owns none of what it asked for is not kept at all.
        resolve(&cache, "g", &["x"], vec![], &reads).await;
        assert!(!cache.kept().hosts.contains_key("g"));
    }

    #[tokio::test]
    async fn a_change_heard_drops_its_host_only_and_settles_before_it_is_kept_again() {
        let cache = watched();
        let reads = AtomicU64::new(0);
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        resolve(&cache, "g", &["c"], vec![owned("c", false)], &reads).await;
        cache.heard(&change("h"));
        resolve(&cache, "g", &["c"], vec![], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        // Read, but not kept while another replica may not have heard the change.
        for _ in 0..2 {
            let now = resolve(&cache, "h", &["a"], vec![owned("a", true)], &reads).await;
            assert_eq!(now, vec![owned("a", true)]);
        }
        assert_eq!(reads.load(Ordering::SeqCst), 4);
        settled(&cache, "h");
        resolve(&cache, "h", &["a"], vec![owned("a", true)], &reads).await;
        resolve(&cache, "h", &["a"], vec![], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 5);
        // A change made through this facade drops the host as well.
        cache.changed("h");
        resolve(&cache, "h", &["a"], vec![owned("a", true)], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 6);
    }

    #[tokio::test]
    async fn a_read_that_raced_a_change_is_not_kept() {
        let cache = watched();
        let reads = AtomicU64::new(0);
        let stale = cache
            .resolve("h", &ids(&["a"]), || async {
                // The registry answered from before the write; its news arrives meanwhile.
                cache.heard(&change("h"));
                settled(&cache, "h");
                Ok::<_, ()>(vec![owned("a", false)])
            })
            .await
            .unwrap();
        assert_eq!(stale, vec![owned("a", false)]);
        let fresh = resolve(&cache, "h", &["a"], vec![owned("a", true)], &reads).await;
        assert_eq!(fresh, vec![owned("a", true)]);
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn nothing_is_kept_or_served_without_a_live_watch() {
        let cache = ResolvedHosts::default();
        let reads = AtomicU64::new(0);
        // Never opened.
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        assert!(cache.is_empty());
        // Opened but no heartbeat yet; news of a change is not one.
        cache.opened();
        cache.heard(&change("g"));
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 3);
        // Heard: kept. Closed: not served, and a new stream does not serve the old one's entries.
        cache.heard(&heartbeat());
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        resolve(&cache, "h", &["a"], vec![], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 4);
        cache.closed();
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        cache.opened();
        cache.heard(&heartbeat());
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 6);
    }

    #[tokio::test]
    async fn a_watch_whose_heartbeats_stop_vouches_for_nothing() {
        let cache = watched();
        let reads = AtomicU64::new(0);
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        std::thread::sleep(WATCH_SILENCE);
        // The registry's own writes still come through, but prove nothing of its relay.
        cache.heard(&change("g"));
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        cache.heard(&heartbeat());
        resolve(&cache, "h", &["a"], vec![], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn an_entry_is_served_for_trust_for_at_most() {
        let Some(long_ago) = Instant::now().checked_sub(TRUST_FOR) else {
            return;
        };
        let entry = HostEntry {
            ids: HashMap::new(),
            read_at: long_ago,
            stream: 1,
            bytes: 0,
        };
        assert!(!entry.fresh(1));
        let entry = HostEntry {
            read_at: Instant::now(),
            ..entry
        };
        assert!(entry.fresh(1));
        assert!(!entry.fresh(2));
    }

    #[tokio::test]
    async fn the_cache_is_bounded_by_hosts_and_bytes() {
        let reads = AtomicU64::new(0);
        let cache = ResolvedHosts::with_limits(2, MAX_CACHED_BYTES);
        cache.opened();
        cache.heard(&heartbeat());
        for host in ["h1", "h2", "h3"] {
            resolve(&cache, host, &["a"], vec![owned("a", false)], &reads).await;
        }
        assert_eq!(
            cache.len(),
            1,
            "full at two hosts: started again with the third"
        );
        let cache = ResolvedHosts::with_limits(100, 200);
        cache.opened();
        cache.heard(&heartbeat());
        for host in ["h", "g", "f"] {
            resolve(&cache, host, &["a"], vec![owned("a", false)], &reads).await;
            let kept = cache.kept();
            assert!(kept.bytes <= 200, "{}", kept.bytes);
            assert_eq!(
                kept.bytes,
                kept.hosts.values().map(|e| e.bytes).sum::<usize>()
            );
        }
    }
}
