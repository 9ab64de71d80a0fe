//! PostgreSQL's quota use per host and kind (`push_quota_use`, queue migration 0010 there): how a
//! group's seen read counts a host's quota from its row, and which rows the group writes.
//!
//! A row says that `used` of the host's events of its kind were accepted after `counted_after`,
//! which stays true wherever that start is; a count over a window that starts elsewhere reads only
//! the events between the two. Counting the whole window instead visited each of the host's events
//! in it in the heap (a fresh event's index entry is not known visible without its row): a third of
//! the admission writer's server time at 64 connections (round 51, docs/benchmarks.md).

use std::borrow::Cow;

use crate::model::{Admission, QUOTA_WINDOW_MS};
use crate::store::sql::{Arg, List, Stmt};

use super::{NewEvent, Seen};

/// The events in a host's window from which a round gives it a row: below it, reading them all
/// costs less than writing the row each round (round 51, docs/benchmarks.md: always writing it
/// cost 13% at 8 connections, where the admission benchmark's hosts held some 12 events each, and
/// gained 7% at 64, some 70 each). A host that has a row keeps it written while it sends.
pub const QUOTA_ROW_FROM: i64 = 32;

/// The pieces of `push_quota_use`, between its parameters.
pub const USE_ROW: &str = "CASE WHEN u.used IS NULL THEN 0 ELSE 1 END AS quota_row, ";
pub const USE_NO_ROW: &str = "CASE WHEN u.counted_after IS NULL OR u.counted_after < ";
pub const USE_COUNT_ALL: &str = " THEN (SELECT COUNT(*) FROM push_events q \
       WHERE q.host_fingerprint = a.host AND q.kind = a.kind AND q.accepted_at > ";
pub const USE_ROW_BEFORE: &str = ") WHEN u.counted_after <= ";
pub const USE_LESS_LEFT: &str = " THEN u.used - (SELECT COUNT(*) FROM push_events q \
       WHERE q.host_fingerprint = a.host AND q.kind = a.kind \
       AND q.accepted_at > u.counted_after AND q.accepted_at <= ";
pub const USE_PLUS_BETWEEN: &str = ") ELSE u.used + (SELECT COUNT(*) FROM push_events q \
       WHERE q.host_fingerprint = a.host AND q.kind = a.kind \
       AND q.accepted_at <= u.counted_after AND q.accepted_at > ";
pub const USE_END: &str = ") END";
/// After `READ_SEEN_TAIL`: each admission's row of `push_quota_use`.
pub const READ_SEEN_USE_JOIN: &str = " LEFT JOIN push_quota_use u \
       ON u.host_fingerprint = a.host AND u.kind = a.kind";

/// Pushes onto a seen read whether the admission's host has a row (`quota_row`) and its quota
/// use, where the statement counts it (PostgreSQL): the events of its host and kind accepted after
/// `window_start`. They are its row's count, less the events between the row's start and the
/// window's (those that left the window since the row was written) or, the row's start after the
/// window's (a clock that went back), plus those. With no row, or one that starts over a window
/// before this one (its events between would be more than the window's own), every event in the
/// window is counted.
/// `by_time` follows each time bound on `q.accepted_at` (`RoundQuota::by_time`).
pub fn push_quota_use(q: &mut Stmt<'_>, window_start: i64, by_time: &str) {
    q.push(USE_ROW)
        .push(USE_NO_ROW)
        .push_bind(window_start - QUOTA_WINDOW_MS)
        .push(USE_COUNT_ALL)
        .push_bind(window_start)
        .push(by_time)
        .push(USE_ROW_BEFORE)
        .push_bind(window_start)
        .push(USE_LESS_LEFT)
        .push_bind(window_start)
        .push(by_time)
        .push(USE_PLUS_BETWEEN)
        .push_bind(window_start)
        .push(by_time)
        .push(USE_END);
}

/// Before the events' insert where the statement counts the quota (PostgreSQL), the rows the
/// round writes (`rows_to_write`): this, the window's start, `QUOTA_USE_HOSTS`, the hosts (an
/// array), `QUOTA_USE_USED`, their use after the round (an array), `QUOTA_USE_TAIL`, then the
/// insert. Arrays whatever the number of rows, so that the events' insert has a text or two more,
/// not one for each number of rows up to `TUPLES_UP_TO`. The round's transaction tells the table's
/// trigger not to write them too (`PgQueueStore::LOCK_HOSTS_SQL`).
pub const QUOTA_USE_HEAD: &str = "WITH quota_use AS (INSERT INTO push_quota_use \
     (host_fingerprint, kind, counted_after, used) SELECT h, 'alert', ";
pub const QUOTA_USE_HOSTS: &str = ", u FROM UNNEST(";
pub const QUOTA_USE_USED: &str = "::text[], ";
pub const QUOTA_USE_TAIL: &str = "::int8[]) AS t (h, u) \
     ON CONFLICT (host_fingerprint, kind) DO UPDATE \
     SET counted_after = EXCLUDED.counted_after, used = EXCLUDED.used) ";

