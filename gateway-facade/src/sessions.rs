//! Bearer checks without a database round trip. Session tokens carry a tag under the auth
//! service's session key (fetched once over gRPC), so a forged bearer is refused here for the cost
//! of one HMAC. A tagged token's session is looked up once and then trusted for at most
//! [`TRUST_VALID_FOR`], so a replaced or expired session stops working within a second; concurrent
//! requests for one uncached token share one look-up.
//!
//! Where auth can name every session it mints (one process on SQLite), the facade also follows
//! auth's `WatchSessions` stream: a host given a new session has its older verdicts dropped as the
//! event arrives, and while the stream is heard from (a heartbeat every 200 ms), a verdict looked
//! up under it is trusted for [`WATCHED_TRUST_FOR`] instead of a second. Silence for
//! [`WATCH_SILENCE`], a lag or a reconnection puts every verdict back on the one-second rule.
//!
//! It must never hold a token in plaintext (entries are keyed by its sha256) nor log one or the key.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use orca_push_auth::session_token::{SessionKey, SessionTagging, Tag, token_hash};
use orca_push_proto::auth::v1 as pb;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;

/// How long a verified session is trusted without asking auth again.
pub const TRUST_VALID_FOR: Duration = Duration::from_secs(1);
/// How long a verified session is trusted while auth's session watch vouches for it: long enough
/// that a busy host costs a look-up twice a minute, short enough that auth still refreshes the
/// host's last contact (once a minute) about as often as before.
pub const WATCHED_TRUST_FOR: Duration = Duration::from_secs(30);
const WATCHED_TRUST_MS: u64 = WATCHED_TRUST_FOR.as_millis() as u64;
/// The watch vouches only while heard from this recently (auth's heartbeat is every 200 ms).
pub const WATCH_SILENCE: Duration = Duration::from_millis(600);
/// A watch heard from no more for this long is opened again (its connection may be gone without
/// a word); meanwhile verdicts are on the one-second rule.
pub const WATCH_REOPEN_AFTER: Duration = Duration::from_secs(3);
/// How long to wait before opening the watch again after it ended or was refused.
const WATCH_RETRY: Duration = Duration::from_secs(1);
/// How long to wait before asking again an auth that does not offer the watch.
const WATCH_UNOFFERED_RETRY: Duration = Duration::from_secs(60);

/// How long a refusal of a tagged token (replaced, unknown or expired) is remembered. A refused
/// token never becomes valid again, so this only bounds memory, not correctness.
pub const REMEMBER_REFUSAL_FOR: Duration = Duration::from_secs(60);
/// Most sessions held; past it, stale entries are swept and, if it is still full, new verdicts are
/// not remembered (their next request is looked up again).
pub const MAX_CACHED_SESSIONS: usize = 100_000;

/// How long a request waits for the session key before its first fetch has been answered.
pub const KEY_WAIT: Duration = Duration::from_secs(2);

type TokenHash = [u8; 32];
type AuthClient = orca_push_proto::auth::v1::auth_service_client::AuthServiceClient<
    orca_push_internal_auth::InternalChannel,
>;

/// What auth said about a tagged token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Host {
        fingerprint: String,
        expires_at_ms: u64,
    },
    /// No such session: never minted, or replaced by a newer login.
    Unknown,
    Expired,
}

struct Entry {
    verdict: Verdict,
    /// When the look-up that produced it started: nothing it read is older than this.
    checked_at: Instant,
    /// The session watch's stream that was live when the look-up started, if one was: the entry
    /// may be trusted longer while that same stream still is.
    watched_by: Option<u64>,
}

/// What this facade knows of auth's session watch.
struct Watch {
    /// Which stream is open (0: none yet); every new stream takes the next number.
    stream: std::sync::atomic::AtomicU64,
    /// When it was last heard from, in nanoseconds after `epoch` (0: not since it opened).
    heard_at: std::sync::atomic::AtomicU64,
    epoch: Instant,
    /// Hosts given a new session, and when the event arrived: a verdict on such a host looked
    /// up before then is not trusted.
    replaced: DashMap<String, Instant>,
}

