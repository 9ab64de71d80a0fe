//! SQLite's quota counts, kept in memory by its one writer.
//!
//! A host's quota use is the number of its events of a kind accepted in the last 15 minutes. On
//! PostgreSQL each admission counts them in `push_events_quota`, inside the transaction that holds
//! the host's lock. On SQLite the queue's one writer admits every event, so it keeps each host's
//! acceptance times of the window here instead: the index is gone from SQLite (queue migration
//! 0008), and with it a random leaf page that every admission wrote (30% of the pages a commit
//! wrote at the admission benchmark's peak, docs/benchmarks.md, round 49) and the count's walk
//! through up to 300 entries per admission.
//!
//! The table stays the truth: the ledger is read from `push_events` on the writer's first round
//! (`accepted_at` inside the window, through `push_events_accepted`), and again when the clock went
//! back past what the ledger kept. A round counts what committed rounds left plus its own
//! admissions so far (`RoundQuota`), and adds them to the ledger only once its transaction
//! committed: a round rolled back leaves no trace. A round whose commit failed may still have
//! committed: the next round counts the window's events in the table (an index-only count) and
//! finds which it was, or reads the ledger again if neither fits. One process owns a SQLite queue
//! (README, "Deploy"); a second writer on the same file would not be counted.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::sql::{Exec, Row as _, Stmt};
use crate::model::{Kind, QUOTA_WINDOW_MS};

/// Events accepted this long before a window's start stay in the ledger, so that a clock stepping
/// back by less does not make it read the table again.
const KEPT_BEFORE_WINDOW_MS: i64 = 60_000;

/// How often hosts with nothing left in the window are dropped.
const SWEEP_EVERY_MS: i64 = 60_000;

/// Hosts' room the ledger's map keeps however few hosts are left (see `Kept::advance`).
const HOSTS_ROOM_KEPT: usize = 64;

/// The window's events, read at the writer's first round.
pub(super) const LOAD_SQL: &str = "SELECT host_fingerprint, kind, accepted_at FROM push_events \
     WHERE accepted_at > $1 ORDER BY accepted_at";

/// How many of them there are, after a round whose commit failed.
pub(super) const COUNT_SQL: &str = "SELECT COUNT(*) AS n FROM push_events WHERE accepted_at > $1";

/// The acceptance times of the events of the quota window, per host and kind.
#[derive(Debug, Default)]
pub struct Ledger {
    kept: Mutex<Option<Kept>>,
}

/// A round's admissions: host, kind, acceptance time.
type Admitted = Vec<(String, Kind, i64)>;

#[derive(Debug)]
struct Kept {
    hosts: HashMap<Box<str>, PerHost>,
    /// Every event accepted after this is in `hosts`; older ones may have been dropped.
    after: i64,
    next_sweep: i64,
    /// The admissions of a round whose commit failed, not yet known to be in the table or not.
    unsure: Option<Admitted>,
}

/// One host's acceptance times, oldest first, alerts and dismissals apart.
#[derive(Debug, Default)]
struct PerHost([VecDeque<i64>; 2]);

impl PerHost {
    fn times(&mut self, kind: Kind) -> &mut VecDeque<i64> {
        &mut self.0[kind as usize]
    }

    /// Drops what is not after `after`; whether anything is left.
    fn trim(&mut self, after: i64) -> bool {
        for times in &mut self.0 {
            while times.front().is_some_and(|&at| at <= after) {
                times.pop_front();
            }
        }
        self.0.iter().any(|times| !times.is_empty())
    }
}

impl Kept {
    fn new(now: i64) -> Self {
        Self {
            hosts: HashMap::new(),
            after: window_start(now) - KEPT_BEFORE_WINDOW_MS,
            next_sweep: now.saturating_add(SWEEP_EVERY_MS),
            unsure: None,
        }
    }

    /// The events it holds accepted after `after`: as many as the table has, if it is right.
    fn total(&self) -> i64 {
        let after = self.after;
        let n: usize = self
            .hosts
            .values()
            .flat_map(|per_host| &per_host.0)
            .map(|times| times.len() - times.partition_point(|&at| at <= after))
            .sum();
        i64::try_from(n).unwrap_or(i64::MAX)
    }

    /// Settles a failed commit against `in_table`, the table's count of events accepted after
    /// `after`: the round's admissions join if it committed, are dropped if not; `false` if the
    /// count fits neither.
    fn settle(&mut self, in_table: i64) -> bool {
        let Some(unsure) = self.unsure.take() else {
            return true;
        };
        let total = self.total();
        let after = self.after;
        let added: Vec<_> = unsure
            .into_iter()
            .filter(|(_, _, at)| *at > after)
            .collect();
        if in_table == total {
            true
        } else if in_table == total + i64::try_from(added.len()).unwrap_or(i64::MAX) {
            for (host, kind, at) in &added {
                self.add(host, *kind, *at);
            }
            true
        } else {
            false
        }
    }

