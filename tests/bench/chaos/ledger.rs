//! What the hosts were told and what the providers saw, per phone and event: every send attempt
//! with its answer, every `queued` recipient, and every provider arrival with its collapse id.
//! The figures of a chaos run are counted from it, never estimated.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use orca_push_tests::Arrival;

/// How long the gateway keeps an event deliverable: its default deadline, five minutes after first
/// acceptance (the contract's cap; the chaos load sets no `expiresAt`).
pub const EVENT_LIFETIME: Duration = Duration::from_secs(300);

/// One phone and one event: (notificationId, device token). Every chaos notificationId is unique,
/// so it stands for the event identity (host, epoch, seq).
pub type Key = (String, String);

/// How one request ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// HTTP 200 and every recipient `queued`.
    Queued,
    /// HTTP 200, but some recipient had another status (`error`, `rate_limited`, `dead`).
    Refused(String),
    /// No answer with results: an HTTP error (`503 dependency_unavailable`, `500 internal`, ...),
    /// a timeout or a broken connection. The host retries with the same body.
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct Attempt {
    pub started: Instant,
    pub ended: Instant,
    pub outcome: Outcome,
}

#[derive(Default)]
struct Books {
    accepted: HashMap<Key, Instant>,
    arrivals: HashMap<Key, Vec<(Instant, Option<String>)>>,
    unidentified_arrivals: u64,
    attempts: Vec<Attempt>,
    events: u64,
    /// Events whose host stopped retrying at its deadline without an answer.
    gave_up: u64,
}

#[derive(Default)]
pub struct Ledger {
    books: Mutex<Books>,
}

/// The counts of a chaos run.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub events: u64,
    pub gave_up: u64,
    pub attempts: u64,
    pub accepted: u64,
    pub delivered: u64,
    /// Accepted, not delivered, and its deadline still ahead when the wait ended.
    pub lost: u64,
    /// Accepted, not delivered, and past its deadline when the wait ended.
    pub expired_undelivered: u64,
    /// Arrivals for a phone and event that was never answered `queued` (the host gave up).
    pub delivered_unconfirmed: u64,
    pub unidentified_arrivals: u64,
    /// Arrivals beyond the first per phone and event.
    pub duplicates: u64,
    /// Phone-and-event pairs that arrived more than once.
    pub duplicated_pairs: u64,
    /// Repeats whose collapse id differs from the first arrival's (or is missing).
    pub duplicates_with_other_collapse_id: u64,
    /// Repeats with no disruption (kill, database outage) between the first arrival and them: none
    /// began before the repeat and was still going on at the first arrival (see `tally`).
    pub duplicates_without_disruption_between: u64,
    /// The longest time from a duplicated pair's first arrival to the start of the next disruption
    /// (0 if it arrived during one).
    pub duplicate_first_to_disruption_max_ms: f64,
    /// Failed and refused attempts by kind.
    pub failures: BTreeMap<String, u64>,
}

impl Ledger {
    pub fn event_sent(&self) {
        self.books.lock().unwrap().events += 1;
    }

    pub fn gave_up(&self) {
        self.books.lock().unwrap().gave_up += 1;
    }

    pub fn attempt(&self, attempt: Attempt) {
        self.books.lock().unwrap().attempts.push(attempt);
    }

    /// `token` has `notification_id` queued: the first answer counts, retries keep it.
    pub fn accepted(&self, notification_id: &str, token: &str, at: Instant) {
        self.books
            .lock()
            .unwrap()
            .accepted
            .entry((notification_id.to_owned(), token.to_owned()))
            .or_insert(at);
    }

    pub fn arrived(&self, arrivals: Vec<Arrival>) {
        let mut books = self.books.lock().unwrap();
        for arrival in arrivals {
            match arrival.notification_id {
                Some(id) => books
                    .arrivals
                    .entry((id, arrival.token))
                    .or_default()
                    .push((arrival.at, arrival.collapse_id)),
                None => books.unidentified_arrivals += 1,
            }
        }
    }

    /// Accepted pairs not delivered yet.
    pub fn outstanding(&self) -> usize {
        let books = self.books.lock().unwrap();
        books
            .accepted
            .keys()
            .filter(|k| !books.arrivals.contains_key(*k))
            .count()
    }

    /// The latest deadline of an accepted pair not delivered yet.
    pub fn last_outstanding_deadline(&self) -> Option<Instant> {
        let books = self.books.lock().unwrap();
        books
            .accepted
            .iter()
            .filter(|(k, _)| !books.arrivals.contains_key(*k))
            .map(|(_, at)| *at + EVENT_LIFETIME)
            .max()
    }

    pub fn attempts(&self) -> Vec<Attempt> {
        self.books.lock().unwrap().attempts.clone()
    }

