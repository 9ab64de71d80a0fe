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
            // A timer is about to log what is pending (its time has come, it has not run yet):
            // logging here too would make two lines within the interval.
            _ if state.flush_scheduled => {}
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure that comes when the interval is up but before the timer has logged leaves its
    /// count to that timer: one line, not two within the interval.
    #[tokio::test(start_paused = true)]
    async fn a_failure_as_the_timer_comes_due_waits_for_it() {
        let (lines, _guard) = crate::dispatch::tests::capture::start();
        let log = Arc::new(FailureLog::new(Duration::from_secs(60)));
        log.record_one("a");
        assert_eq!(lines.get().len(), 1);
        tokio::time::sleep(Duration::from_secs(10)).await;
        log.record_one("b");
        // The interval is up, and the timer has not run yet.
        {
            let mut state = log.state();
            assert!(state.flush_scheduled);
            state.last_logged = Instant::now().checked_sub(Duration::from_secs(61));
        }
        log.record_one("c");
        assert_eq!(lines.get().len(), 1, "left to the timer");
        tokio::time::sleep(Duration::from_secs(60)).await;
        let got = lines.get();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            got[1].contains("b=1") && got[1].contains("c=1"),
            "{}",
            got[1]
        );
    }
}
