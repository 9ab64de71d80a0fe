//! The desktop's push dispatcher: every mobile notification the desktop fans out over the socket
//! is handed here, filtered per paired phone, batched into `POST /v1/send` requests and sent with
//! one retry. It never returns an error into the desktop's dispatch path: every failure is counted
//! by a payload-free category and logged at most once per interval.

mod burst;
mod failures;
mod protocol;
mod run;
mod select;

pub use select::gateway_agent_state;
mod send;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use orca_push_api::{Kind, SendStatus, Source};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::{Gateway, RegistrationSource};
use failures::FailureLog;
use protocol::ProtocolCache;

/// One event as the desktop hands it over, after its own socket fan-out.
#[derive(Clone, PartialEq, Eq)]
pub struct DispatchEvent {
    /// Absent only for a terminal bell; a dismissal needs one.
    pub notification_id: Option<String>,
    pub notification_seq: u64,
    pub notification_epoch: String,
    pub source: Source,
    /// The desktop's raw agent state ("blocked", "working", "done", ...); `None` for sources
    /// without an agent.
    pub agent_state: Option<String>,
    pub title: String,
    pub body: String,
    pub worktree_id: Option<String>,
    pub kind: Kind,
    /// Unix ms after which the event is worthless.
    pub expires_at: Option<i64>,
    /// Unix ms the event happened: what burst suppression measures. Absent: the dispatch time.
    pub emitted_at: Option<u64>,
    /// False when the desktop's own master or source switch disabled this event.
    pub desktop_allowed: bool,
}

impl std::fmt::Debug for DispatchEvent {
    /// Never shows the title or body.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchEvent")
            .field("notification_seq", &self.notification_seq)
            .field("source", &self.source)
            .field("agent_state", &self.agent_state)
            .field("kind", &self.kind)
            .field("expires_at", &self.expires_at)
            .field("emitted_at", &self.emitted_at)
            .field("desktop_allowed", &self.desktop_allowed)
            .finish_non_exhaustive()
    }
}

/// The contract's timings, as fields so tests can shrink them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchConfig {
    /// Wait before the one retry of a request when the gateway gave no Retry-After.
    pub retry_delay: Duration,
    /// The longest Retry-After honoured: a longer one is cut to this.
    pub max_retry_after: Duration,
    /// Per phone, at most one alert per window of `emittedAt`.
    pub burst_window: Duration,
    /// Failure counts are logged at most once per interval.
    pub failure_log_interval: Duration,
    /// How long a gateway's `deliveryProtocol` is trusted before `GET /health` is asked again.
    pub protocol_ttl: Duration,
    /// The longest [`Dispatcher::shutdown`] waits for enqueued work before its final flush.
    pub shutdown_grace: Duration,
    /// Enqueued dispatches running at once; beyond it an event is dropped and counted
    /// (`overloaded`), so a long outage (each dispatch waiting out a Retry-After) cannot pile up
    /// tasks without bound.
    pub max_in_flight: usize,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            retry_delay: Duration::from_secs(2),
            max_retry_after: Duration::from_secs(5 * 60),
            burst_window: Duration::from_secs(5),
            failure_log_interval: Duration::from_secs(60),
            protocol_ttl: Duration::from_secs(10 * 60),
            // Room for the 2 s retry; a minutes-long Retry-After is abandoned, and counted.
            shutdown_grace: Duration::from_secs(10),
            max_in_flight: 1024,
        }
    }
}

/// Unix ms now; injectable so tests can move the wall clock with tokio's paused time.
type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

fn system_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Why a registration did not get this event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Skip {
    /// Past its lifetime (the source should not have listed it).
    RegistrationExpired,
    /// Its registration id breaks the contract, so no request naming it can be valid.
    InvalidRegistrationId,
    /// The event's source is not in the phone's filter.
    Source,
    /// The desktop disabled the event and the phone follows the desktop.
    DesktopDisabled,
    /// The mapped agent state is not in the phone's filter.
    AgentState,
    /// The phone already got an alert in this burst window.
    Burst,
    /// A dismissal, and the gateway is too old to take one.
    DismissUnsupported,
    /// A phone that wants no sound, and the event's silent form (`"sound": false`) alone is over
    /// the contract's 3000 bytes: the phones that want sound still get it.
    SilentTooLarge,
}

/// What became of one registration that was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The gateway's answer for it.
    Status(SendStatus),
    /// Its request failed (after the retry, if one was made), with this failure category.
    Failed(&'static str),
    /// The gateway answered the request but said nothing about this registration.
    NoResult,
}

/// One `POST /v1/send` request of a dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestReport {
    pub registration_ids: Vec<String>,
    /// Sent with `sound: false`.
    pub silent: bool,
    /// 1, or 2 when retried.
    pub attempts: u32,
    /// The retry was not made because the event would have expired by then.
    pub retry_skipped_expired: bool,
}

