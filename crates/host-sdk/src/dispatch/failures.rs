//! Failure counting: categories only (never a token, title, body or id), logged at most once per
//! interval so a dead gateway does not flood the desktop's log, with a final flush on shutdown.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;

pub(super) type Counts = BTreeMap<String, u64>;

/// One dispatch's failures: all of them for its report, and those not yet handed to the log
/// (handed over before a retry's wait and at the end, so counts never lag behind a sleep).
#[derive(Default)]
pub(super) struct Tally {
    all: Counts,
    unrecorded: Counts,
}

impl Tally {
    pub(super) fn add(&mut self, key: impl Into<String>) {
        self.add_n(key, 1);
    }

    pub(super) fn add_n(&mut self, key: impl Into<String>, n: u64) {
        let key = key.into();
        *self.all.entry(key.clone()).or_insert(0) += n;
        *self.unrecorded.entry(key).or_insert(0) += n;
    }

    pub(super) fn into_counts(self) -> Counts {
        self.all
    }
}

pub(super) struct FailureLog {
    interval: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    totals: Counts,
    /// Counted since the last log line.
    pending: Counts,
    last_logged: Option<Instant>,
    /// A timer will log `pending` when the interval is up.
    flush_scheduled: bool,
}

impl State {
    fn add(&mut self, counts: Counts) {
        for (key, n) in counts {
            *self.totals.entry(key.clone()).or_insert(0) += n;
            *self.pending.entry(key).or_insert(0) += n;
        }
    }
}

impl FailureLog {
    pub(super) fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn totals(&self) -> Counts {
        self.state().totals.clone()
    }

    pub(super) fn record_one(self: &Arc<Self>, key: &str) {
        self.record(Counts::from([(key.to_owned(), 1)]));
    }

    /// Hands the tally's new counts to the log.
    pub(super) fn record_tally(self: &Arc<Self>, tally: &mut Tally) {
        self.record(std::mem::take(&mut tally.unrecorded));
    }

    /// Adds `counts`; logs now if the interval since the last line is up, else makes sure a timer
    /// logs them when it is.
    fn record(self: &Arc<Self>, counts: Counts) {
        if counts.is_empty() {
            return;
        }
        let mut state = self.state();
        state.add(counts);
        let now = Instant::now();
        let due = state.last_logged.map(|at| at + self.interval);
        match due {
            Some(due) if due > now => {
                if !state.flush_scheduled
                    && let Ok(runtime) = Handle::try_current()
                {
                    state.flush_scheduled = true;
                    let log = Arc::clone(self);
                    runtime.spawn(async move {
                        tokio::time::sleep_until(due).await;
                        log.flush_due();
                    });
                }
                // Without a runtime the counts wait for the next failure or for shutdown.
            }
            _ => {
                let lines = std::mem::take(&mut state.pending);
                state.last_logged = Some(now);
                drop(state);
                emit(&lines, false);
            }
        }
    }

    fn flush_due(&self) {
        let mut state = self.state();
        state.flush_scheduled = false;
        if state.pending.is_empty() {
            return;
        }
        let lines = std::mem::take(&mut state.pending);
        state.last_logged = Some(Instant::now());
        drop(state);
        emit(&lines, false);
    }

    /// Shutdown: `counts` and whatever has not been logged yet, now, in one line.
    pub(super) fn flush_final(&self, counts: Counts) {
        let mut state = self.state();
        state.add(counts);
        if state.pending.is_empty() {
            return;
        }
        let lines = std::mem::take(&mut state.pending);
        state.last_logged = Some(Instant::now());
        drop(state);
        emit(&lines, true);
    }
}

/// `category=count` pairs; the categories are fixed words, never payload.
fn summary(counts: &Counts) -> String {
    counts
        .iter()
        .map(|(key, n)| format!("{key}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn emit(counts: &Counts, last: bool) {
    let failures = summary(counts);
    if last {
        tracing::warn!(%failures, "push dispatch failures (final, on shutdown)");
    } else {
        tracing::warn!(%failures, "push dispatch failures since the last report");
    }
}