    /// Whether it holds every event a count at `now` reads.
    fn covers(&self, now: i64) -> bool {
        window_start(now) >= self.after
    }

    fn add(&mut self, host: &str, kind: Kind, at: i64) {
        if at <= self.after {
            return;
        }
        let times = match self.hosts.get_mut(host) {
            Some(per_host) => per_host.times(kind),
            None => self.hosts.entry(host.into()).or_default().times(kind),
        };
        // In order: times only go back with the clock.
        let place = times.partition_point(|&t| t <= at);
        times.insert(place, at);
    }

    fn used(&mut self, host: &str, kind: Kind, now: i64) -> i64 {
        let Some(per_host) = self.hosts.get_mut(host) else {
            return 0;
        };
        let times = per_host.times(kind);
        let start = window_start(now);
        let inside = times.len() - times.partition_point(|&at| at <= start);
        i64::try_from(inside).unwrap_or(i64::MAX)
    }

    /// Moves the kept span up to `now`, and once a minute drops the hosts left with nothing, and
    /// gives back the room a spike of hosts left behind (a map keeps its largest size otherwise).
    fn advance(&mut self, now: i64) {
        self.after = self.after.max(window_start(now) - KEPT_BEFORE_WINDOW_MS);
        if now >= self.next_sweep {
            let after = self.after;
            self.hosts.retain(|_, per_host| per_host.trim(after));
            if self.hosts.capacity() > 4 * self.hosts.len().max(HOSTS_ROOM_KEPT) {
                self.hosts
                    .shrink_to((2 * self.hosts.len()).max(HOSTS_ROOM_KEPT));
            }
            self.next_sweep = now.saturating_add(SWEEP_EVERY_MS);
        }
    }
}

fn window_start(now: i64) -> i64 {
    now - QUOTA_WINDOW_MS
}

impl Ledger {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Kept>> {
        // Nothing here leaves the ledger half changed if it panics: a poisoned lock is still
        // good to use.
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Where a round's quota counts come from: the SQL (`Sql`, PostgreSQL: the count's condition
/// after the window's start), or SQLite's ledger and the round's own admissions so far.
#[derive(Debug)]
pub enum RoundQuota {
    Sql {
        by_time: &'static str,
    },
    Ledger {
        ledger: Arc<Ledger>,
        /// Admitted in this round's transaction.
        admitted: Admitted,
    },
}

impl RoundQuota {
    pub fn ledger(ledger: Arc<Ledger>) -> Self {
        Self::Ledger {
            ledger,
            admitted: Vec::new(),
        }
    }

    /// Where the statements count the quota themselves, what follows the window's start in
    /// their count.
    pub fn by_time(&self) -> Option<&'static str> {
        match self {
            Self::Sql { by_time } => Some(by_time),
            Self::Ledger { .. } => None,
        }
    }

    /// Reads the ledger from the table inside `tx` if it holds nothing yet, or not every event a
    /// count at `now` reads (the clock went back); after a failed commit, finds out from the table
    /// whether it happened.
    pub async fn prepare<E: Exec>(&self, tx: &mut E, now: i64) -> Result<(), sqlx::Error> {
        let Self::Ledger { ledger, .. } = self else {
            return Ok(());
        };
        let unsure_after = ledger
            .lock()
            .as_ref()
            .and_then(|kept| kept.unsure.as_ref().map(|_| kept.after));
        if let Some(after) = unsure_after {
            let in_table: i64 = Stmt::new(COUNT_SQL)
                .bind(after)
                .fetch_one(tx)
                .await?
                .col("n")?;
            let mut kept = ledger.lock();
            if !kept.as_mut().is_some_and(|kept| kept.settle(in_table)) {
                *kept = None;
            }
        }
        if ledger.lock().as_ref().is_some_and(|kept| kept.covers(now)) {
            return Ok(());
        }
        let mut kept = Kept::new(now);
        let rows = Stmt::new(LOAD_SQL).bind(kept.after).fetch_all(tx).await?;
        for row in rows {
            let host: String = row.col("host_fingerprint")?;
            let kind: String = row.col("kind")?;
            let kind = Kind::parse(&kind)
                .ok_or_else(|| sqlx::Error::Protocol(format!("stored event of kind {kind:?}")))?;
            kept.add(&host, kind, row.col("accepted_at")?);
        }
        *ledger.lock() = Some(kept);
        Ok(())
    }