/// Everything one dispatch did. Ids are registration ids; nothing here is payload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DispatchReport {
    /// The agent is still working (working/running/busy): no push at all.
    pub not_final: bool,
    /// The event breaks the contract after mapping: nothing sent.
    pub invalid_event: bool,
    /// The event's `expires_at` had passed at dispatch: nothing sent.
    pub event_expired: bool,
    /// The gateway's delivery protocol used, when a gateway was needed.
    pub delivery_protocol: Option<u32>,
    pub requests: Vec<RequestReport>,
    pub outcomes: BTreeMap<String, Outcome>,
    pub skipped: BTreeMap<String, Skip>,
    /// Registrations the gateway reported dead and the source dropped.
    pub dropped_dead: Vec<String>,
    /// This dispatch's failure counts, as added to [`Dispatcher::failure_counts`].
    pub failures: BTreeMap<String, u64>,
}

impl DispatchReport {
    /// Every registration id that went into a request.
    pub fn sent_ids(&self) -> Vec<&str> {
        self.requests
            .iter()
            .flat_map(|r| r.registration_ids.iter().map(String::as_str))
            .collect()
    }
}

struct Inner<G, R> {
    gateway: Arc<G>,
    registrations: Arc<R>,
    config: DispatchConfig,
    clock: Clock,
    protocol: ProtocolCache,
    bursts: std::sync::Mutex<burst::BurstWindows>,
    failures: Arc<FailureLog>,
    /// Enqueued dispatches not yet finished, for [`Dispatcher::shutdown`].
    in_flight: watch::Sender<usize>,
    closed: AtomicBool,
    /// The runtime `new` ran in, for an `enqueue` from a thread outside any runtime.
    runtime: Option<Handle>,
}

/// Sends the desktop's notifications to its paired phones through a gateway.
pub struct Dispatcher<G: Gateway, R: RegistrationSource> {
    inner: Arc<Inner<G, R>>,
}

impl<G: Gateway, R: RegistrationSource> Clone for Dispatcher<G, R> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// Counts one enqueued dispatch in flight until dropped, even if the task is dropped unrun.
struct InFlight(watch::Sender<usize>);

impl InFlight {
    fn start(counter: &watch::Sender<usize>) -> Self {
        counter.send_modify(|n| *n += 1);
        Self(counter.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl<G: Gateway, R: RegistrationSource> Dispatcher<G, R> {
    pub fn new(gateway: Arc<G>, registrations: Arc<R>, config: DispatchConfig) -> Self {
        Self::with_clock(gateway, registrations, config, Arc::new(system_now_ms))
    }

    /// As [`Dispatcher::new`], reading Unix ms from `clock` (the same shape as the registrar's).
    pub fn with_clock(
        gateway: Arc<G>,
        registrations: Arc<R>,
        config: DispatchConfig,
        clock: Arc<dyn Fn() -> u64 + Send + Sync>,
    ) -> Self {
        let (in_flight, _) = watch::channel(0);
        Self {
            inner: Arc::new(Inner {
                gateway,
                registrations,
                config,
                clock,
                protocol: ProtocolCache::new(config.protocol_ttl),
                bursts: std::sync::Mutex::new(burst::BurstWindows::new(config.burst_window)),
                failures: Arc::new(FailureLog::new(config.failure_log_interval)),
                in_flight,
                closed: AtomicBool::new(false),
                runtime: Handle::try_current().ok(),
            }),
        }
    }

    /// Fire and forget: the work runs on a tokio task. Never panics and never fails; an event that
    /// cannot even be started (after [`Dispatcher::shutdown`], or with no runtime) is counted.
    pub fn enqueue(&self, event: DispatchEvent) {
        if *self.inner.in_flight.borrow() >= self.inner.config.max_in_flight {
            self.inner.failures.record_one("overloaded");
            return;
        }
        // Counted before the closed check, so a shutdown that saw zero in flight also sees closed.
        let guard = InFlight::start(&self.inner.in_flight);
        if self.inner.closed.load(Ordering::SeqCst) {
            self.inner.failures.record_one("dispatcher_closed");
            return;
        }
        let Some(runtime) = Handle::try_current()
            .ok()
            .or_else(|| self.inner.runtime.clone())
        else {
            self.inner.failures.record_one("no_runtime");
            return;
        };
        let inner = Arc::clone(&self.inner);
        runtime.spawn(async move {
            let _guard = guard;
            inner.dispatch(event).await;
        });
    }

    /// The work of [`Dispatcher::enqueue`], awaited.
    pub async fn dispatch(&self, event: DispatchEvent) -> DispatchReport {
        self.inner.dispatch(event).await
    }

    /// Stops taking enqueued events, waits for those in flight (at most
    /// [`DispatchConfig::shutdown_grace`], so a long Retry-After cannot hold up the desktop's
    /// quit), then logs the failure counts not yet logged.
    pub async fn shutdown(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        let mut in_flight = self.inner.in_flight.subscribe();
        let drained = tokio::time::timeout(
            self.inner.config.shutdown_grace,
            in_flight.wait_for(|n| *n == 0),
        )
        .await;
        let mut abandoned = failures::Counts::new();
        if drained.is_err() {
            let left = *self.inner.in_flight.borrow();
            abandoned.insert("shutdown_abandoned".to_owned(), left as u64);
        }
        self.inner.failures.flush_final(abandoned);
    }

    /// Every failure counted since this dispatcher was made, by category.
    pub fn failure_counts(&self) -> BTreeMap<String, u64> {
        self.inner.failures.totals()
    }
}