impl Watch {
    fn new() -> Self {
        Self {
            stream: Default::default(),
            heard_at: Default::default(),
            epoch: Instant::now(),
            replaced: DashMap::new(),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// The stream that vouches now, if one does.
    fn live(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        let stream = self.stream.load(SeqCst);
        let heard = self.heard_at.load(SeqCst);
        let silent_for = self.nanos(Instant::now()).saturating_sub(heard);
        (stream != 0 && heard != 0 && silent_for < WATCH_SILENCE.as_nanos() as u64)
            .then_some(stream)
    }

    fn opened(&self) -> u64 {
        use std::sync::atomic::Ordering::SeqCst;
        self.heard_at.store(0, SeqCst);
        self.stream.fetch_add(1, SeqCst) + 1
    }

    fn heard(&self, event: &pb::SessionEvent) {
        if !event.replaced_host_fingerprint.is_empty() {
            self.replaced
                .insert(event.replaced_host_fingerprint.clone(), Instant::now());
        }
        // After the replacement is recorded: whoever sees this heartbeat sees the replacement.
        self.heard_at.store(
            self.nanos(Instant::now()),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    fn closed(&self) {
        self.heard_at.store(0, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether `host` was given a new session after a look-up that started at `checked_at`.
    fn replaced_since(&self, host: &str, checked_at: Instant) -> bool {
        self.replaced.get(host).is_some_and(|at| *at >= checked_at)
    }
}

type Shared = Arc<OnceCell<Result<Verdict, ApiError>>>;

/// The session key (once fetched) and the verified-session cache of this facade instance.
pub struct SessionCheck {
    tagging: OnceCell<SessionTagging>,
    entries: DashMap<TokenHash, Entry>,
    in_flight: DashMap<TokenHash, (Instant, Shared)>,
    max_entries: usize,
    sweeps: crate::limits::SweepSpacing,
    watch: Watch,
}

impl Default for SessionCheck {
    fn default() -> Self {
        Self::with_capacity(MAX_CACHED_SESSIONS)
    }
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl SessionCheck {
    pub fn with_capacity(max_entries: usize) -> Self {
        Self {
            tagging: OnceCell::new(),
            entries: DashMap::new(),
            in_flight: DashMap::new(),
            max_entries,
            sweeps: crate::limits::SweepSpacing::default(),
            watch: Watch::new(),
        }
    }

    /// For tests and callers that already hold the key.
    pub fn with_tagging(tagging: SessionTagging, max_entries: usize) -> Self {
        let check = Self::with_capacity(max_entries);
        let _ = check.tagging.set(tagging);
        check
    }

    /// The token's tag, fetching the session key from auth on first use (concurrent first uses
    /// share one fetch). A request waits for the key at most [`KEY_WAIT`], then is answered
    /// `dependency_unavailable`: with auth unreachable at start-up, requests would otherwise hang
    /// in line, each failed fetch handing the next waiter a fetch of its own, outside the bound
    /// on waiting look-ups. The fetch at start (`keep_fresh`) goes on regardless.
    pub async fn tag(&self, auth: &AuthClient, token: &str) -> Result<Tag, ApiError> {
        if let Some(tagging) = self.tagging.get() {
            return Ok(tagging.check(token, now_ms()));
        }
        let tagging = tokio::time::timeout(KEY_WAIT, self.tagging(auth))
            .await
            .map_err(|_| ApiError::DependencyUnavailable)??;
        Ok(tagging.check(token, now_ms()))
    }

    async fn tagging(&self, auth: &AuthClient) -> Result<&SessionTagging, ApiError> {
        self.tagging
            .get_or_try_init(|| async {
                let answer = orca_push_internal_auth::retry_unavailable(|| {
                    let mut auth = auth.clone();
                    async move { auth.get_session_key(pb::GetSessionKeyRequest {}).await }
                })
                .await?
                .into_inner();
                let Some(key) = SessionKey::from_bytes(&answer.key) else {
                    tracing::error!("auth answered a session key that is not 32 bytes");
                    return Err(ApiError::Internal);
                };
                Ok(SessionTagging {
                    key,
                    legacy_until_ms: u64::try_from(answer.legacy_until_ms).unwrap_or(0),
                })
            })
            .await
    }

    /// The verdict on a tagged token: from the cache while it may be trusted, else from `lookup`,
    /// which concurrent callers for the same token share.
    pub async fn verify<F, Fut>(&self, token: &str, lookup: F) -> Result<Verdict, ApiError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Verdict, ApiError>>,
    {
        let hash = token_hash(token);
        if let Some(verdict) = self.cached(&hash, now_ms()) {
            metrics::counter!("orca_push_bearer_checks_total", "outcome" => "cached").increment(1);
            return Ok(verdict);
        }
        let (started, shared) = {
            let mut slot = self
                .in_flight
                .entry(hash)
                .or_insert_with(|| (Instant::now(), Shared::default()));
            // A look-up started too long ago may have read a session since replaced: start afresh.
            if slot.0.elapsed() >= TRUST_VALID_FOR {
                *slot = (Instant::now(), Shared::default());
            }
            slot.clone()
        };
        let leave = LeaveInFlight {
            map: &self.in_flight,
            hash,
            shared,
        };
        leave
            .shared
            .get_or_init(|| async {
                metrics::counter!("orca_push_bearer_checks_total", "outcome" => "looked_up")
                    .increment(1);
                let watched_by = self.watch.live();
                let result = lookup().await;
                if let Ok(verdict) = &result {
                    self.remember(hash, verdict.clone(), started, watched_by);
                }
                result
            })
            .await
            .clone()
    }

    fn cached(&self, hash: &TokenHash, now_ms: u64) -> Option<Verdict> {
        let entry = self.entries.get(hash)?;
        let age = entry.checked_at.elapsed();
        match &entry.verdict {
            // Expiry never moves, so a session past it is expired whatever auth would say now.
            Verdict::Host { expires_at_ms, .. } if now_ms >= *expires_at_ms => {
                Some(Verdict::Expired)
            }
            Verdict::Host { fingerprint, .. }
                if self.watch.replaced_since(fingerprint, entry.checked_at) =>
            {
                None
            }
            Verdict::Host { .. } if age < TRUST_VALID_FOR => Some(entry.verdict.clone()),
            // Not within the watched trust of its expiry: the watch announces replacements, not
            // expiries, and the expiry is auth's time, which this clock may trail. Near it, each
            // second's look-up lets auth's clock decide.
            Verdict::Host { expires_at_ms, .. }
                if age < WATCHED_TRUST_FOR
                    && entry.watched_by.is_some()
                    && entry.watched_by == self.watch.live()
                    && now_ms.saturating_add(WATCHED_TRUST_MS) < *expires_at_ms =>
            {
                Some(entry.verdict.clone())
            }
            Verdict::Unknown | Verdict::Expired if age < REMEMBER_REFUSAL_FOR => {
                Some(entry.verdict.clone())
            }
            _ => None,
        }
    }

    fn remember(
        &self,
        hash: TokenHash,
        verdict: Verdict,
        checked_at: Instant,
        watched_by: Option<u64>,
    ) {
        if self.entries.len() >= self.max_entries && !self.entries.contains_key(&hash) {
            if self.sweeps.due() {
                self.sweep();
            }
            if self.entries.len() >= self.max_entries {
                return;
            }
        }
        self.entries.insert(
            hash,
            Entry {
                verdict,
                checked_at,
                watched_by,
            },
        );
    }

    /// Drops entries that are no longer trusted, and replacements older than any trusted entry.
    pub fn sweep(&self) {
        let live = self.watch.live();
        self.entries.retain(|_, entry| match entry.verdict {
            Verdict::Host { .. } if live.is_some() && entry.watched_by == live => {
                entry.checked_at.elapsed() < WATCHED_TRUST_FOR
            }
            Verdict::Host { .. } => entry.checked_at.elapsed() < TRUST_VALID_FOR,
            Verdict::Unknown | Verdict::Expired => {
                entry.checked_at.elapsed() < REMEMBER_REFUSAL_FOR
            }
        });
        self.entries.shrink_to_fit();
        self.watch
            .replaced
            .retain(|_, at| at.elapsed() < WATCHED_TRUST_FOR);
        self.watch.replaced.shrink_to_fit();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Fetches the session key as soon as auth answers (so the first bearer does not wait for
    /// it), then sweeps the cache now and then, until `shutdown`.
    pub async fn keep_fresh(self: Arc<Self>, auth: AuthClient, shutdown: CancellationToken) {
        loop {
            match self.tagging(&auth).await {
                Ok(_) => break,
                Err(error) => tracing::warn!(%error, "session key not fetched yet; retrying"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
        tokio::spawn(self.clone().follow_watch(auth, shutdown.clone()));
        let mut ticker = tokio::time::interval(Duration::from_secs(10));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => self.sweep(),
            }
        }
    }

    /// Hears a session watch's events until it ends (with its error, if any), or it is heard from
    /// no more for [`WATCH_REOPEN_AFTER`] (a stream whose connection the network dropped without a
    /// word never ends): `None` at `shutdown`.
    async fn hear(
        &self,
        events: &mut (impl futures::Stream<Item = Result<pb::SessionEvent, tonic::Status>> + Unpin),
        shutdown: &CancellationToken,
    ) -> Option<Option<tonic::Status>> {
        use futures::StreamExt as _;
        let mut heard_at = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                () = tokio::time::sleep_until(heard_at + WATCH_REOPEN_AFTER) => {
                    tracing::info!("auth's session watch went silent; opening it again");
                    return Some(None);
                }
                event = events.next() => match event {
                    Some(Ok(event)) => {
                        heard_at = tokio::time::Instant::now();
                        self.watch.heard(&event);
                    }
                    Some(Err(status)) => return Some(Some(status)),
                    None => return Some(None),
                },
            }
        }
    }

    /// Follows auth's session watch until `shutdown`, opening it again whenever it ends. An auth
    /// that does not offer it (replicas on PostgreSQL, or an older auth) is asked again each
    /// minute; meanwhile every verdict stays on the one-second rule.
    async fn follow_watch(self: Arc<Self>, auth: AuthClient, shutdown: CancellationToken) {
        loop {
            let mut client = auth.clone();
            let wait = match client.watch_sessions(pb::WatchSessionsRequest {}).await {
                Ok(response) => {
                    let mut events = response.into_inner();
                    self.watch.opened();
                    tracing::debug!("following auth's session watch");
                    let Some(ended) = self.hear(&mut events, &shutdown).await else {
                        self.watch.closed();
                        return;
                    };
                    self.watch.closed();
                    if let Some(status) = ended {
                        tracing::info!(code = ?status.code(), "auth's session watch ended; opening it again");
                    }
                    WATCH_RETRY
                }
                Err(status)
                    if matches!(
                        status.code(),
                        tonic::Code::FailedPrecondition | tonic::Code::Unimplemented
                    ) =>
                {
                    tracing::debug!(code = ?status.code(), "auth offers no session watch: sessions re-checked within 1 s");
                    WATCH_UNOFFERED_RETRY
                }
                Err(status) => {
                    tracing::info!(code = ?status.code(), "auth's session watch not opened; retrying");
                    WATCH_RETRY
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// Takes a finished (or abandoned) shared look-up out of the in-flight map, and only that one.
struct LeaveInFlight<'a> {
    map: &'a DashMap<TokenHash, (Instant, Shared)>,
    hash: TokenHash,
    shared: Shared,
}

impl Drop for LeaveInFlight<'_> {
    fn drop(&mut self) {
        // Held under the shard lock, so no one can join between the count and the removal. The
        // map and this guard are two references; a third is someone still waiting.
        self.map.remove_if(&self.hash, |_, (_, shared)| {
            Arc::ptr_eq(shared, &self.shared)
                && (self.shared.initialized() || Arc::strong_count(shared) <= 2)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn check(max: usize) -> (SessionCheck, SessionKey) {
        let key = SessionKey::generate();
        let tagging = SessionTagging {
            key: key.clone(),
            legacy_until_ms: 0,
        };
        (SessionCheck::with_tagging(tagging, max), key)
    }

    fn host(expires_at_ms: u64) -> Verdict {
        Verdict::Host {
            fingerprint: "fp".into(),
            expires_at_ms,
        }
    }

    async fn counted(
        check: &SessionCheck,
        token: &str,
        calls: &AtomicUsize,
        verdict: Verdict,
    ) -> Result<Verdict, ApiError> {
        check
            .verify(token, || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(verdict)
            })
            .await
    }

    /// A watch that goes silent without ending (its connection dropped without a word) is given
    /// up after `WATCH_REOPEN_AFTER`, to be opened again; one heard from is followed.
    #[tokio::test(start_paused = true)]
    async fn a_watch_heard_from_no_more_is_given_up_to_be_opened_again() {
        let check = SessionCheck::default();
        let shutdown = CancellationToken::new();
        let beats = futures::stream::iter(vec![Ok(pb::SessionEvent::default()); 3]);
        let mut silent = Box::pin(futures::StreamExt::chain(beats, futures::stream::pending()));
        let started = tokio::time::Instant::now();
        let ended = check.hear(&mut silent, &shutdown).await;
        assert!(matches!(ended, Some(None)), "{ended:?}");
        assert_eq!(started.elapsed(), WATCH_REOPEN_AFTER);
        // A stream that keeps talking is followed until it ends.
        let talking = futures::StreamExt::then(futures::stream::iter(0..10), |_| async {
            tokio::time::sleep(WATCH_REOPEN_AFTER / 2).await;
            Ok(pb::SessionEvent::default())
        });
        let mut talking = Box::pin(talking);
        let started = tokio::time::Instant::now();
        assert!(matches!(
            check.hear(&mut talking, &shutdown).await,
            Some(None)
        ));
        assert_eq!(started.elapsed(), WATCH_REOPEN_AFTER * 5);
    }

    /// With auth unreachable before the key was ever fetched, requests are answered at once
    /// rather than in line behind each other's fetches.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_wait_for_the_session_key_at_most_key_wait() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = silent.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                kept.push(socket);
            }
        });
        let key = orca_push_internal_auth::InternalKey::generate();
        let channel = orca_push_internal_auth::channel(
            &format!("http://127.0.0.1:{port}"),
            &key,
            "facade",
            "auth",
        )
        .unwrap();
        let auth = AuthClient::new(channel);
        let check = Arc::new(SessionCheck::default());
        let started = Instant::now();
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let (check, auth) = (check.clone(), auth.clone());
                tokio::spawn(async move { check.tag(&auth, "a-token").await })
            })
            .collect();
        for answer in waiting {
            assert_eq!(
                answer.await.unwrap().err(),
                Some(ApiError::DependencyUnavailable)
            );
        }
        assert!(
            started.elapsed() < KEY_WAIT + Duration::from_millis(900),
            "{:?}",
            started.elapsed()
        );
        held.abort();
    }

    #[tokio::test]
    async fn a_verified_session_is_trusted_for_at_most_a_second() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let far = now_ms() + 60_000;
        for _ in 0..5 {
            assert_eq!(
                counted(&check, &token, &calls, host(far)).await,
                Ok(host(far))
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        tokio::time::sleep(TRUST_VALID_FOR + Duration::from_millis(20)).await;
        // The session was replaced meanwhile: the next request asks again and is refused.
        assert_eq!(
            counted(&check, &token, &calls, Verdict::Unknown).await,
            Ok(Verdict::Unknown)
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_cached_session_past_its_expiry_is_expired_without_a_look_up() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let soon = now_ms() + 30;
        counted(&check, &token, &calls, host(soon)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            counted(&check, &token, &calls, host(soon)).await,
            Ok(Verdict::Expired)
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn concurrent_requests_for_one_token_share_one_look_up() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let far = now_ms() + 60_000;
        let (release, wait) = tokio::sync::watch::channel(false);
        let requests = (0..20).map(|_| {
            let mut wait = wait.clone();
            let calls = &calls;
            check.verify(&token, move || async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let _ = wait.wait_for(|go| *go).await;
                Ok(host(far))
            })
        });
        let all = futures::future::join_all(requests);
        tokio::pin!(all);
        assert!(futures::poll!(all.as_mut()).is_pending());
        release.send(true).unwrap();
        let verdicts = all.await;
        assert!(verdicts.iter().all(|v| *v == Ok(host(far))));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(check.in_flight.is_empty());
    }

    #[tokio::test]
    async fn a_failed_look_up_is_shared_but_not_remembered() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let failed = check
            .verify(&token, || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(ApiError::DependencyUnavailable)
            })
            .await;
        assert_eq!(failed, Err(ApiError::DependencyUnavailable));
        assert!(check.is_empty() && check.in_flight.is_empty());
        let far = now_ms() + 60_000;
        assert_eq!(
            counted(&check, &token, &calls, host(far)).await,
            Ok(host(far))
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_abandoned_look_up_leaves_nothing_behind() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        {
            let pending = check.verify(&token, futures::future::pending);
            tokio::pin!(pending);
            assert!(futures::poll!(pending.as_mut()).is_pending());
            assert_eq!(check.in_flight.len(), 1);
        }
        assert!(check.in_flight.is_empty());
    }

    fn replaced(host: &str) -> pb::SessionEvent {
        pb::SessionEvent {
            replaced_host_fingerprint: host.into(),
        }
    }

    /// Heartbeats from a watch for `how_long`, as auth's stream would.
    async fn heartbeats(check: &SessionCheck, how_long: Duration) {
        let until = Instant::now() + how_long;
        while Instant::now() < until {
            check.watch.heard(&pb::SessionEvent::default());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn a_session_verified_under_a_heard_watch_is_trusted_past_a_second() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let far = now_ms() + 60_000;
        check.watch.opened();
        check.watch.heard(&pb::SessionEvent::default());
        counted(&check, &token, &calls, host(far)).await.unwrap();
        heartbeats(&check, TRUST_VALID_FOR + Duration::from_millis(200)).await;
        assert_eq!(
            counted(&check, &token, &calls, Verdict::Unknown).await,
            Ok(host(far))
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Swept only once the watched trust runs out.
        check.sweep();
        assert_eq!(check.len(), 1);
    }

    /// Within the watched trust of its expiry a session is back on the one-second rule: auth,
    /// whose clock set the expiry, says when it has passed, however this clock trails auth's.
    #[tokio::test]
    async fn a_session_near_its_expiry_is_asked_about_each_second_even_when_watched() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let near = now_ms() + 10_000;
        check.watch.opened();
        check.watch.heard(&pb::SessionEvent::default());
        counted(&check, &token, &calls, host(near)).await.unwrap();
        heartbeats(&check, TRUST_VALID_FOR + Duration::from_millis(200)).await;
        // Expired by auth's clock, which runs ahead of this one.
        assert_eq!(
            counted(&check, &token, &calls, Verdict::Expired).await,
            Ok(Verdict::Expired)
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_new_session_for_the_host_drops_its_older_verdict_at_once() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let far = now_ms() + 60_000;
        check.watch.opened();
        check.watch.heard(&pb::SessionEvent::default());
        counted(&check, &token, &calls, host(far)).await.unwrap();
        // Another host's login changes nothing; this host's does.
        check.watch.heard(&replaced("other"));
        counted(&check, &token, &calls, host(far)).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        check.watch.heard(&replaced("fp"));
        assert_eq!(
            counted(&check, &token, &calls, Verdict::Unknown).await,
            Ok(Verdict::Unknown)
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_look_up_that_a_replacement_overtook_is_not_trusted() {
        let (check, key) = check(10);
        let token = key.mint().unwrap();
        let calls = AtomicUsize::new(0);
        let far = now_ms() + 60_000;
        check.watch.opened();
        check.watch.heard(&pb::SessionEvent::default());
        // The look-up read the session just before the host logged in again.
        let answered = check
            .verify(&token, || async {
                check.watch.heard(&replaced("fp"));
                Ok(host(far))
            })
            .await;
        assert_eq!(answered, Ok(host(far)));
        assert_eq!(
            counted(&check, &token, &calls, Verdict::Unknown).await,
            Ok(Verdict::Unknown)
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_silent_or_reopened_watch_puts_verdicts_back_on_the_one_second_rule() {
        let (check, key) = check(10);
        let (silent, reopened) = (key.mint().unwrap(), key.mint().unwrap());
        let calls = AtomicUsize::new(0);
        let far = now_ms() + 60_000;
        check.watch.opened();
        check.watch.heard(&pb::SessionEvent::default());
        counted(&check, &silent, &calls, host(far)).await.unwrap();
        tokio::time::sleep(TRUST_VALID_FOR + Duration::from_millis(20)).await;
        assert!(check.watch.live().is_none(), "silent past WATCH_SILENCE");
        counted(&check, &silent, &calls, host(far)).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2);

        // Events may have been lost between two streams: the first one's verdicts lose its trust.
        check.watch.heard(&pb::SessionEvent::default());
        counted(&check, &reopened, &calls, host(far)).await.unwrap();
        check.watch.opened();
        heartbeats(&check, TRUST_VALID_FOR + Duration::from_millis(100)).await;
        counted(&check, &reopened, &calls, host(far)).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn the_cache_never_holds_more_than_its_cap() {
        let (check, key) = check(100);
        let calls = AtomicUsize::new(0);
        let far = now_ms() + 60_000;
        for _ in 0..1_000 {
            counted(&check, &key.mint().unwrap(), &calls, host(far))
                .await
                .unwrap();
            assert!(check.len() <= 100);
        }
        // Once its entries are stale, a sweep empties it.
        tokio::time::sleep(TRUST_VALID_FOR).await;
        check.sweep();
        assert!(check.is_empty());
    }
}