    /// The host's events of `kind` inside the window at `now`, counting this round's; `None` where
    /// the statements count them (`Sql`). An error if `prepare` did not read the ledger: never a
    /// count of nothing.
    pub fn used(&self, host: &str, kind: Kind, now: i64) -> Result<Option<i64>, sqlx::Error> {
        let Self::Ledger { ledger, admitted } = self else {
            return Ok(None);
        };
        let committed = ledger
            .lock()
            .as_mut()
            .filter(|kept| kept.unsure.is_none())
            .ok_or_else(|| sqlx::Error::Protocol("the quota ledger was not read".into()))?
            .used(host, kind, now);
        let start = window_start(now);
        let here = admitted
            .iter()
            .filter(|(h, k, at)| h == host && *k == kind && *at > start)
            .count();
        Ok(Some(committed + i64::try_from(here).unwrap_or(i64::MAX)))
    }

    /// An event this round's transaction inserted.
    pub fn admitted(&mut self, host: &str, kind: Kind, at: i64) {
        if let Self::Ledger { admitted, .. } = self {
            admitted.push((host.to_owned(), kind, at));
        }
    }

    /// The round's transaction committed: its admissions join the ledger.
    pub fn committed(self, now: i64) {
        let Self::Ledger { ledger, admitted } = self else {
            return;
        };
        let mut kept = ledger.lock();
        // A ledger not read yet is read whole, this round's events with it.
        if let Some(kept) = kept.as_mut() {
            for (host, kind, at) in &admitted {
                kept.add(host, *kind, *at);
            }
            kept.advance(now);
        }
    }

