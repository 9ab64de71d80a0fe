//! A client's copy of the registry's answers about hosts, served while the registry's
//! `WatchDevices` stream vouches for it: the facade keeps what sends resolved
//! (`orca-push`'s `resolves`), the sender the phones its lanes looked up. Each saves a call to the
//! registry per send or per claim; across a socket that call was some 115 µs of the two ends' CPU
//! (docs/benchmarks.md, round 29).
//!
//! The rules, the same for every client:
//! - A host whose registrations change is dropped as the news arrives. Entries are served only
//!   while the stream's heartbeat was heard within [`WATCH_SILENCE`] (the registry sends one every
//!   200 ms, after every change it relayed before), and only those read under the stream open now.
//! - A read that raced a change is never kept: every change bumps a generation, and a read is kept
//!   only if none arrived since it began ([`WatchedHosts::begin`]).
//! - With several registry replicas, an answer may come from one that has not heard a write yet,
//!   after the news of it reached this client through another. So a read of a host that began
//!   within [`CHANGE_SETTLES_IN`] of news of it is not kept, and an entry is served for at most
//!   [`TRUST_FOR`] whatever happens.
//! - The copy is bounded by hosts and by bytes; when full it starts again empty.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use orca_push_proto::registry::v1 as pb;
use tokio_util::sync::CancellationToken;

/// How long a kept answer is served at most (see the module's documentation).
pub const TRUST_FOR: Duration = Duration::from_secs(10);
/// Entries are served only while the watch's heartbeat was heard this recently.
pub const WATCH_SILENCE: Duration = Duration::from_millis(600);
/// A read of a host that began this soon after news of a change to it is not kept: another registry
/// replica may not have heard the change yet (relays take milliseconds).
pub const CHANGE_SETTLES_IN: Duration = Duration::from_secs(1);
/// How long to wait before opening the watch again after it ended or was refused.
const WATCH_RETRY: Duration = Duration::from_secs(1);
/// How long to wait before asking again a registry that does not offer the watch.
const WATCH_UNOFFERED_RETRY: Duration = Duration::from_secs(60);
/// A stream with no heartbeat for this long is opened again. The registry sends one every 200 ms
/// while its news is complete; a replica whose relay has stopped sends none, and may keep the
/// stream open meanwhile, when nothing would be served until it ended. Opened again, the stream
/// may reach another replica.
pub const REOPEN_AFTER_SILENCE: Duration = Duration::from_secs(3);
/// How often entries past [`TRUST_FOR`] are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

pub type RegistryClient =
    pb::registry_service_client::RegistryServiceClient<orca_push_internal_auth::InternalChannel>;

struct HostEntry<V> {
    /// The host's ids asked for, and what each was.
    ids: HashMap<String, V>,
    /// When the oldest read in it began.
    read_at: Instant,
    /// The watch stream it was read under.
    stream: u64,
    bytes: usize,
}

impl<V> HostEntry<V> {
    fn fresh(&self, stream: u64) -> bool {
        self.stream == stream && self.read_at.elapsed() < TRUST_FOR
    }
}

struct Kept<V> {
    hosts: HashMap<String, HostEntry<V>>,
    bytes: usize,
    /// When news of a change to each host last arrived (for [`CHANGE_SETTLES_IN`]).
    changed_at: HashMap<String, Instant>,
}

impl<V> Default for Kept<V> {
    fn default() -> Self {
        Self {
            hosts: HashMap::new(),
            bytes: 0,
            changed_at: HashMap::new(),
        }
    }
}

impl<V> Kept<V> {
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

/// What was true as a read of the registry began: the stream that vouched, and the generation of
/// changes heard. Its answers may be kept only if both still hold when it ends.
#[derive(Debug, Clone, Copy)]
pub struct Read {
    stream: u64,
    generation: u64,
    at: Instant,
}

/// Answers kept per host, each id's a `V`, and what this client knows of the registry's watch.
pub struct WatchedHosts<V> {
    kept: Mutex<Kept<V>>,
    /// Bumped by every change heard, before its host is dropped.
    generation: AtomicU64,
    /// Which stream is open (0: none yet); every new stream takes the next number.
    stream: AtomicU64,
    /// When it was last heard from, in nanoseconds after `epoch` (0: not since it opened).
    heard_at: AtomicU64,
    epoch: Instant,
    max_hosts: usize,
    max_bytes: usize,
    /// Who follows the watch, for its log lines.
    client: &'static str,
}

/// Counts only: what is kept may hold push tokens.
impl<V> std::fmt::Debug for WatchedHosts<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("WatchedHosts")
            .field("client", &self.client)
            .field("hosts", &kept.hosts.len())
            .field("bytes", &kept.bytes)
            .finish_non_exhaustive()
    }
}

