//! The registrations of recently seen hosts, as a send resolves them, kept in memory so a send costs
//! no database read here.
//!
//! - **Exact** (SQLite: one process owns the file): every write that can change what a host resolves
//!   to goes through this process's store, which calls [`ResolveCache::invalidate`] after it
//!   commits.
//! - **Relayed** (PostgreSQL: replicas share the table): every replica's write announces its host
//!   with `pg_notify` in its transaction, and each replica's relay (`relay`) invalidates on
//!   receipt. Heartbeats through the same channel prove the relay hears everything committed up to
//!   about then: entries are served only while it was heard within [`RELAY_SILENCE`], and only
//!   those read under the relay's current connection (a reconnection may have lost
//!   announcements). Otherwise every resolve reads the database, as without a cache.
//!
//! A read that raced a write is never kept: every invalidation bumps a generation, and a read is
//! kept only if none happened since the read began. Kept entries are exact, not merely fresh, so
//! they need no expiry; the cap only bounds memory.
//!
//! What drops an entry is also told to `WatchDevices` watchers (the facade of a split deployment
//! keeps what sends resolved, and drops a host as this cache does): [`DeviceNews`], with a
//! heartbeat an exact cache's owner sends on a timer ([`ResolveCache::exact_heartbeat`]) and a
//! relayed cache passes on from its relay.
//!
//! Each entry holds its registrations as a delivery needs them (token and APNs environment
//! included), and each registration names its host, so a lane's look-up of the phones of a claim
//! (`deliveries`) is answered here too for every host a send has resolved, under the same rules:
//! at 100 end-to-end flows that read was a thread hop per claim and some 5% of the gateway's
//! samples (round 23 in docs/benchmarks.md).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::store::DeliveryRow;

/// Hosts kept at most; when full, the cache starts again empty.
pub const MAX_CACHED_HOSTS: usize = 50_000;
/// What the kept rows may take (their ids, hosts and tokens, and a share of the maps); past it the
/// cache starts again empty. A host with two phones takes about 1 KB, so this holds some 30,000
/// such hosts; a host may register 64 phones with tokens of up to 4 KiB, and a count of hosts
/// alone would let hosts made for the purpose hold gigabytes.
pub const MAX_CACHED_BYTES: usize = 32 << 20;
/// What a kept row takes besides its strings: the row, its strings' headers, its place in the two
/// maps (an estimate; it only bounds the cache).
const ROW_OVERHEAD: usize = 160;
/// A relayed cache serves entries only while its relay was heard this recently (heartbeats come
/// about every 200 ms).
pub const RELAY_SILENCE: std::time::Duration = std::time::Duration::from_millis(600);

/// Device news a watcher may fall behind by before it is cut off (it then trusts nothing it kept
/// under that stream).
pub const WATCH_BACKLOG: usize = 4096;

/// What a `WatchDevices` watcher hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceNews {
    /// What the host resolves to may have changed.
    Changed(String),
    /// Every write committed before this was announced.
    Heard,
    /// Announcements may have been lost: nothing kept under the watch may be served still.
    Lost,
}

/// Every registration of one host, as a delivery needs it.
pub type HostRegistrations = Arc<[DeliveryRow]>;

#[derive(Debug)]
pub struct ResolveCache {
    kept: Mutex<Kept>,
    /// Bumped by every invalidation, before its host is dropped.
    generation: AtomicU64,
    max_hosts: usize,
    max_bytes: usize,
    /// `None`: exact. Otherwise what the relay has been heard of.
    relay: Option<Relay>,
    /// What `WatchDevices` watchers are told.
    news: tokio::sync::broadcast::Sender<DeviceNews>,
}

/// The kept hosts, and the host of each of their registrations.
#[derive(Default)]
struct Kept {
    hosts: HashMap<String, Host>,
    registrations: HashMap<String, String>,
    /// What the kept hosts' rows take (`Host::bytes`).
    bytes: usize,
}