/// Pushes the head of a batched round's events insert that writes `rows` (`rows_to_write`), all
/// alerts, from `window_start`: up to and with `QUOTA_USE_TAIL`.
pub fn push_quota_rows<'a>(q: &mut Stmt<'a>, window_start: i64, rows: &[(&'a str, i64)]) {
    let hosts = rows
        .iter()
        .map(|(host, _)| Some(Cow::Borrowed(*host)))
        .collect();
    let used = rows.iter().map(|(_, used)| Some(*used)).collect();
    q.push_bind(window_start)
        .push(QUOTA_USE_HOSTS)
        .push_bind(Arg::List(List::Text(hosts)))
        .push(QUOTA_USE_USED)
        .push_bind(Arg::List(List::Int(used)))
        .push(QUOTA_USE_TAIL);
}

/// Before an event's insert admitted one at a time (`crate::store::admit`'s `INSERT_EVENT_SQL`,
/// whose `$2` and `$3` are its host and kind), the host's quota use after it: `$12` the window's
/// start, `$13` the events accepted after it. The round's transaction tells the table's trigger not
/// to write it (`PgQueueStore::LOCK_HOSTS_SQL`): a row the host has (`QUOTA_USE_KEPT_HEAD`), or a
/// new one from `QUOTA_ROW_FROM` alerts (`QUOTA_USE_ROW_HEAD`). Only the batched rounds read the
/// rows (this path counts the window whole), and dismissals never take them: a dismissal's row,
/// which only the trigger makes, is kept true, never made.
pub const QUOTA_USE_KEPT_HEAD: &str = "WITH quota_use AS (UPDATE push_quota_use \
     SET counted_after = $12, used = $13 WHERE host_fingerprint = $2 AND kind = $3) ";
pub const QUOTA_USE_ROW_HEAD: &str = "WITH quota_use AS (INSERT INTO push_quota_use \
     (host_fingerprint, kind, counted_after, used) VALUES ($2, $3, $12, $13) \
     ON CONFLICT (host_fingerprint, kind) DO UPDATE \
     SET counted_after = EXCLUDED.counted_after, used = EXCLUDED.used) ";

/// The rows of `push_quota_use` a batched round writes, each host once: its use after the round
/// (what the seen read counted, and the round's events), for every host of `events` that has a
/// row (which must stay true: the trigger does not write it in a round) or reaches
/// `QUOTA_ROW_FROM`. The group's admissions are all alerts (`eligible`), read in `seen`.
pub fn rows_to_write<'a>(
    group: &[&'a Admission],
    seen: &[Seen],
    events: &[NewEvent<'a>],
) -> Vec<(&'a str, i64)> {
    let mut hosts: Vec<(&'a str, i64, bool)> = Vec::new();
    for e in events {
        let host = e.admission.host_fingerprint.as_str();
        match hosts.iter_mut().find(|(h, _, _)| *h == host) {
            Some((_, used, _)) => *used += 1,
            None => {
                let read = group
                    .iter()
                    .zip(seen)
                    .find(|(a, _)| a.host_fingerprint == host)
                    .map_or(Seen::default(), |(_, s)| *s);
                hosts.push((host, read.used + 1, read.quota_row));
            }
        }
    }
    hosts
        .into_iter()
        .filter(|&(_, used, row)| row || used >= QUOTA_ROW_FROM)
        .map(|(host, used, _)| (host, used))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::tests::alert;

    fn event(a: &Admission, admitted: usize) -> NewEvent<'_> {
        NewEvent {
            admission: a,
            admitted,
            event_id: format!("ev-{admitted}"),
            content_hash: String::new(),
            deadline: 0,
        }
    }

    #[test]
    fn a_host_gets_a_row_from_its_32nd_event_and_keeps_it_while_it_sends() {
        let (a1, a2) = (alert("a", 1, &["p"]), alert("a", 2, &["p"]));
        let (b, c) = (alert("b", 1, &["p"]), alert("c", 1, &["p"]));
        let group = [&a1, &a2, &b, &c];
        let read = |used, quota_row| Seen {
            used,
            quota_row,
            ..Seen::default()
        };
        // a: 30 before, two more in the round; b: 31 before, but no event of its in the round; c:
        // a row.
        let seen = [
            read(30, false),
            read(30, false),
            read(31, false),
            read(3, true),
        ];
        let events = [event(&a1, 0), event(&a2, 1), event(&c, 3)];
        assert_eq!(rows_to_write(&group, &seen, &events), [("a", 32), ("c", 4)]);
        // One short of the line, with no row: none written.
        let events = [event(&a1, 0)];
        assert_eq!(rows_to_write(&group, &seen, &events), []);
    }
}
