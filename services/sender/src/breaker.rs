//! A circuit breaker per provider and per token endpoint. While a provider fails for everyone
//! (refused connections, timeouts, 5xx, throttling, refused credentials), retrying every batch
//! costs a claim, a look-up, an attempt and a report each, for nothing. After
//! [`TRIP_AFTER`] failures in a row the breaker opens: work for that provider is held (the queue
//! moves its pending batches in one statement) and one probe goes out per hold period, which
//! doubles from [`FIRST_HOLD`] up to [`MAX_HOLD`]. The first success closes it and the held work
//! is released at once. A probe is one batch: one lane claims it alone ([`Breaker::claim_probe`]),
//! and the others leave the provider's work alone meanwhile.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures in a row, with no success between them, that open the breaker.
pub const TRIP_AFTER: u32 = 8;
/// The first hold; each failed probe doubles it.
pub const FIRST_HOLD: Duration = Duration::from_secs(2);
/// The longest hold: the backlog waits at most this long after the provider recovers.
pub const MAX_HOLD: Duration = Duration::from_secs(30);
/// How long a lane's claim of a provider's probe keeps the other lanes off that provider's work:
/// the claimed batch reaches its gate and becomes the probe well within it, and a claim that
/// found none of the provider's work due is made again this much later, by whichever lane looks
/// first. Before, every lane claimed the provider's work in full once the hold was over, and all
/// but the probe were handed back one by one, a write each: 96 at one probe in the admission
/// benchmark, 56 ms in which admissions waited for the writer (docs/benchmarks.md, round 47).
pub const PROBE_CLAIM_FOR: Duration = Duration::from_secs(1);

/// What the breaker says of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Closed: go ahead.
    Pass,
    /// Open, and the hold is over: this attempt is the probe.
    Probe,
    /// Open: hand the work back until then.
    Hold(Instant),
}

/// Where an open breaker's probe stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeWait {
    /// Open, its hold over, and no probe out: the batch released to be the probe never reached
    /// the provider (its phone was removed meanwhile, its look-up failed), or the probe ended
    /// telling nothing. Another is needed.
    Needed,
    /// A probe is out.
    Out,
    /// Closed, or holding the work until a later time: nothing to release now.
    Done,
}

/// What a reported result changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    None,
    /// The breaker opened (or a probe failed): hold the provider's work until then.
    Opened(Instant),
    /// A success closed an open breaker: release the held work.
    Closed,
}

#[derive(Debug, Default)]
struct State {
    failures: u32,
    open_until: Option<Instant>,
    probing: bool,
    /// When a lane claimed the probe (`Breaker::claim_probe`), if it did within
    /// [`PROBE_CLAIM_FOR`] and the probe is not out yet.
    probe_claimed: Option<Instant>,
    /// Holds in a row (1 for the first), for the doubling.
    holds: u32,
}

#[derive(Debug)]
pub struct Breaker {
    name: &'static str,
    state: Mutex<State>,
}

fn hold_for(holds: u32) -> Duration {
    let factor = 1u32 << holds.saturating_sub(1).min(10);
    FIRST_HOLD.saturating_mul(factor).min(MAX_HOLD)
}

impl Breaker {
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether an attempt may go now.
    pub fn gate(&self, now: Instant) -> Gate {
        let mut s = self.state();
        match s.open_until {
            None => Gate::Pass,
            Some(until) if now < until => Gate::Hold(until),
            // One probe at a time; the rest wait for its answer.
            Some(_) if s.probing => Gate::Hold(now + FIRST_HOLD),
            Some(_) => {
                s.probing = true;
                s.probe_claimed = None;
                Gate::Probe
            }
        }
    }

    /// Whether the caller may claim the probe's batch now, alone: the breaker is open, its hold
    /// is over, no probe is out, and no other lane claimed one in the last [`PROBE_CLAIM_FOR`].
    /// True marks the probe claimed: the provider's work stays held for every lane
    /// ([`Breaker::held_until`]) while the caller claims one batch of it.
    pub fn claim_probe(&self, now: Instant) -> bool {
        let mut s = self.state();
        let free = match s.open_until {
            Some(until) => now >= until && !s.probing && !s.probe_claim_out(now),
            None => false,
        };
        if free {
            s.probe_claimed = Some(now);
        }
        free
    }

    /// The provider answered as it should (sent, a dead token, a refused payload).
    pub fn success(&self) -> Change {
        let mut s = self.state();
        let was_open = s.open_until.is_some();
        *s = State::default();
        if was_open {
            tracing::info!(
                provider = self.name,
                "provider answers again: circuit closed"
            );
            metrics::gauge!("orca_push_provider_circuit_open", "provider" => self.name).set(0.0);
            Change::Closed
        } else {
            Change::None
        }
    }

    /// The provider failed in a way that would fail for everyone.
    pub fn failure(&self, now: Instant) -> Change {
        self.failure_of(now, true)
    }

