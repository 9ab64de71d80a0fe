//! The registrations of recently seen hosts, as a send resolves them, kept in memory so a send costs
//! no database read here. Only for a store this process alone writes (SQLite: one process owns the
//! file): every write that can change what a host resolves to goes through this process's store,
//! which calls [`ResolveCache::invalidate`] after it commits. PostgreSQL replicas share their
//! table, so they never cache.
//!
//! A read that raced a write is never kept: every write bumps a generation after its commit, and a
//! read is kept only if no write committed since the read began. Kept entries are exact, not merely
//! fresh, so they need no expiry; the cap only bounds memory.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::store::ResolvedRow;

/// Hosts kept at most; when full, the cache starts again empty (a host costs about 200 bytes).
pub const MAX_CACHED_HOSTS: usize = 50_000;

/// Every registration of one host: id, platform and whether it is dead.
pub type HostRegistrations = Arc<[ResolvedRow]>;

#[derive(Debug)]
pub struct ResolveCache {
    hosts: Mutex<HashMap<String, HostRegistrations>>,
    /// Bumped after every committed write, before its host is dropped.
    generation: AtomicU64,
    max_hosts: usize,
}

impl Default for ResolveCache {
    fn default() -> Self {
        Self::with_capacity(MAX_CACHED_HOSTS)
    }
}

impl ResolveCache {
    pub fn with_capacity(max_hosts: usize) -> Self {
        Self {
            hosts: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            max_hosts,
        }
    }

    fn hosts(&self) -> MutexGuard<'_, HashMap<String, HostRegistrations>> {
        // A panic while holding the lock leaves a map that is still consistent: keep using it.
        self.hosts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host's registrations: kept ones, or `read`'s, which are kept if no write committed
    /// while it ran.
    pub async fn host<F, Fut, E>(&self, host: &str, read: F) -> Result<HostRegistrations, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<ResolvedRow>, E>>,
    {
        if let Some(kept) = self.hosts().get(host) {
            metrics::counter!("orca_push_registry_resolves_total", "source" => "memory")
                .increment(1);
            return Ok(kept.clone());
        }
        metrics::counter!("orca_push_registry_resolves_total", "source" => "database").increment(1);
        let began = self.generation.load(Ordering::SeqCst);
        let rows: HostRegistrations = read().await?.into();
        let mut hosts = self.hosts();
        // Checked under the lock that `invalidate` takes after bumping: a write that committed
        // after this read began either shows here or drops the entry after it is inserted.
        if self.generation.load(Ordering::SeqCst) == began {
            if hosts.len() >= self.max_hosts {
                hosts.clear();
            }
            hosts.insert(host.to_owned(), rows.clone());
        }
        Ok(rows)
    }

    /// Called after a write that may change what `host` resolves to has committed.
    pub fn invalidate(&self, host: &str) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.hosts().remove(host);
    }

    pub fn len(&self) -> usize {
        self.hosts().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Platform;

    fn row(id: &str, dead: bool) -> ResolvedRow {
        ResolvedRow {
            registration_id: id.to_owned(),
            platform: Platform::Android,
            dead,
        }
    }

    async fn read_ok(rows: Vec<ResolvedRow>) -> Result<Vec<ResolvedRow>, ()> {
        Ok(rows)
    }

    #[tokio::test]
    async fn a_host_is_read_once_until_a_write_drops_it() {
        let cache = ResolveCache::default();
        let reads = std::sync::atomic::AtomicUsize::new(0);
        let read = || {
            reads.fetch_add(1, Ordering::SeqCst);
            read_ok(vec![row("a", false)])
        };
        cache.host("h", read).await.unwrap();
        let kept = cache.host("h", read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        assert_eq!(&kept[..], &[row("a", false)]);

        cache.invalidate("h");
        cache.host("h", read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_read_that_raced_a_write_is_answered_but_not_kept() {
        let cache = ResolveCache::default();
        // The write commits (and invalidates) while the read is in flight: what the read saw may
        // predate it.
        let answered = cache
            .host("h", || async {
                cache.invalidate("h");
                Ok::<_, ()>(vec![row("a", false)])
            })
            .await
            .unwrap();
        assert_eq!(answered.len(), 1);
        assert!(cache.is_empty(), "a raced read must not be kept");

        let fresh = cache
            .host("h", || read_ok(vec![row("a", true)]))
            .await
            .unwrap();
        assert!(fresh[0].dead);
        assert_eq!(cache.len(), 1);
    }

    #[tokio::test]
    async fn a_write_to_another_host_drops_only_that_host() {
        let cache = ResolveCache::default();
        cache
            .host("h", || read_ok(vec![row("a", false)]))
            .await
            .unwrap();
        cache
            .host("g", || read_ok(vec![row("b", false)]))
            .await
            .unwrap();
        cache.invalidate("g");
        assert_eq!(cache.len(), 1);
        let kept = cache.host("h", || read_ok(Vec::new())).await.unwrap();
        assert_eq!(kept.len(), 1, "h was kept");
    }

    #[tokio::test]
    async fn a_failed_read_is_not_kept() {
        let cache = ResolveCache::default();
        let failed = cache
            .host("h", || async { Err::<Vec<ResolvedRow>, _>("down") })
            .await;
        assert_eq!(failed.unwrap_err(), "down");
        assert!(cache.is_empty());
    }

    #[tokio::test]
    async fn the_cache_never_holds_more_than_its_cap() {
        let cache = ResolveCache::with_capacity(3);
        for host in ["a", "b", "c", "d", "e"] {
            cache.host(host, || read_ok(Vec::new())).await.unwrap();
            assert!(cache.len() <= 3);
        }
    }
}
