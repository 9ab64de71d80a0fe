//! The dispatcher against a scripted gateway and an in-memory registration source, on tokio's
//! paused clock so the 2 s retry, Retry-After and the log interval take no real time.

mod batching;
mod burst;
mod filter;
mod lifecycle;
mod logging;
mod protocol;
mod retry;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use orca_push_api::{
    ErrorCode, Health, Kind, Platform, RegisterReply, RegisterRequest, SendReply, SendRequest,
    SendResult, SendStatus, Source,
};
use tokio::time::Instant;

use super::{DispatchConfig, DispatchEvent, Dispatcher};
use crate::{Gateway, GatewayError, HostFilter, Registration, RegistrationSource};

/// Unix ms at the start of every test.
pub(super) const BASE_MS: u64 = 1_700_000_000_000;

type Answer = Box<dyn Fn(&SendRequest) -> Result<SendReply, GatewayError> + Send>;

/// A gateway that answers `send` from a script (then "queued" for everyone) and `health` with a
/// settable protocol, recording every call with its tokio time.
pub(super) struct FakeGateway {
    /// `None`: health fails with 503 busy.
    protocol: Mutex<Option<u32>>,
    script: Mutex<VecDeque<Answer>>,
    pub(super) sends: Mutex<Vec<(Instant, SendRequest)>>,
    pub(super) health_calls: AtomicUsize,
}

impl FakeGateway {
    pub(super) fn new(protocol: u32) -> Self {
        Self {
            protocol: Mutex::new(Some(protocol)),
            script: Mutex::new(VecDeque::new()),
            sends: Mutex::new(Vec::new()),
            health_calls: AtomicUsize::new(0),
        }
    }

    pub(super) fn set_protocol(&self, protocol: Option<u32>) {
        *self.protocol.lock().unwrap() = protocol;
    }

    /// The next `send` answers with `answer`.
    pub(super) fn then(
        &self,
        answer: impl Fn(&SendRequest) -> Result<SendReply, GatewayError> + Send + 'static,
    ) {
        self.script.lock().unwrap().push_back(Box::new(answer));
    }

    /// The next `send` fails with this API error.
    pub(super) fn then_err(&self, status: u16, code: ErrorCode, retry_after: Option<Duration>) {
        self.then(move |_| {
            Err(GatewayError::Api {
                status,
                code,
                retry_after,
            })
        });
    }

    pub(super) fn sends(&self) -> Vec<(Instant, SendRequest)> {
        self.sends.lock().unwrap().clone()
    }

    pub(super) fn requests(&self) -> Vec<SendRequest> {
        self.sends().into_iter().map(|(_, r)| r).collect()
    }

    pub(super) fn health_calls(&self) -> usize {
        self.health_calls.load(Ordering::SeqCst)
    }
}

/// Every id of the request with `status`, in the request's order.
pub(super) fn all(request: &SendRequest, status: SendStatus) -> SendReply {
    SendReply {
        results: request
            .distinct_ids()
            .into_iter()
            .map(|registration_id| SendResult {
                registration_id,
                status,
            })
            .collect(),
    }
}

impl Gateway for FakeGateway {
    async fn register(&self, _: &RegisterRequest) -> Result<RegisterReply, GatewayError> {
        Err(GatewayError::Malformed("not scripted"))
    }

    async fn unregister(&self, _: &str) -> Result<(), GatewayError> {
        Err(GatewayError::Malformed("not scripted"))
    }

    async fn send(&self, request: &SendRequest) -> Result<SendReply, GatewayError> {
        self.sends
            .lock()
            .unwrap()
            .push((Instant::now(), request.clone()));
        let answer = self.script.lock().unwrap().pop_front();
        match answer {
            Some(answer) => answer(request),
            None => Ok(all(request, SendStatus::Queued)),
        }
    }

    async fn health(&self) -> Result<Health, GatewayError> {
        self.health_calls.fetch_add(1, Ordering::SeqCst);
        match *self.protocol.lock().unwrap() {
            Some(delivery_protocol) => Ok(Health {
                ok: true,
                push_protocol: 1,
                delivery_protocol,
                mode: None,
            }),
            None => Err(GatewayError::Api {
                status: 503,
                code: ErrorCode::Busy,
                retry_after: None,
            }),
        }
    }
}

/// A change to the stored registrations, made right after `active` answers.
type Change = Box<dyn FnMut(&mut Vec<Registration>) + Send>;

/// Registrations in memory; `drop_dead` keeps the contract's same-target rule.
#[derive(Default)]
pub(super) struct FakeSource {
    pub(super) registrations: Mutex<Vec<Registration>>,
    pub(super) drop_calls: Mutex<Vec<Registration>>,
    /// Called after `active` returns: a phone re-registering while a send is in flight.
    pub(super) after_active: Mutex<Option<Change>>,
}

impl FakeSource {
    pub(super) fn new(registrations: Vec<Registration>) -> Self {
        Self {
            registrations: Mutex::new(registrations),
            ..Self::default()
        }
    }

    pub(super) fn stored(&self) -> Vec<Registration> {
        self.registrations.lock().unwrap().clone()
    }
}

impl RegistrationSource for FakeSource {
    /// Everything stored, expired or not, so the dispatcher's own expiry check is visible.
    fn active(&self, _now_ms: u64) -> Vec<Registration> {
        let mut stored = self.registrations.lock().unwrap();
        let snapshot = stored.clone();
        if let Some(change) = self.after_active.lock().unwrap().as_mut() {
            change(&mut stored);
        }
        snapshot
    }