    /// [`Breaker::failure`] of one attempt, saying whether it was the probe: while a probe is
    /// out, only its own failure holds the work again. A request sent before the breaker opened
    /// that fails late (a stalled connection timing out) says nothing the trip did not.
    pub fn failure_of(&self, now: Instant, probe: bool) -> Change {
        let mut s = self.state();
        s.failures = s.failures.saturating_add(1);
        let reopen = (s.probing && probe) || (s.open_until.is_none() && s.failures >= TRIP_AFTER);
        if !reopen {
            return Change::None;
        }
        s.probing = false;
        s.probe_claimed = None;
        s.holds = s.holds.saturating_add(1);
        let until = now + hold_for(s.holds);
        s.open_until = Some(until);
        if s.holds == 1 {
            tracing::warn!(
                provider = self.name,
                failures = s.failures,
                "provider failing for everyone: circuit open, holding its work"
            );
            metrics::counter!("orca_push_provider_circuit_opened_total", "provider" => self.name)
                .increment(1);
            metrics::gauge!("orca_push_provider_circuit_open", "provider" => self.name).set(1.0);
        }
        Change::Opened(until)
    }

    /// A probe that ended without telling anything (the lane stopped): another may go.
    pub fn probe_abandoned(&self) {
        self.state().probing = false;
    }

    /// What the breaker waits for now, as far as probes go (see [`ProbeWait`]).
    pub fn probe_wait(&self, now: Instant) -> ProbeWait {
        let s = self.state();
        match s.open_until {
            Some(until) if now >= until && s.probing => ProbeWait::Out,
            Some(until) if now >= until => ProbeWait::Needed,
            _ => ProbeWait::Done,
        }
    }

    pub fn is_open(&self) -> bool {
        self.state().open_until.is_some()
    }

    /// Until when the provider's work is held, if it is now: during the hold, while a lane
    /// claims its probe, and while its probe is out (until the next look, as `gate` answers the
    /// work it meets then). Between the hold and the probe's claim, a lane claims the probe
    /// ([`Breaker::claim_probe`]). Claimed while a probe is out (a stalled connection keeps one
    /// out for up to 30 s), every batch would only be handed back, every 2 s.
    pub fn held_until(&self, now: Instant) -> Option<Instant> {
        let s = self.state();
        match s.open_until {
            Some(until) if now < until => Some(until),
            Some(_) if s.probing => Some(now + FIRST_HOLD),
            Some(_) if s.probe_claim_out(now) => s.probe_claimed.map(|at| at + PROBE_CLAIM_FOR),
            _ => None,
        }
    }
}

impl State {
    /// A lane claimed the probe lately, and the probe is not out yet.
    fn probe_claim_out(&self, now: Instant) -> bool {
        self.probe_claimed
            .is_some_and(|at| now < at + PROBE_CLAIM_FOR)
    }
}

/// Held while a probe is out: dropped before its result was recorded (the attempt was cancelled,
/// handed back, or answered in a way that says nothing of the provider), it lets another probe go
/// instead of leaving the breaker waiting for an answer that will never come.
pub struct ProbeGuard<'a> {
    breaker: &'a Breaker,
    armed: bool,
}

impl<'a> ProbeGuard<'a> {
    pub fn new(breaker: &'a Breaker) -> Self {
        Self {
            breaker,
            armed: true,
        }
    }

    /// The probe's result was recorded (success or failure).
    pub fn recorded(mut self) {
        self.armed = false;
    }
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.breaker.probe_abandoned();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_failures_in_a_row_and_not_before() {
        let b = Breaker::new("apns");
        let t = Instant::now();
        for _ in 0..TRIP_AFTER - 1 {
            assert_eq!(b.failure(t), Change::None);
        }
        assert_eq!(b.gate(t), Gate::Pass);
        assert_eq!(b.failure(t), Change::Opened(t + FIRST_HOLD));
        assert_eq!(b.gate(t), Gate::Hold(t + FIRST_HOLD));
    }

    #[test]
    fn work_is_held_until_the_probe_is_due_and_not_after() {
        let b = Breaker::new("fcm");
        let t = Instant::now();
        assert_eq!(b.held_until(t), None);
        for _ in 0..TRIP_AFTER {
            b.failure(t);
        }
        assert_eq!(b.held_until(t), Some(t + FIRST_HOLD));
        // At the probe's time the lanes claim the provider's work again.
        assert_eq!(b.held_until(t + FIRST_HOLD), None);
        // And held again while the probe is out, until its answer.
        let probing = t + FIRST_HOLD;
        assert_eq!(b.gate(probing), Gate::Probe);
        let later = probing + Duration::from_secs(20);
        assert_eq!(b.held_until(later), Some(later + FIRST_HOLD));
        b.success();
        assert_eq!(b.held_until(later), None);
    }