    /// The round's commit failed, and may still have happened: the next round finds out.
    pub fn commit_failed(self) {
        let Self::Ledger { ledger, admitted } = self else {
            return;
        };
        if admitted.is_empty() {
            return;
        }
        if let Some(kept) = ledger.lock().as_mut() {
            kept.unsure = Some(admitted);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: i64 = 60_000;
    const T0: i64 = 1_000_000_000_000;

    fn loaded(now: i64) -> RoundQuota {
        let ledger = Arc::new(Ledger::default());
        *ledger.lock() = Some(Kept::new(now));
        RoundQuota::ledger(ledger)
    }

    fn count(round: &RoundQuota, host: &str, kind: Kind, now: i64) -> Option<i64> {
        round.used(host, kind, now).unwrap()
    }

    fn ledger_of(quota: &RoundQuota) -> Arc<Ledger> {
        match quota {
            RoundQuota::Ledger { ledger, .. } => ledger.clone(),
            RoundQuota::Sql { .. } => unreachable!("a ledger"),
        }
    }

    /// Commits `n` alerts of `host` at `at` as one round.
    fn commit_alerts(ledger: &Arc<Ledger>, host: &str, n: usize, at: i64) {
        let mut round = RoundQuota::ledger(ledger.clone());
        for _ in 0..n {
            round.admitted(host, Kind::Alert, at);
        }
        round.committed(at);
    }

    #[test]
    fn counts_each_host_and_kind_inside_the_window_only() {
        let quota = loaded(T0);
        let ledger = ledger_of(&quota);
        commit_alerts(&ledger, "a", 3, T0);
        commit_alerts(&ledger, "b", 1, T0);
        let round = RoundQuota::ledger(ledger.clone());
        assert_eq!(count(&round, "a", Kind::Alert, T0), Some(3));
        assert_eq!(count(&round, "a", Kind::Dismiss, T0), Some(0));
        assert_eq!(count(&round, "b", Kind::Alert, T0), Some(1));
        assert_eq!(count(&round, "c", Kind::Alert, T0), Some(0));
        // 15 minutes later to the millisecond the events are out, as `accepted_at > start` has it.
        assert_eq!(
            count(&round, "a", Kind::Alert, T0 + QUOTA_WINDOW_MS - 1),
            Some(3)
        );
        assert_eq!(
            count(&round, "a", Kind::Alert, T0 + QUOTA_WINDOW_MS),
            Some(0)
        );
    }

    #[test]
    fn a_round_counts_its_own_admissions_and_only_a_committed_one_leaves_them() {
        let quota = loaded(T0);
        let ledger = ledger_of(&quota);
        let mut round = RoundQuota::ledger(ledger.clone());
        round.admitted("a", Kind::Alert, T0);
        round.admitted("a", Kind::Alert, T0);
        assert_eq!(count(&round, "a", Kind::Alert, T0), Some(2));
        drop(round);
        let mut round = RoundQuota::ledger(ledger.clone());
        assert_eq!(count(&round, "a", Kind::Alert, T0), Some(0), "rolled back");
        round.admitted("a", Kind::Alert, T0);
        round.committed(T0);
        let round = RoundQuota::ledger(ledger);
        assert_eq!(count(&round, "a", Kind::Alert, T0), Some(1));
    }

    #[test]
    fn a_clock_gone_back_past_what_was_kept_needs_the_table_again() {
        let quota = loaded(T0);
        let ledger = ledger_of(&quota);
        commit_alerts(&ledger, "a", 1, T0);
        // Moved on by an hour: what came before is no longer kept.
        commit_alerts(&ledger, "a", 1, T0 + 60 * MINUTE);
        {
            let kept = ledger.lock();
            let kept = kept.as_ref().unwrap();
            assert!(kept.covers(T0 + 60 * MINUTE));
            assert!(kept.covers(T0 + 60 * MINUTE - KEPT_BEFORE_WINDOW_MS));
            assert!(!kept.covers(T0 + 60 * MINUTE - KEPT_BEFORE_WINDOW_MS - 1));
        }
    }

    /// A round whose commit failed leaves the ledger unusable until the table's count says
    /// whether it committed: its admissions are then kept or dropped, or the ledger is read again.
    #[test]
    fn a_failed_commit_is_settled_by_the_tables_count() {
        for (in_table, settled, used) in [(2, true, 2), (5, true, 5), (4, false, 0)] {
            let quota = loaded(T0);
            let ledger = ledger_of(&quota);
            commit_alerts(&ledger, "a", 2, T0);
            let mut round = RoundQuota::ledger(ledger.clone());
            for _ in 0..3 {
                round.admitted("a", Kind::Alert, T0 + 1);
            }
            round.commit_failed();
            let next = RoundQuota::ledger(ledger.clone());
            assert!(
                next.used("a", Kind::Alert, T0).is_err(),
                "never a count of nothing"
            );
            let mut kept = ledger.lock();
            assert_eq!(
                kept.as_mut().unwrap().settle(in_table),
                settled,
                "{in_table}"
            );
            drop(kept);
            if settled {
                assert_eq!(count(&next, "a", Kind::Alert, T0 + 1), Some(used));
            }
        }
        // A failed round that admitted nothing leaves nothing to find out.
        let quota = loaded(T0);
        let ledger = ledger_of(&quota);
        RoundQuota::ledger(ledger.clone()).commit_failed();
        assert!(ledger.lock().as_ref().unwrap().unsure.is_none());
    }

    #[test]
    fn hosts_with_nothing_in_the_window_are_dropped_once_a_minute() {
        let quota = loaded(T0);
        let ledger = ledger_of(&quota);
        for host in 0..100 {
            commit_alerts(&ledger, &format!("h{host}"), 2, T0);
        }
        commit_alerts(&ledger, "late", 1, T0 + 20 * MINUTE);
        let kept = ledger.lock();
        let hosts: Vec<&str> = kept.as_ref().unwrap().hosts.keys().map(|h| &**h).collect();
        assert_eq!(hosts, ["late"]);
    }

    #[test]
    fn a_spike_of_hosts_gives_its_room_back_once_they_are_swept() {
        let quota = loaded(T0);
        let ledger = ledger_of(&quota);
        let room = || ledger.lock().as_ref().unwrap().hosts.capacity();
        for host in 0..10_000 {
            commit_alerts(&ledger, &format!("h{host}"), 1, T0);
        }
        assert!(room() >= 10_000);
        commit_alerts(&ledger, "late", 1, T0 + 20 * MINUTE);
        assert!(
            room() < 4 * HOSTS_ROOM_KEPT,
            "room for {} hosts kept",
            room()
        );
        // And a sweep scheduled at the clock's end does not overflow.
        assert_eq!(Kept::new(i64::MAX).next_sweep, i64::MAX);
    }

    #[test]
    fn times_that_went_back_are_kept_in_order() {
        let quota = loaded(T0);
        let ledger = ledger_of(&quota);
        commit_alerts(&ledger, "a", 1, T0 + 2 * MINUTE);
        commit_alerts(&ledger, "a", 1, T0);
        commit_alerts(&ledger, "a", 1, T0 + MINUTE);
        let round = RoundQuota::ledger(ledger);
        let start_after_first = T0 + QUOTA_WINDOW_MS;
        assert_eq!(count(&round, "a", Kind::Alert, start_after_first), Some(2));
        assert_eq!(
            count(&round, "a", Kind::Alert, start_after_first + MINUTE),
            Some(1)
        );
    }

    #[test]
    fn statements_count_for_a_backend_without_a_ledger() {
        let mut round = RoundQuota::Sql { by_time: "" };
        assert_eq!(round.by_time(), Some(""));
        round.admitted("a", Kind::Alert, T0);
        assert_eq!(count(&round, "a", Kind::Alert, T0), None);
    }

    #[test]
    fn a_ledger_not_read_counts_nothing_but_fails() {
        let round = RoundQuota::ledger(Arc::default());
        assert!(round.used("a", Kind::Alert, T0).is_err());
    }
}