impl<V: Clone> WatchedHosts<V> {
    /// An empty copy of at most `max_hosts` hosts and about `max_bytes` (as [`WatchedHosts::keep`]
    /// is told each id takes), for `client` (named in log lines).
    pub fn with_limits(client: &'static str, max_hosts: usize, max_bytes: usize) -> Self {
        Self {
            kept: Mutex::new(Kept::default()),
            generation: AtomicU64::new(0),
            stream: AtomicU64::new(0),
            heard_at: AtomicU64::new(0),
            epoch: Instant::now(),
            max_hosts,
            max_bytes,
            client,
        }
    }

    fn kept(&self) -> MutexGuard<'_, Kept<V>> {
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

    /// Begins a read: `None` while no stream vouches (nothing is then served or kept).
    pub fn begin(&self) -> Option<Read> {
        let stream = self.live()?;
        Some(Read {
            stream,
            generation: self.generation.load(Ordering::SeqCst),
            at: Instant::now(),
        })
    }

    /// What is kept for every one of `host`'s `ids`, in their order, or `None` if any is not kept
    /// (or the host's entry is not served under `read`'s stream).
    pub fn answer(&self, host: &str, ids: &[&str], read: &Read) -> Option<Vec<V>> {
        let kept = self.kept();
        let entry = kept.hosts.get(host).filter(|e| e.fresh(read.stream))?;
        ids.iter().map(|id| entry.ids.get(*id).cloned()).collect()
    }