    /// The counts, with `disruptions` (each from its start to its end, in order: a kill is an
    /// instant, a database outage lasts from its stop until the server accepts again) to place
    /// duplicates. A repeat is across a disruption if its first arrival came before the
    /// disruption began and the repeat after, or its first arrival during the disruption and the
    /// repeat after it ended: a delivery under way when the database stopped reaches the provider
    /// during the outage, and its repeat, after a lease lost in the crash, follows the restart.
    /// Two arrivals both during an outage are not: nothing is claimed then, so both were under way
    /// at once.
    pub fn tally(&self, disruptions: &[(Instant, Instant)]) -> Tally {
        let books = self.books.lock().unwrap();
        let now = Instant::now();
        let mut tally = Tally {
            events: books.events,
            gave_up: books.gave_up,
            attempts: books.attempts.len() as u64,
            accepted: books.accepted.len() as u64,
            unidentified_arrivals: books.unidentified_arrivals,
            ..Tally::default()
        };
        for attempt in &books.attempts {
            match &attempt.outcome {
                Outcome::Queued => {}
                Outcome::Refused(kind) | Outcome::Failed(kind) => {
                    *tally.failures.entry(kind.clone()).or_default() += 1;
                }
            }
        }
        for (key, at) in &books.accepted {
            if books.arrivals.contains_key(key) {
                tally.delivered += 1;
            } else if now >= *at + EVENT_LIFETIME {
                tally.expired_undelivered += 1;
            } else {
                tally.lost += 1;
            }
        }
        for (key, seen) in &books.arrivals {
            if !books.accepted.contains_key(key) {
                tally.delivered_unconfirmed += 1;
            }
            let Some(((first_at, first_collapse), repeats)) = seen.split_first() else {
                continue;
            };
            if repeats.is_empty() {
                continue;
            }
            tally.duplicated_pairs += 1;
            tally.duplicates += repeats.len() as u64;
            let next_disruption = disruptions.iter().find(|(_, end)| *end >= *first_at);
            if let Some((start, _)) = next_disruption {
                let gap = start.saturating_duration_since(*first_at).as_secs_f64() * 1000.0;
                tally.duplicate_first_to_disruption_max_ms =
                    tally.duplicate_first_to_disruption_max_ms.max(gap);
            }
            for (at, collapse) in repeats {
                if first_collapse.is_none() || collapse != first_collapse {
                    tally.duplicates_with_other_collapse_id += 1;
                }
                let across = disruptions.iter().any(|(start, end)| {
                    let straddles = *first_at < *start && *start <= *at;
                    let outlasts = *start <= *first_at && *first_at <= *end && *end < *at;
                    straddles || outlasts
                });
                if !across {
                    tally.duplicates_without_disruption_between += 1;
                }
            }
        }
        tally
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival(id: &str, at: Instant) -> Arrival {
        Arrival {
            provider: "apns",
            notification_id: Some(id.to_owned()),
            token: "token".to_owned(),
            collapse_id: Some(format!("c-{id}")),
            at,
        }
    }

    /// Repeats are placed against each disruption's whole span: one whose first copy arrived
    /// before or during an outage and whose repeat came after its start is across it; one whose
    /// first copy came after the outage ended is not.
    #[test]
    fn a_repeat_is_across_an_outage_its_first_copy_arrived_before_or_during() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let outage = (ms(1_000), ms(6_000));
        let ledger = Ledger::default();
        ledger.arrived(vec![
            // Before the stop, again after the restart.
            arrival("before", ms(900)),
            arrival("before", ms(6_100)),
            // A delivery under way at the stop, reaching the provider during the outage.
            arrival("during", ms(1_004)),
            arrival("during", ms(6_100)),
            // Both after the outage: no disruption explains it.
            arrival("after", ms(6_500)),
            arrival("after", ms(7_000)),
            // Both before it.
            arrival("early", ms(100)),
            arrival("early", ms(200)),
            // Both during it: two copies under way at once, which no outage explains.
            arrival("twice", ms(1_002)),
            arrival("twice", ms(1_003)),
        ]);
        let tally = ledger.tally(&[outage]);
        assert_eq!((tally.duplicated_pairs, tally.duplicates), (5, 5));
        assert_eq!(tally.duplicates_without_disruption_between, 3);
        assert_eq!(tally.duplicates_with_other_collapse_id, 0);
        assert_eq!(tally.duplicate_first_to_disruption_max_ms, 900.0);
        // A kill is an instant: a first copy after it is not across it.
        let kill = (ms(1_000), ms(1_000));
        assert_eq!(
            ledger.tally(&[kill]).duplicates_without_disruption_between,
            4
        );
    }
}