    #[test]
    fn one_lane_at_a_time_claims_the_probe_and_the_others_leave_the_work_alone() {
        let b = Breaker::new("fcm");
        let t = Instant::now();
        assert!(!b.claim_probe(t), "closed: nothing to probe");
        for _ in 0..TRIP_AFTER {
            b.failure(t);
        }
        assert!(!b.claim_probe(t), "held");
        let due = t + FIRST_HOLD;
        assert!(b.claim_probe(due), "the first lane to look claims it");
        assert!(!b.claim_probe(due), "and no other lane");
        assert_eq!(
            b.held_until(due),
            Some(due + PROBE_CLAIM_FOR),
            "the others leave the provider's work alone meanwhile"
        );
        // A claim that found none of the provider's work, or whose batch never reached its gate,
        // lets a lane claim again once it is stale.
        let stale = due + PROBE_CLAIM_FOR;
        assert_eq!(b.held_until(stale), None);
        assert!(b.claim_probe(stale));
        // The claimed batch reaches its gate: it is the probe, and while it is out no lane claims.
        assert_eq!(b.gate(stale), Gate::Probe);
        let later = stale + PROBE_CLAIM_FOR * 2;
        assert!(!b.claim_probe(later), "a probe is out");
        assert_eq!(b.held_until(later), Some(later + FIRST_HOLD));
        // It failed: held again, and the next hold's end brings the next claim.
        assert!(matches!(b.failure_of(later, true), Change::Opened(_)));
        assert!(!b.claim_probe(later));
        assert!(b.claim_probe(later + MAX_HOLD));
    }

    #[test]
    fn a_probe_is_awaited_from_the_holds_end_until_one_goes_out() {
        let b = Breaker::new("apns");
        let t = Instant::now();
        assert_eq!(b.probe_wait(t), ProbeWait::Done, "closed");
        for _ in 0..TRIP_AFTER {
            b.failure(t);
        }
        assert_eq!(b.probe_wait(t), ProbeWait::Done, "held");
        let due = t + FIRST_HOLD;
        assert_eq!(b.probe_wait(due), ProbeWait::Needed);
        assert_eq!(b.gate(due), Gate::Probe);
        assert_eq!(b.probe_wait(due), ProbeWait::Out);
        b.probe_abandoned();
        assert_eq!(b.probe_wait(due), ProbeWait::Needed, "it told nothing");
        assert_eq!(b.gate(due), Gate::Probe);
        b.failure(due);
        assert_eq!(b.probe_wait(due), ProbeWait::Done, "held again");
        b.success();
        assert_eq!(b.probe_wait(due + MAX_HOLD), ProbeWait::Done, "closed");
    }

    #[test]
    fn while_a_probe_is_out_only_its_own_failure_holds_again() {
        let b = Breaker::new("apns");
        let t = Instant::now();
        for _ in 0..TRIP_AFTER {
            b.failure(t);
        }
        let due = t + FIRST_HOLD;
        assert_eq!(b.gate(due), Gate::Probe);
        // A request from before the trip times out now: the probe is still the one out.
        assert_eq!(b.failure_of(due, false), Change::None);
        assert!(matches!(b.gate(due), Gate::Hold(_)), "no second probe");
        assert_eq!(
            b.failure_of(due, true),
            Change::Opened(due + FIRST_HOLD * 2)
        );
    }

    #[test]
    fn a_success_between_failures_keeps_it_closed() {
        let b = Breaker::new("apns");
        let t = Instant::now();
        for _ in 0..10 {
            for _ in 0..TRIP_AFTER - 1 {
                b.failure(t);
            }
            assert_eq!(b.success(), Change::None);
        }
        assert_eq!(b.gate(t), Gate::Pass);
    }

    #[test]
    fn one_probe_per_hold_and_the_hold_doubles_up_to_the_cap() {
        let b = Breaker::new("fcm");
        let mut t = Instant::now();
        for _ in 0..TRIP_AFTER {
            b.failure(t);
        }
        let mut hold = FIRST_HOLD;
        for _ in 0..8 {
            t += hold;
            assert_eq!(b.gate(t), Gate::Probe);
            assert!(matches!(b.gate(t), Gate::Hold(_)), "one probe at a time");
            hold = (hold * 2).min(MAX_HOLD);
            assert_eq!(b.failure(t), Change::Opened(t + hold));
        }
        assert_eq!(hold, MAX_HOLD);
        t += hold;
        assert_eq!(b.gate(t), Gate::Probe);
        assert_eq!(b.success(), Change::Closed);
        assert_eq!(b.gate(t), Gate::Pass);
        assert!(!b.is_open());
    }

    #[test]
    fn a_probe_dropped_without_a_result_lets_another_go() {
        let b = Breaker::new("apns");
        let t = Instant::now();
        for _ in 0..TRIP_AFTER {
            b.failure(t);
        }
        let later = t + FIRST_HOLD;
        assert_eq!(b.gate(later), Gate::Probe);
        drop(ProbeGuard::new(&b));
        assert_eq!(b.gate(later), Gate::Probe, "the dropped probe was released");
        let guard = ProbeGuard::new(&b);
        b.failure(later);
        guard.recorded();
        assert!(
            matches!(b.gate(later), Gate::Hold(_)),
            "a recorded failure holds again"
        );
    }

    #[test]
    fn an_abandoned_probe_lets_another_go() {
        let b = Breaker::new("fcm");
        let t = Instant::now();
        for _ in 0..TRIP_AFTER {
            b.failure(t);
        }
        let later = t + FIRST_HOLD;
        assert_eq!(b.gate(later), Gate::Probe);
        b.probe_abandoned();
        assert_eq!(b.gate(later), Gate::Probe);
    }
}
