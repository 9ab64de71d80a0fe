//! What sends resolved, kept in the facade, so a send to ids its host sent to before costs no call to
//! the registry. In split mode that call was some 115 µs of the facade's and the registry's CPU per
//! send, about a fifth of a send's CPU; in one process, where the registry's own cache answers the
//! call, skipping the in-process call still saved 6-8% of the gateway's CPU per send on SQLite
//! (docs/benchmarks.md, round 29).
//!
//! The facade follows the registry's `WatchDevices` stream, under the rules of
//! [`orca_push_registry::watched`] (served while the watch's heartbeat is heard, never a read that
//! raced a change, at most [`TRUST_FOR`], news from several replicas left to settle for
//! [`CHANGE_SETTLES_IN`]). A register or delete through this facade drops its host as the registry
//! answers, before the host hears back.
//!
//! Only ids the host owns are kept (a host owns at most 64): a send naming another id asks the
//! registry. It holds no push token (a resolve carries none) and logs no host.

use std::future::Future;
use std::sync::Arc;

use orca_push_proto::registry::v1 as pb;
use orca_push_registry::watched::{RegistryClient, WatchedHosts};
use tokio_util::sync::CancellationToken;

pub use orca_push_registry::watched::{CHANGE_SETTLES_IN, TRUST_FOR, WATCH_SILENCE};

/// Hosts kept at most; when full, the cache starts again empty.
pub const MAX_CACHED_HOSTS: usize = 50_000;
/// What the kept answers may take (ids, hosts and a share of the maps); past it the cache starts
/// again empty.
pub const MAX_CACHED_BYTES: usize = 16 << 20;
/// What a kept id takes besides its text: its answer and its place in the map (an estimate; it only
/// bounds the cache).
const ID_OVERHEAD: usize = 64;

/// What an id resolved to, when the host owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owned {
    platform: i32,
    dead: bool,
}

/// The resolves this facade kept, and what it knows of the registry's device watch.
pub struct ResolvedHosts {
    hosts: Arc<WatchedHosts<Owned>>,
}

impl Default for ResolvedHosts {
    fn default() -> Self {
        Self::with_limits(MAX_CACHED_HOSTS, MAX_CACHED_BYTES)
    }
}

impl ResolvedHosts {
    pub fn with_limits(max_hosts: usize, max_bytes: usize) -> Self {
        Self {
            hosts: Arc::new(WatchedHosts::with_limits("facade", max_hosts, max_bytes)),
        }
    }

    /// A new stream opened: nothing kept before it is served.
    pub fn opened(&self) {
        self.hosts.opened();
    }

    /// The stream ended: nothing is served until another opens and is heard from.
    pub fn closed(&self) {
        self.hosts.closed();
    }

    /// News from the stream (see [`WatchedHosts::heard`]).
    pub fn heard(&self, event: &pb::DeviceEvent) {
        self.hosts.heard(event);
    }

    /// What `host` resolves to may have changed: its entry goes, and reads under way, or begun
    /// within [`CHANGE_SETTLES_IN`], are not kept.
    pub fn changed(&self, host: &str) {
        self.hosts.changed(host);
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
        let began = self.hosts.begin();
        if let Some(began) = &began {
            let asked: Vec<&str> = ids.iter().map(String::as_str).collect();
            if let Some(owned) = self.hosts.answer(host, &asked, began) {
                metrics::counter!("orca_push_facade_resolves_total", "source" => "memory")
                    .increment(1);
                tracing::Span::current().record("orca.resolve.source", "memory");
                return Ok(ids
                    .iter()
                    .zip(owned)
                    .map(|(id, owned)| pb::ResolvedRegistration {
                        registration_id: id.clone(),
                        platform: owned.platform,
                        dead: owned.dead,
                    })
                    .collect());
            }
        }
        metrics::counter!("orca_push_facade_resolves_total", "source" => "registry").increment(1);
        tracing::Span::current().record("orca.resolve.source", "registry");
        let registrations = read().await?;
        if let Some(began) = &began {
            // Only what the host owns: the registry answers only ids asked, and a host owns at
            // most 64.
            let owned = registrations
                .iter()
                .filter(|r| ids.contains(&r.registration_id))
                .map(|r| {
                    let owned = Owned {
                        platform: r.platform,
                        dead: r.dead,
                    };
                    (r.registration_id.clone(), owned, ID_OVERHEAD)
                });
            self.hosts.keep(host, began, owned);
        }
        Ok(registrations)
    }

    /// Drops entries no longer served.
    pub fn sweep(&self) {
        self.hosts.sweep();
    }

    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Follows the registry's device watch until `shutdown` (see [`WatchedHosts::follow`]);
    /// meanwhile every send asks the registry.
    pub async fn follow(self: Arc<Self>, registry: RegistryClient, shutdown: CancellationToken) {
        self.hosts.clone().follow(registry, shutdown).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

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
        // Nor is an id the registry answered for beside those asked.
        resolve(
            &cache,
            "h",
            &["d"],
            vec![owned("d", false), owned("e", false)],
            &reads,
        )
        .await;
        resolve(&cache, "h", &["e"], vec![owned("e", false)], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 5);
        // A host that owns none of what it asked for is not kept at all.
        resolve(&cache, "g", &["x"], vec![], &reads).await;
        assert_eq!(cache.len(), 1);
    }

    #[tokio::test]
    async fn a_change_heard_or_made_here_drops_its_host_only() {
        let cache = watched();
        let reads = AtomicU64::new(0);
        resolve(&cache, "h", &["a"], vec![owned("a", false)], &reads).await;
        resolve(&cache, "g", &["c"], vec![owned("c", false)], &reads).await;
        cache.heard(&change("h"));
        resolve(&cache, "g", &["c"], vec![], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        let now = resolve(&cache, "h", &["a"], vec![owned("a", true)], &reads).await;
        assert_eq!(now, vec![owned("a", true)]);
        assert_eq!(reads.load(Ordering::SeqCst), 3);
        // A change made through this facade drops the host as well.
        cache.changed("g");
        resolve(&cache, "g", &["c"], vec![owned("c", false)], &reads).await;
        assert_eq!(reads.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_read_that_raced_a_change_is_not_kept() {
        let cache = watched();
        let reads = AtomicU64::new(0);
        let stale = cache
            .resolve("h", &ids(&["a"]), || async {
                // News of a write arrives while the registry answers.
                cache.heard(&change("g"));
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
    async fn the_cache_is_bounded_by_hosts() {
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
    }
}