    fn drop_dead(&self, sent: &Registration) -> bool {
        self.drop_calls.lock().unwrap().push(sent.clone());
        let mut stored = self.registrations.lock().unwrap();
        let before = stored.len();
        stored.retain(|r| !r.same_target(sent));
        stored.len() != before
    }
}

/// Phone `n`: an Android phone taking everything, registered at the start of the test.
pub(super) fn phone(n: usize) -> Registration {
    Registration {
        device_id: format!("device-{n}"),
        registration_id: format!("reg-{n}"),
        platform: Platform::Android,
        token: format!("secret-token-{n:04}-{}", "x".repeat(32)),
        apns_environment: None,
        filter: HostFilter::everything(),
        registered_at: BASE_MS,
    }
}

pub(super) fn phones(n: usize) -> Vec<Registration> {
    (0..n).map(phone).collect()
}

pub(super) fn with_filter(n: usize, change: impl FnOnce(&mut HostFilter)) -> Registration {
    let mut r = phone(n);
    change(&mut r.filter);
    r
}

/// A finished agent task, emitted `at_ms` after the start of the test.
pub(super) fn event(at_ms: u64) -> DispatchEvent {
    DispatchEvent {
        notification_id: Some("secret-notification-id".to_owned()),
        notification_seq: at_ms,
        notification_epoch: "secret-epoch".to_owned(),
        source: Source::AgentTaskComplete,
        agent_state: Some("done".to_owned()),
        title: "Secret title".to_owned(),
        body: "Secret body".to_owned(),
        worktree_id: Some("secret-worktree".to_owned()),
        kind: Kind::Alert,
        expires_at: None,
        emitted_at: Some(BASE_MS + at_ms),
        desktop_allowed: true,
    }
}

pub(super) fn config() -> DispatchConfig {
    DispatchConfig::default()
}

pub(super) struct Harness {
    pub(super) dispatcher: Dispatcher<FakeGateway, FakeSource>,
    pub(super) gateway: Arc<FakeGateway>,
    pub(super) source: Arc<FakeSource>,
}

/// A dispatcher whose wall clock is `BASE_MS` plus tokio's (paused) time since it was made.
pub(super) fn harness(registrations: Vec<Registration>, protocol: u32) -> Harness {
    let gateway = Arc::new(FakeGateway::new(protocol));
    let source = Arc::new(FakeSource::new(registrations));
    let start = Instant::now();
    let clock = Arc::new(move || BASE_MS + start.elapsed().as_millis() as u64);
    let dispatcher =
        Dispatcher::with_clock(Arc::clone(&gateway), Arc::clone(&source), config(), clock);
    Harness {
        dispatcher,
        gateway,
        source,
    }
}

pub(super) fn ids(request: &SendRequest) -> Vec<&str> {
    request
        .registration_ids
        .iter()
        .map(String::as_str)
        .collect()
}

/// The notification's JSON as the gateway would read it.
pub(super) fn json(request: &SendRequest) -> serde_json::Value {
    serde_json::to_value(&request.notification).unwrap()
}

/// A subscriber that keeps every event's level, message and fields as text.
pub(super) mod capture {
    use std::fmt::Write as _;
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    #[derive(Clone, Default)]
    pub(in crate::dispatch) struct Lines(pub(in crate::dispatch) Arc<Mutex<Vec<String>>>);

    impl Lines {
        pub(in crate::dispatch) fn get(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
    }

    struct Text(String);

    impl Visit for Text {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            let _ = write!(self.0, "{}={:?} ", field.name(), value);
        }
    }

    thread_local! {
        static HERE: std::cell::RefCell<Option<Lines>> = const { std::cell::RefCell::new(None) };
    }

    /// The binary's one subscriber: it keeps the events of the threads that started a capture.
    ///
    /// A scoped subscriber (`set_default`) is not enough: tracing registers a call site when it is
    /// first reached after some subscriber exists, and while one scoped subscriber is the only one
    /// alive it asks the reaching thread's own default. A parallel test with none could so mark an
    /// event as never wanted, and the capturing test would miss it.
    struct ThreadLines;

    impl Subscriber for ThreadLines {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            // `try_with`: an event while a thread's locals are torn down is dropped.
            let _ = HERE.try_with(|here| {
                if let Some(lines) = &*here.borrow() {
                    let mut text = Text(format!("{} ", event.metadata().level()));
                    event.record(&mut text);
                    lines.0.lock().unwrap().push(text.0);
                }
            });
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// Ends this thread's capture when dropped.
    pub(in crate::dispatch) struct Capturing;

    impl Drop for Capturing {
        fn drop(&mut self) {
            HERE.set(None);
        }
    }

    /// Captures this thread's events (the paused-clock runtime runs every task on it).
    pub(in crate::dispatch) fn start() -> (Lines, Capturing) {
        static INSTALLED: std::sync::Once = std::sync::Once::new();
        INSTALLED.call_once(|| {
            tracing::subscriber::set_global_default(ThreadLines)
                .expect("no other subscriber in this binary");
            // A call site another test reached between the subscriber's registration and its
            // install as the default was asked of no subscriber: ask again.
            tracing::callsite::rebuild_interest_cache();
        });
        let lines = Lines::default();
        HERE.set(Some(lines.clone()));
        (lines, Capturing)
    }
}