    /// Keeps what a read that began at `read` found of `host`: each id with its value and about
    /// what it takes in bytes. Nothing is kept if a change arrived since it began, its stream
    /// ended, or news of the host is still settling.
    pub fn keep(
        &self,
        host: &str,
        read: &Read,
        found: impl IntoIterator<Item = (String, V, usize)>,
    ) {
        let mut kept = self.kept();
        // Checked under the lock that `changed` takes after bumping: a change heard after this read
        // began either shows here or drops the entry after it is inserted.
        if self.generation.load(Ordering::SeqCst) != read.generation
            || self.stream.load(Ordering::SeqCst) != read.stream
            || kept.settling(host, read.at)
        {
            return;
        }
        let kept = &mut *kept;
        let mut entry = match kept.hosts.remove(host) {
            // Both reads hold: no change to the host was heard since the older began.
            Some(older) if older.fresh(read.stream) => {
                kept.bytes = kept.bytes.saturating_sub(older.bytes);
                older
            }
            older => {
                if let Some(older) = older {
                    kept.bytes = kept.bytes.saturating_sub(older.bytes);
                }
                HostEntry {
                    ids: HashMap::new(),
                    read_at: read.at,
                    stream: read.stream,
                    bytes: host.len() + ENTRY_OVERHEAD,
                }
            }
        };
        // A slow read can end after a later one: the entry is trusted from the older start.
        entry.read_at = entry.read_at.min(read.at);
        for (id, value, bytes) in found {
            let id_bytes = id.len() + bytes;
            if entry.ids.insert(id, value).is_none() {
                entry.bytes += id_bytes;
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

    /// What `host`'s ids are may have changed: its entry goes, and reads under way, or begun
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

    /// Hosts kept.
    pub fn len(&self) -> usize {
        self.kept().hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes kept, as [`WatchedHosts::keep`] was told.
    pub fn bytes(&self) -> usize {
        self.kept().bytes
    }

    /// Follows the registry's device watch until `shutdown`, opening it again whenever it ends or
    /// falls silent ([`REOPEN_AFTER_SILENCE`]), and sweeps now and then. A registry that does not
    /// offer it (an older one) is asked again each minute; meanwhile nothing is served.
    pub async fn follow(self: Arc<Self>, registry: RegistryClient, shutdown: CancellationToken) {
        let open = move || {
            let mut registry = registry.clone();
            async move {
                let response = registry.watch_devices(pb::WatchDevicesRequest {}).await?;
                Ok(response.into_inner().boxed())
            }
        };
        self.follow_streams(open, shutdown).await;
    }

    /// [`WatchedHosts::follow`], with each stream opened by `open`.
    async fn follow_streams<F, Fut>(self: Arc<Self>, mut open: F, shutdown: CancellationToken)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Events, tonic::Status>>,
    {
        let client = self.client;
        let mut sweeps = tokio::time::interval(SWEEP_EVERY);
        loop {
            let opened = tokio::select! {
                () = shutdown.cancelled() => return,
                opened = open() => opened,
            };
            let wait = match opened {
                Ok(mut events) => {
                    self.opened();
                    tracing::debug!(client, "following the registry's device watch");
                    let mut beat_at = tokio::time::Instant::now();
                    let ended = loop {
                        tokio::select! {
                            () = shutdown.cancelled() => {
                                self.closed();
                                return;
                            }
                            _ = sweeps.tick() => self.sweep(),
                            () = tokio::time::sleep_until(beat_at + REOPEN_AFTER_SILENCE) => {
                                break Ended::Silent;
                            }
                            event = events.next() => match event {
                                Some(Ok(event)) => {
                                    if event.changed_host_fingerprint.is_empty() {
                                        beat_at = tokio::time::Instant::now();
                                    }
                                    self.heard(&event);
                                }
                                Some(Err(status)) => break Ended::Refused(status.code()),
                                None => break Ended::Closed,
                            },
                        }
                    };
                    self.closed();
                    match ended {
                        Ended::Refused(code) => tracing::info!(
                            client,
                            ?code,
                            "the registry's device watch ended; opening it again"
                        ),
                        Ended::Silent => tracing::info!(
                            client,
                            "no heartbeat on the registry's device watch; opening it again"
                        ),
                        Ended::Closed => {}
                    }
                    WATCH_RETRY
                }
                Err(status) if status.code() == tonic::Code::Unimplemented => {
                    tracing::info!(
                        client,
                        "the registry offers no device watch: every look-up asks it"
                    );
                    WATCH_UNOFFERED_RETRY
                }
                Err(status) => {
                    tracing::info!(client, code = ?status.code(), "the registry's device watch not opened; retrying");
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

/// A watch's news, as [`WatchedHosts::follow`] reads it.
type Events = futures::stream::BoxStream<'static, Result<pb::DeviceEvent, tonic::Status>>;

/// How a watch stream ended.
enum Ended {
    Refused(tonic::Code),
    Silent,
    Closed,
}

/// What a host's entry takes besides its ids: its name and its place in the map (an estimate; it
/// only bounds the copy).
const ENTRY_OVERHEAD: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    fn heartbeat() -> pb::DeviceEvent {
        pb::DeviceEvent::default()
    }

    fn change(host: &str) -> pb::DeviceEvent {
        pb::DeviceEvent {
            changed_host_fingerprint: host.to_owned(),
        }
    }

    fn watched(max_hosts: usize, max_bytes: usize) -> WatchedHosts<u32> {
        let hosts = WatchedHosts::with_limits("test", max_hosts, max_bytes);
        hosts.opened();
        hosts.heard(&heartbeat());
        hosts
    }

    fn found(pairs: &[(&str, u32)]) -> Vec<(String, u32, usize)> {
        pairs
            .iter()
            .map(|(id, v)| ((*id).to_owned(), *v, 8))
            .collect()
    }

    /// As if news of `host` had arrived longer ago than it takes a change to settle.
    fn settled(hosts: &WatchedHosts<u32>, host: &str) {
        let mut kept = hosts.kept();
        match Instant::now().checked_sub(CHANGE_SETTLES_IN * 2) {
            Some(at) => {
                kept.changed_at.insert(host.to_owned(), at);
            }
            None => {
                kept.changed_at.remove(host);
            }
        }
    }

    #[test]
    fn kept_ids_are_answered_in_the_order_asked_and_only_all_together() {
        let hosts = watched(10, 1 << 20);
        let read = hosts.begin().unwrap();
        hosts.keep("h", &read, found(&[("a", 1), ("b", 2)]));
        let read = hosts.begin().unwrap();
        assert_eq!(hosts.answer("h", &["b", "a"], &read), Some(vec![2, 1]));
        assert_eq!(hosts.answer("h", &["a", "c"], &read), None);
        assert_eq!(hosts.answer("g", &["a"], &read), None);
        // A later read of the same host adds to its entry.
        hosts.keep("h", &read, found(&[("c", 3)]));
        assert_eq!(hosts.answer("h", &["a", "c"], &read), Some(vec![1, 3]));
        // Nothing found: nothing kept.
        hosts.keep("g", &read, found(&[]));
        assert_eq!(hosts.len(), 1);
    }

    #[test]
    fn a_change_drops_its_host_only_and_settles_before_it_is_kept_again() {
        let hosts = watched(10, 1 << 20);
        let read = hosts.begin().unwrap();
        hosts.keep("h", &read, found(&[("a", 1)]));
        hosts.keep("g", &read, found(&[("c", 1)]));
        hosts.heard(&change("h"));
        let read = hosts.begin().unwrap();
        assert_eq!(hosts.answer("h", &["a"], &read), None);
        assert_eq!(hosts.answer("g", &["c"], &read), Some(vec![1]));
        // Read after the news, but not kept while another replica may not have heard the change.
        hosts.keep("h", &read, found(&[("a", 2)]));
        assert_eq!(hosts.answer("h", &["a"], &read), None);
        settled(&hosts, "h");
        hosts.keep("h", &read, found(&[("a", 2)]));
        assert_eq!(hosts.answer("h", &["a"], &read), Some(vec![2]));
    }

    /// A read that began before the one its host's entry was made from, and ended after it, adds
    /// to that entry: the entry is then trusted from the older start, never for longer than
    /// `TRUST_FOR` after its oldest answer was read.
    #[test]
    fn an_older_read_added_to_an_entry_is_trusted_from_its_own_start() {
        let hosts = watched(10, 1 << 20);
        let mut slow = hosts.begin().unwrap();
        let Some(long_ago) = Instant::now().checked_sub(TRUST_FOR + Duration::from_secs(1)) else {
            return; // A clock this close to its origin cannot say it.
        };
        slow.at = long_ago;
        let quick = hosts.begin().unwrap();
        hosts.keep("h", &quick, found(&[("a", 1)]));
        hosts.keep("h", &slow, found(&[("b", 2)]));
        let read = hosts.begin().unwrap();
        assert_eq!(hosts.answer("h", &["a"], &read), None);
        assert_eq!(hosts.answer("h", &["b"], &read), None);
    }

    #[test]
    fn a_read_that_raced_a_change_is_not_kept() {
        let hosts = watched(10, 1 << 20);
        let read = hosts.begin().unwrap();
        // The registry answered from before a write to another host; its news arrives meanwhile.
        hosts.heard(&change("g"));
        settled(&hosts, "g");
        hosts.keep("h", &read, found(&[("a", 1)]));
        assert!(hosts.is_empty());
    }

    #[test]
    fn nothing_is_served_or_kept_without_a_live_watch() {
        let hosts: WatchedHosts<u32> = WatchedHosts::with_limits("test", 10, 1 << 20);
        assert!(hosts.begin().is_none(), "never opened");
        hosts.opened();
        hosts.heard(&change("g"));
        assert!(
            hosts.begin().is_none(),
            "news of a change is not a heartbeat"
        );
        hosts.heard(&heartbeat());
        let read = hosts.begin().unwrap();
        hosts.keep("h", &read, found(&[("a", 1)]));
        assert_eq!(hosts.len(), 1);
        hosts.closed();
        assert!(hosts.begin().is_none());
        assert!(hosts.is_empty());
        // A new stream does not serve, or keep, what was read under the old one.
        hosts.opened();
        hosts.heard(&heartbeat());
        hosts.keep("h", &read, found(&[("a", 1)]));
        assert!(hosts.is_empty());
        let read = hosts.begin().unwrap();
        hosts.keep("h", &read, found(&[("a", 1)]));
        hosts.opened();
        hosts.heard(&heartbeat());
        let read = hosts.begin().unwrap();
        assert_eq!(hosts.answer("h", &["a"], &read), None);
    }

    #[test]
    fn a_watch_whose_heartbeats_stop_vouches_for_nothing() {
        let hosts = watched(10, 1 << 20);
        std::thread::sleep(WATCH_SILENCE);
        // The registry's own writes still come through, but prove nothing of its relay.
        hosts.heard(&change("g"));
        assert!(hosts.begin().is_none());
        hosts.heard(&heartbeat());
        assert!(hosts.begin().is_some());
    }

    #[test]
    fn an_entry_is_served_for_trust_for_at_most() {
        let Some(long_ago) = Instant::now().checked_sub(TRUST_FOR) else {
            return;
        };
        let entry = HostEntry::<u32> {
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

    /// Follows streams `stream` makes, counting how many were opened.
    fn follow_counting(
        stream: fn() -> Events,
    ) -> (
        Arc<WatchedHosts<u32>>,
        Arc<std::sync::atomic::AtomicUsize>,
        CancellationToken,
    ) {
        let hosts = Arc::new(WatchedHosts::with_limits("test", 10, 1 << 20));
        let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let counted = opened.clone();
        let open = move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, tonic::Status>(stream()) }
        };
        tokio::spawn(hosts.clone().follow_streams(open, shutdown.clone()));
        (hosts, opened, shutdown)
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_falls_silent_is_opened_again() {
        // One heartbeat, then silence with the stream still open.
        let (hosts, opened, shutdown) = follow_counting(|| {
            futures::stream::once(async { Ok(heartbeat()) })
                .chain(futures::stream::pending())
                .boxed()
        });
        tokio::time::sleep(REOPEN_AFTER_SILENCE - Duration::from_millis(100)).await;
        assert_eq!(opened.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(200) + WATCH_RETRY).await;
        assert_eq!(opened.load(Ordering::SeqCst), 2, "opened again");
        assert!(hosts.is_empty());
        shutdown.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_keeps_beating_stays_open() {
        let (_hosts, opened, shutdown) = follow_counting(|| {
            futures::stream::unfold((), |()| async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                Some((Ok(heartbeat()), ()))
            })
            .boxed()
        });
        tokio::time::sleep(REOPEN_AFTER_SILENCE * 4).await;
        assert_eq!(opened.load(Ordering::SeqCst), 1);
        shutdown.cancel();
    }

    #[test]
    fn its_debug_shows_counts_not_what_is_kept() {
        let hosts = watched(10, 1 << 20);
        let read = hosts.begin().unwrap();
        hosts.keep("host-fingerprint", &read, found(&[("reg-id", 424_242)]));
        let shown = format!("{hosts:?}");
        assert!(shown.contains("hosts: 1"), "{shown}");
        for secret in ["host-fingerprint", "reg-id", "424242"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }

    #[test]
    fn the_copy_is_bounded_by_hosts_and_bytes() {
        let hosts = watched(2, 1 << 20);
        let read = hosts.begin().unwrap();
        for host in ["h1", "h2", "h3"] {
            hosts.keep(host, &read, found(&[("a", 1)]));
        }
        assert_eq!(
            hosts.len(),
            1,
            "full at two hosts: started again with the third"
        );
        let hosts = watched(100, 200);
        let read = hosts.begin().unwrap();
        for host in ["h", "g", "f"] {
            hosts.keep(host, &read, found(&[("a", 1)]));
            let kept = hosts.kept();
            assert!(kept.bytes <= 200, "{}", kept.bytes);
            assert_eq!(
                kept.bytes,
                kept.hosts.values().map(|e| e.bytes).sum::<usize>()
            );
        }
        // An entry past the whole budget is not kept.
        hosts.keep("big", &read, vec![("a".to_owned(), 1, 500)]);
        assert_eq!(hosts.answer("big", &["a"], &read), None);
    }
}