/// Counts only: the rows hold push tokens, which no log may carry.
impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept")
            .field("hosts", &self.hosts.len())
            .field("registrations", &self.registrations.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

#[derive(Clone)]
struct Host {
    rows: HostRegistrations,
    /// The relay connection it was read under (0 for an exact cache).
    connection: u64,
    /// What its rows take, as `MAX_CACHED_BYTES` counts.
    bytes: usize,
}

impl Host {
    fn new(host: &str, rows: HostRegistrations, connection: u64) -> Self {
        let bytes = host.len()
            + rows
                .iter()
                .map(|r| {
                    ROW_OVERHEAD + 2 * r.registration_id.len() + 2 * host.len() + r.token.len()
                })
                .sum::<usize>();
        Self {
            rows,
            connection,
            bytes,
        }
    }
}

impl Kept {
    fn clear(&mut self) {
        self.hosts.clear();
        self.registrations.clear();
        self.bytes = 0;
    }

    fn insert(&mut self, host: &str, entry: Host) {
        for row in entry.rows.iter() {
            self.registrations
                .insert(row.registration_id.clone(), host.to_owned());
        }
        self.bytes += entry.bytes;
        if let Some(replaced) = self.hosts.insert(host.to_owned(), entry) {
            self.bytes = self.bytes.saturating_sub(replaced.bytes);
            self.forget(host, &replaced);
        }
    }

    fn remove(&mut self, host: &str) {
        if let Some(removed) = self.hosts.remove(host) {
            self.bytes = self.bytes.saturating_sub(removed.bytes);
            self.forget(host, &removed);
        }
    }

    /// Drops the registrations of `entry` that still name `host` (and are not in its entry now).
    fn forget(&mut self, host: &str, entry: &Host) {
        let current = self.hosts.get(host);
        for row in entry.rows.iter() {
            let id = &row.registration_id;
            let still_kept =
                current.is_some_and(|h| h.rows.iter().any(|r| r.registration_id == *id));
            if !still_kept && self.registrations.get(id).is_some_and(|h| h == host) {
                self.registrations.remove(id);
            }
        }
    }

    /// The kept rows of the host `id` belongs to (read under `connection`), and where `id` is in
    /// them.
    fn delivery(&self, id: &str, connection: u64) -> Option<(HostRegistrations, usize)> {
        let host = self.hosts.get(self.registrations.get(id)?)?;
        if host.connection != connection {
            return None;
        }
        let at = host.rows.iter().position(|row| row.registration_id == id)?;
        Some((host.rows.clone(), at))
    }
}

#[derive(Debug)]
struct Relay {
    /// The relay's current connection (0: none yet); each new one takes the next number.
    connection: AtomicU64,
    /// When it was last heard from, in nanoseconds after `epoch` (0: not since it connected).
    heard_at: AtomicU64,
    epoch: std::time::Instant,
}

impl Relay {
    fn nanos(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// The connection that vouches now, if one does.
    fn live(&self) -> Option<u64> {
        let connection = self.connection.load(Ordering::SeqCst);
        let heard = self.heard_at.load(Ordering::SeqCst);
        let silence = u64::try_from(RELAY_SILENCE.as_nanos()).unwrap_or(u64::MAX);
        (connection != 0 && heard != 0 && self.nanos().saturating_sub(heard) < silence)
            .then_some(connection)
    }
}

impl Default for ResolveCache {
    fn default() -> Self {
        Self::with_capacity(MAX_CACHED_HOSTS)
    }
}

impl ResolveCache {
    pub fn with_capacity(max_hosts: usize) -> Self {
        Self::with_limits(max_hosts, MAX_CACHED_BYTES)
    }

    /// At most `max_hosts` hosts whose rows take at most `max_bytes` (`MAX_CACHED_BYTES`).
    pub fn with_limits(max_hosts: usize, max_bytes: usize) -> Self {
        Self {
            kept: Mutex::new(Kept::default()),
            generation: AtomicU64::new(0),
            max_hosts,
            max_bytes,
            relay: None,
            news: tokio::sync::broadcast::channel(WATCH_BACKLOG).0,
        }
    }

    /// A cache kept by a relay of every replica's writes (see the module's documentation).
    pub fn relayed() -> Self {
        Self {
            relay: Some(Relay {
                connection: AtomicU64::new(0),
                heard_at: AtomicU64::new(0),
                epoch: std::time::Instant::now(),
            }),
            ..Self::default()
        }
    }

    /// The relay connected anew: what was kept under an earlier connection is not served.
    pub fn relay_connected(&self) {
        if let Some(relay) = &self.relay {
            relay.heard_at.store(0, Ordering::SeqCst);
            relay.connection.fetch_add(1, Ordering::SeqCst);
        }
        self.kept().clear();
        self.tell(|| DeviceNews::Lost);
    }

    /// The relay heard a heartbeat: every write committed before it was sent has been relayed.
    pub fn relay_heard(&self) {
        if let Some(relay) = &self.relay {
            relay.heard_at.store(relay.nanos(), Ordering::SeqCst);
            self.tell(|| DeviceNews::Heard);
        }
    }

    /// The relay lost its connection: nothing is served until it is back and heard from.
    pub fn relay_lost(&self) {
        if let Some(relay) = &self.relay {
            relay.heard_at.store(0, Ordering::SeqCst);
        }
        self.tell(|| DeviceNews::Lost);
    }

    /// An exact cache's heartbeat, for its owner's timer: every write this process committed
    /// before it has been told. A relayed cache's heartbeats come from its relay only, so this
    /// does nothing there.
    pub fn exact_heartbeat(&self) {
        if self.relay.is_none() {
            self.tell(|| DeviceNews::Heard);
        }
    }

    /// Device news from now on, for a `WatchDevices` watcher.
    pub fn watch(&self) -> tokio::sync::broadcast::Receiver<DeviceNews> {
        self.news.subscribe()
    }

    /// Tells the watchers, if there are any (no watcher is not an error, and costs no host copy).
    fn tell(&self, news: impl FnOnce() -> DeviceNews) {
        if self.news.receiver_count() > 0 {
            let _ = self.news.send(news());
        }
    }

    /// The connection entries may be served under now (0 for an exact cache), or `None`.
    fn vouching(&self) -> Option<u64> {
        match &self.relay {
            None => Some(0),
            Some(relay) => relay.live(),
        }
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        // No code that can panic runs between a change to one map and the other: keep using it.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host's registrations: kept ones, or `read`'s, which are kept if no write committed
    /// while it ran.
    pub async fn host<F, Fut, E>(&self, host: &str, read: F) -> Result<HostRegistrations, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<DeliveryRow>, E>>,
    {
        let vouching = self.vouching();
        if let Some(connection) = vouching
            && let Some(kept) = self.kept().hosts.get(host)
            && kept.connection == connection
        {
            metrics::counter!("orca_push_registry_resolves_total", "source" => "memory")
                .increment(1);
            return Ok(kept.rows.clone());
        }
        metrics::counter!("orca_push_registry_resolves_total", "source" => "database").increment(1);
        let began = self.generation.load(Ordering::SeqCst);
        let rows: HostRegistrations = read().await?.into();
        let Some(connection) = vouching else {
            return Ok(rows);
        };
        let mut kept = self.kept();
        // Checked under the lock that `invalidate` takes after bumping: a write that committed
        // (or was relayed) after this read began either shows here or drops the entry after it
        // is inserted.
        if self.generation.load(Ordering::SeqCst) == began {
            let entry = Host::new(host, rows.clone(), connection);
            if kept.hosts.len() >= self.max_hosts || kept.bytes + entry.bytes > self.max_bytes {
                kept.clear();
            }
            // A host past the whole budget is served, not kept.
            if entry.bytes <= self.max_bytes {
                kept.insert(host, entry);
            }
        }
        Ok(rows)
    }

    /// The kept rows of `ids` (at the index each was asked at), and the indexes of those not
    /// kept, for the caller to read.
    pub fn deliveries(&self, ids: &[String]) -> (Vec<Option<DeliveryRow>>, Vec<usize>) {
        let mut missing = Vec::new();
        let vouching = self.vouching();
        // Shared under the lock, copied after it.
        let found: Vec<Option<(HostRegistrations, usize)>> = {
            let kept = self.kept();
            ids.iter()
                .map(|id| vouching.and_then(|connection| kept.delivery(id, connection)))
                .collect()
        };
        let rows: Vec<Option<DeliveryRow>> = found
            .into_iter()
            .enumerate()
            .map(|(i, found)| {
                let row = found.map(|(rows, at)| rows[at].clone());
                if row.is_none() {
                    missing.push(i);
                }
                row
            })
            .collect();
        let source = |found: bool| if found { "memory" } else { "database" };
        metrics::counter!("orca_push_registry_delivery_lookups_total", "source" => source(true))
            .increment((ids.len() - missing.len()) as u64);
        metrics::counter!("orca_push_registry_delivery_lookups_total", "source" => source(false))
            .increment(missing.len() as u64);
        (rows, missing)
    }

    /// Called after a write that may change what `host` resolves to has committed (or, relayed,
    /// was announced).
    pub fn invalidate(&self, host: &str) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.kept().remove(host);
        self.tell(|| DeviceNews::Changed(host.to_owned()));
    }

    pub fn len(&self) -> usize {
        self.kept().hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Platform;

    fn row(id: &str, dead: bool) -> DeliveryRow {
        DeliveryRow {
            registration_id: id.to_owned(),
            host_fingerprint: "h".to_owned(),
            platform: Platform::Android,
            token: format!("token-of-{id}"),
            apns_environment: None,
            dead,
        }
    }

    async fn read_ok(rows: Vec<DeliveryRow>) -> Result<Vec<DeliveryRow>, ()> {
        Ok(rows)
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|id| (*id).to_owned()).collect()
    }

    /// The tokens found for `asked`, and the indexes left to read.
    fn delivered(cache: &ResolveCache, asked: &[&str]) -> (Vec<Option<String>>, Vec<usize>) {
        let (rows, missing) = cache.deliveries(&ids(asked));
        (
            rows.into_iter().map(|r| r.map(|r| r.token)).collect(),
            missing,
        )
    }

    #[tokio::test]
    async fn a_kept_hosts_phones_answer_deliveries_until_a_write_drops_them() {
        let cache = ResolveCache::default();
        cache
            .host("h", || read_ok(vec![row("a", false), row("b", false)]))
            .await
            .unwrap();
        let (tokens, missing) = delivered(&cache, &["b", "x", "a"]);
        assert_eq!(
            tokens,
            [Some("token-of-b".into()), None, Some("token-of-a".into())]
        );
        assert_eq!(missing, [1], "an id of no kept host is read");

        cache.invalidate("h");
        assert_eq!(delivered(&cache, &["a", "b"]).1, [0, 1]);
    }

    #[test]
    fn a_rows_debug_leaves_its_token_out() {
        let printed = format!("{:?}", row("a", false));
        assert!(!printed.contains("token-of-a"), "{printed}");
        assert!(printed.contains("token_bytes: 10"), "{printed}");
    }

    #[tokio::test]
    async fn the_cache_prints_counts_not_tokens() {
        let cache = ResolveCache::default();
        cache
            .host("h", || read_ok(vec![row("a", false)]))
            .await
            .unwrap();
        let printed = format!("{cache:?}");
        assert!(!printed.contains("token-of-a"), "{printed}");
        assert!(printed.contains("hosts: 1"), "{printed}");
    }

    #[tokio::test]
    async fn a_host_kept_again_forgets_the_phones_it_no_longer_has() {
        let cache = ResolveCache::default();
        // Two reads of one host in flight, no write between them: the one that ends last (with
        // one phone deleted meanwhile, say) replaces the other's entry.
        cache
            .host("h", || async {
                cache
                    .host("h", || read_ok(vec![row("a", false), row("b", false)]))
                    .await?;
                Ok::<_, ()>(vec![row("a", false)])
            })
            .await
            .unwrap();
        let (tokens, missing) = delivered(&cache, &["a", "b"]);
        assert_eq!(tokens[0].as_deref(), Some("token-of-a"));
        assert_eq!(missing, [1]);
        let printed = format!("{cache:?}");
        assert!(
            printed.contains("registrations: 1"),
            "b forgotten: {printed}"
        );
        cache.invalidate("h");
        let printed = format!("{cache:?}");
        assert!(printed.contains("registrations: 0"), "{printed}");
        assert!(printed.contains("bytes: 0"), "{printed}");
    }

    #[tokio::test]
    async fn a_read_kept_under_a_lost_relay_connection_answers_no_delivery() {
        let cache = ResolveCache::relayed();
        cache.relay_connected();
        cache.relay_heard();
        // The relay reconnects while the read is in flight: announcements may have been lost
        // in between, so what the read saw is kept under the old connection and not served.
        cache
            .host("h", || async {
                cache.relay_connected();
                cache.relay_heard();
                Ok::<_, ()>(vec![row("a", false)])
            })
            .await
            .unwrap();
        assert_eq!(cache.len(), 1);
        assert_eq!(delivered(&cache, &["a"]).1, [0]);
    }

    #[tokio::test]
    async fn a_cache_past_its_bytes_starts_again_empty() {
        let one_host = Host::new("h", vec![row("a", false)].into(), 0).bytes;
        let cache = ResolveCache::with_limits(100, 2 * one_host);
        for host in ["h", "g"] {
            cache
                .host(host, || read_ok(vec![row("a", false)]))
                .await
                .unwrap();
        }
        assert_eq!(cache.len(), 2);
        cache
            .host("f", || read_ok(vec![row("c", false)]))
            .await
            .unwrap();
        assert_eq!(cache.len(), 1, "started again with f alone");
        assert_eq!(delivered(&cache, &["c"]).1, Vec::<usize>::new());
        // A host past the whole budget is answered, not kept.
        let mut big = row("d", false);
        big.token = "t".repeat(4 * one_host);
        let answered = cache.host("e", || read_ok(vec![big])).await.unwrap();
        assert_eq!(answered.len(), 1);
        assert!(!cache.kept().hosts.contains_key("e"));
    }

    #[tokio::test]
    async fn a_relayed_cache_answers_deliveries_only_while_its_relay_is_heard() {
        let cache = ResolveCache::relayed();
        cache.relay_connected();
        cache.relay_heard();
        cache
            .host("h", || read_ok(vec![row("a", false)]))
            .await
            .unwrap();
        assert!(delivered(&cache, &["a"]).1.is_empty());
        cache.relay_lost();
        assert_eq!(delivered(&cache, &["a"]).1, [0]);
        cache.relay_connected();
        cache.relay_heard();
        assert_eq!(
            delivered(&cache, &["a"]).1,
            [0],
            "read under an earlier connection"
        );
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
            .host("h", || async { Err::<Vec<DeliveryRow>, _>("down") })
            .await;
        assert_eq!(failed.unwrap_err(), "down");
        assert!(cache.is_empty());
    }

    #[tokio::test]
    async fn a_relayed_cache_serves_only_while_its_relay_is_heard() {
        let cache = ResolveCache::relayed();
        let reads = std::sync::atomic::AtomicUsize::new(0);
        let read = || {
            reads.fetch_add(1, Ordering::SeqCst);
            read_ok(vec![row("a", false)])
        };
        // Not connected yet: every resolve reads, and nothing is kept.
        cache.host("h", read).await.unwrap();
        assert!(cache.is_empty());
        cache.relay_connected();
        cache.relay_heard();
        cache.host("h", read).await.unwrap();
        cache.host("h", read).await.unwrap();
        assert_eq!(
            reads.load(Ordering::SeqCst),
            2,
            "the second came from memory"
        );
        // Silent past RELAY_SILENCE: read again.
        tokio::time::sleep(RELAY_SILENCE + std::time::Duration::from_millis(50)).await;
        cache.host("h", read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 3);
        // Lost: read; reconnected: what was kept under the old connection is gone.
        cache.relay_heard();
        cache.relay_lost();
        cache.host("h", read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 4);
        cache.relay_connected();
        cache.relay_heard();
        cache.host("h", read).await.unwrap();
        assert_eq!(
            reads.load(Ordering::SeqCst),
            5,
            "kept under the old connection: read"
        );
        cache.host("h", read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 5);
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
