//! Admitting a group of new alerts in a fixed number of statements, whatever its size.
//!
//! Admitting one alert one statement at a time costs about five statements (the retry and quota
//! read, the event, the window read, the batch, the recipient). On SQLite each statement is a
//! round trip to sqlx's worker thread, and the group writer waits for every one of them in turn:
//! profiled at 64 connections, a group of 32 took about 160 such hops, and the writer, not the
//! disk, bounded admission. Here a group reads what it needs in two statements
//! (`read_seen_sql`, `read_windows_sql`), `plan` decides every outcome in memory, and the writes
//! go out as one multi-row statement per table.
//!
//! Only the common case takes this path: every admission a new alert (not a retry of a stored
//! event) and no two with the same identity. Dismissals and retries still go one statement at a
//! time (`crate::store`'s `admit`), inside the same transaction. `plan` is that path's decisions,
//! for alerts, written as a plain function: the quota, the deadline, the dismissal fence and the
//! coalescing windows, with the group's own earlier admissions counted as the per-row path would
//! have seen them once written.

use std::collections::{HashMap, HashSet};

use crate::model::{Admission, AdmissionStatus, Kind, MAX_LIFETIME_MS, Provider, QUOTA_PER_KIND};
use crate::store::{Enqueued, ordered_id};

mod quota_rows;
mod statements;
mod windows;

pub use quota_rows::*;
pub(crate) use statements::batched_admission;
pub use statements::*;
use windows::Windows;

/// What the group's read found for one admission.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    /// An event with this identity is stored: a retry, which takes the per-row path.
    pub stored: bool,
    /// The host's events of this kind inside the quota window.
    pub used: i64,
    /// The dismissal fence of the notification: alerts below it are cancelled at once.
    pub fence: Option<i64>,
    /// The host has a row of `push_quota_use` (PostgreSQL; `quota_rows`).
    pub quota_row: bool,
}

/// An open coalescing window, as read before the group's writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenWindow {
    pub batch_id: String,
    pub registration_id: String,
    pub host_fingerprint: String,
    pub member_count: i64,
    pub members_bytes: i64,
    pub routing_bytes: i64,
    pub window_ends_at: i64,
    pub created_at: i64,
}

/// A `push_events` row to insert.
#[derive(Debug)]
pub struct NewEvent<'a> {
    pub admission: &'a Admission,
    /// Its admission's place in the group (and in `Plan::results`).
    pub admitted: usize,
    pub event_id: String,
    pub content_hash: String,
    pub deadline: i64,
}

/// A `push_delivery_batches` row to insert, in its state at the end of the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewBatch<'a> {
    pub batch_id: String,
    pub registration_id: &'a str,
    pub host_fingerprint: &'a str,
    pub coalescible: bool,
    /// Also its `available_at`.
    pub window_ends_at: i64,
    pub member_count: i64,
    pub members_bytes: i64,
    pub routing_bytes: i64,
    pub deadline: i64,
    pub silent: bool,
    pub provider: Provider,
    /// Written already leased to a waiting claim (`crate::handoff`): due at once, it is handed
    /// over when the group commits instead of claimed after.
    pub lease: Option<NewLease>,
}

/// The lease a batch is written with: a claim's token, owner and expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLease {
    pub token: String,
    pub owner: String,
    pub until: i64,
}

impl NewBatch<'_> {
    /// Its stored state and `available_at`: leased until the lease ends, or an open window, or
    /// pending (due at its window's end).
    pub fn state(&self) -> (&'static str, i64) {
        match &self.lease {
            Some(lease) => ("leased", lease.until),
            None if self.coalescible => ("open", self.window_ends_at),
            None => ("pending", self.window_ends_at),
        }
    }
}

/// A stored open window the group joined or closed, in its state at the end of the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowUpdate {
    pub batch_id: String,
    /// Its member count as read: the update applies only if no one changed it since (on
    /// PostgreSQL a lane may claim the window meanwhile).
    pub read_count: i64,
    pub member_count: i64,
    pub members_bytes: i64,
    pub routing_bytes: i64,
    /// The new `window_ends_at` and `available_at`.
    pub due: i64,
    /// The last joiner's sound; `None` if the group only closed it.
    pub silent: Option<bool>,
    /// The latest deadline of the members the group added (0 if none): the stored one only grows.
    pub deadline_at_least: i64,
}

/// A `push_event_recipients` row to insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRecipient<'a> {
    /// Index into `Plan::events`.
    pub event: usize,
    pub registration_id: &'a str,
    pub batch_id: Option<String>,
    /// `pending`, or `cancelled` below a dismissal fence.
    pub status: &'static str,
    pub silent: bool,
}

/// Every write of a group, and what each admission is answered.
#[derive(Debug, Default)]
pub struct Plan<'a> {
    pub events: Vec<NewEvent<'a>>,
    pub batches: Vec<NewBatch<'a>>,
    pub updates: Vec<WindowUpdate>,
    pub recipients: Vec<NewRecipient<'a>>,
    /// One per admission, in order.
    pub results: Vec<Enqueued>,
}

impl Plan<'_> {
    /// Marks the admissions whose every batch is leased to a claim here (`crate::handoff`) as
    /// making nothing due (`Enqueued::next_due_at`): no other lane of this replica, nor any other
    /// replica, has to look for that work. An admission with any batch left in the table keeps its
    /// due time.
    pub fn leave_handed_undue(&mut self) {
        let leased: HashSet<&str> = self
            .batches
            .iter()
            .filter(|b| b.lease.is_some())
            .map(|b| b.batch_id.as_str())
            .collect();
        if leased.is_empty() {
            return;
        }
        let mut left = vec![false; self.results.len()];
        for r in &self.recipients {
            if r.batch_id.as_deref().is_some_and(|id| !leased.contains(id))
                && let Some(event) = self.events.get(r.event)
                && let Some(left) = left.get_mut(event.admitted)
            {
                *left = true;
            }
        }
        for (result, left) in self.results.iter_mut().zip(left) {
            if !left {
                result.next_due_at = None;
            }
        }
    }
}

/// Whether `group` may take the batched path before anything is read: alerts only (a dismissal
/// cancels and fences what it covers, row by row), and no identity twice (the second would be a
/// retry of the first).
pub fn eligible(group: &[&Admission]) -> bool {
    let mut identities = HashSet::with_capacity(group.len());
    group.iter().all(|a| {
        a.kind == Kind::Alert
            && identities.insert((
                a.host_fingerprint.as_str(),
                a.notification_epoch.as_str(),
                a.notification_seq,
            ))
    })
}

/// Whether an alert of `a` coalesces into a registration's window.
pub fn coalesces(a: &Admission, coalesce_ms: i64) -> bool {
    coalesce_ms > 0 && a.content.notification_id.is_some()
}

/// Decides the group's writes, or `None` if an admission is a retry of a stored event.
/// `seen` holds one entry per admission; `windows` the open stored windows of the group's
/// registrations. `group` must be `eligible`.
pub fn plan<'a>(
    group: &[&'a Admission],
    seen: &[Seen],
    windows: Vec<OpenWindow>,
    now: i64,
    coalesce_ms: i64,
) -> Option<Plan<'a>> {
    if seen.len() != group.len() || seen.iter().any(|s| s.stored) {
        return None;
    }
    let mut plan = Plan::default();
    let mut windows = Windows::new(windows, now);
    let mut used_here: HashMap<&str, i64> = HashMap::new();
    for (a, seen) in group.iter().copied().zip(seen) {
        let every = |status| Enqueued {
            statuses: a
                .recipients
                .iter()
                .map(|r| (r.registration_id.clone(), status))
                .collect(),
            next_due_at: None,
        };
        if a.expires_at_ms.is_some_and(|at| at <= now) {
            plan.results.push(every(AdmissionStatus::Error));
            continue;
        }
        let used = used_here.entry(a.host_fingerprint.as_str()).or_default();
        if seen.used + *used >= QUOTA_PER_KIND {
            plan.results.push(every(AdmissionStatus::RateLimited));
            continue;
        }
        *used += 1;
        let cap = now + MAX_LIFETIME_MS;
        let deadline = a.expires_at_ms.map_or(cap, |at| at.min(cap));
        let event = plan.events.len();
        plan.events.push(NewEvent {
            admission: a,
            admitted: plan.results.len(),
            event_id: ordered_id(),
            content_hash: a.content.hash(),
            deadline,
        });
        let fenced = a.content.notification_id.is_some()
            && seen.fence.is_some_and(|seq| a.notification_seq < seq);

        let mut statuses = Vec::with_capacity(a.recipients.len());
        let mut next_due_at: Option<i64> = None;
        let mut named = HashSet::with_capacity(a.recipients.len());
        for recipient in &a.recipients {
            statuses.push((recipient.registration_id.clone(), AdmissionStatus::Queued));
            if !named.insert(recipient.registration_id.as_str()) {
                continue;
            }
            let (batch_id, status) = if fenced {
                (None, "cancelled")
            } else {
                let (batch_id, due) = if coalesces(a, coalesce_ms) {
                    windows.coalesce(&mut plan.batches, a, recipient, deadline, now, coalesce_ms)
                } else {
                    let batch = NewBatch {
                        batch_id: ordered_id(),
                        registration_id: &recipient.registration_id,
                        host_fingerprint: &a.host_fingerprint,
                        coalescible: false,
                        window_ends_at: now,
                        member_count: 1,
                        members_bytes: 0,
                        routing_bytes: a.routing_bytes(),
                        deadline,
                        silent: recipient.silent,
                        provider: recipient.provider,
                        lease: None,
                    };
                    let id = batch.batch_id.clone();
                    plan.batches.push(batch);
                    (id, now)
                };
                next_due_at = Some(next_due_at.map_or(due, |d| d.min(due)));
                (Some(batch_id), "pending")
            };
            plan.recipients.push(NewRecipient {
                event,
                registration_id: &recipient.registration_id,
                batch_id,
                status,
                silent: recipient.silent,
            });
        }
        plan.results.push(Enqueued {
            statuses,
            next_due_at,
        });
    }
    plan.updates = windows.finish(&mut plan.batches);
    Some(plan)
}

/// How a group's batched admission went.
#[derive(Debug)]
pub enum Batched {
    /// Written: one result per admission, in order, the claims to answer once it commits, and
    /// where its writes told other replicas of its work (PostgreSQL's `pg_notify`), what they
    /// told (empty: nothing was news, `crate::wake::Told`).
    Done(
        Vec<Enqueued>,
        crate::handoff::Handed,
        Option<Vec<(crate::model::Provider, i64)>>,
    ),
    /// Not the common case (a dismissal, a retry, an identity twice): admit row by row instead,
    /// in the same transaction (nothing was written).
    RowByRow,
    /// A stored window changed between the read and the update (PostgreSQL: a lane claimed it).
    /// The transaction must be rolled back and the group admitted row by row.
    Raced,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{AdmissionRecipient, Content, MAX_BATCH_MEMBERS, member_bytes};

    const NOW: i64 = 1_800_000_000_000;
    const WINDOW: i64 = 3000;

    pub(crate) fn alert(host: &str, seq: i64, phones: &[&str]) -> Admission {
        Admission {
            host_fingerprint: host.into(),
            kind: Kind::Alert,
            notification_epoch: "e".into(),
            notification_seq: seq,
            content: Content {
                notification_id: Some(format!("n-{seq}")),
                source: "agent".into(),
                agent_state: None,
                title: "t".into(),
                body: "b".into(),
                worktree_id: None,
            },
            expires_at_ms: None,
            recipients: phones
                .iter()
                .map(|p| AdmissionRecipient {
                    registration_id: (*p).into(),
                    silent: false,
                    provider: Provider::Fcm,
                })
                .collect(),
            trace_parent: None,
        }
    }

    fn fresh(n: usize) -> Vec<Seen> {
        vec![Seen::default(); n]
    }

    fn stored_window(phone: &str, host: &str, count: i64) -> OpenWindow {
        OpenWindow {
            batch_id: format!("stored-{phone}"),
            registration_id: phone.into(),
            host_fingerprint: host.into(),
            member_count: count,
            members_bytes: count * member_bytes("n-1", "e"),
            routing_bytes: 10,
            window_ends_at: NOW + 1000,
            created_at: NOW - 2000,
        }
    }

    fn statuses(e: &Enqueued) -> Vec<AdmissionStatus> {
        e.statuses.iter().map(|(_, s)| *s).collect()
    }

    #[test]
    fn only_new_alerts_with_distinct_identities_are_eligible() {
        let (a, b) = (alert("h", 1, &["p"]), alert("h", 2, &["p"]));
        assert!(eligible(&[&a, &b]));
        assert!(!eligible(&[&a, &a.clone()]), "the same identity twice");
        let mut d = alert("h", 3, &["p"]);
        d.kind = Kind::Dismiss;
        assert!(!eligible(&[&a, &d]), "a dismissal");
        let retry = Seen {
            stored: true,
            ..Seen::default()
        };
        assert!(plan(&[&a, &b], &[Seen::default(), retry], vec![], NOW, WINDOW).is_none());
    }

    #[test]
    fn quota_counts_the_groups_own_earlier_admissions() {
        let (a, b, c) = (
            alert("h", 1, &["p"]),
            alert("h", 2, &["p"]),
            alert("g", 1, &["q"]),
        );
        let near = Seen {
            used: QUOTA_PER_KIND - 1,
            ..Seen::default()
        };
        let plan = plan(&[&a, &b, &c], &[near, near, near], vec![], NOW, WINDOW).unwrap();
        assert_eq!(statuses(&plan.results[0]), [AdmissionStatus::Queued]);
        assert_eq!(statuses(&plan.results[1]), [AdmissionStatus::RateLimited]);
        assert_eq!(
            statuses(&plan.results[2]),
            [AdmissionStatus::Queued],
            "another host"
        );
        assert_eq!(plan.events.len(), 2, "a refused admission stores nothing");
    }

    #[test]
    fn expired_and_fenced_alerts_store_no_batch() {
        let mut expired = alert("h", 1, &["p"]);
        expired.expires_at_ms = Some(NOW);
        let fenced = alert("h", 2, &["p"]);
        let seen = [
            Seen::default(),
            Seen {
                fence: Some(3),
                ..Seen::default()
            },
        ];
        let plan = plan(&[&expired, &fenced], &seen, vec![], NOW, WINDOW).unwrap();
        assert_eq!(statuses(&plan.results[0]), [AdmissionStatus::Error]);
        assert_eq!(statuses(&plan.results[1]), [AdmissionStatus::Queued]);
        assert_eq!(plan.results[1].next_due_at, None);
        assert_eq!(plan.events.len(), 1);
        assert!(plan.batches.is_empty());
        assert_eq!(plan.recipients[0].status, "cancelled");
        assert_eq!(plan.recipients[0].batch_id, None);
    }

    #[test]
    fn a_burst_inside_the_group_shares_one_new_window() {
        let (a, b) = (alert("h", 1, &["p"]), alert("h", 2, &["p", "p"]));
        let plan = plan(&[&a, &b], &fresh(2), vec![], NOW, WINDOW).unwrap();
        assert_eq!(plan.batches.len(), 1);
        let batch = &plan.batches[0];
        assert_eq!(
            batch.member_count, 2,
            "a phone named twice is one recipient"
        );
        assert_eq!(
            batch.members_bytes,
            member_bytes("n-1", "e") + member_bytes("n-2", "e")
        );
        assert_eq!(batch.window_ends_at, NOW + WINDOW);
        assert_eq!(plan.recipients.len(), 2);
        assert!(
            plan.recipients
                .iter()
                .all(|r| r.batch_id.as_deref() == Some(batch.batch_id.as_str()))
        );
        assert_eq!(
            plan.results[1].statuses.len(),
            2,
            "every named phone is answered"
        );
        assert!(plan.updates.is_empty());
    }

    #[test]
    fn a_stored_window_is_joined_with_a_guard_on_its_count() {
        let (a, b) = (alert("h", 1, &["p"]), alert("h", 2, &["p"]));
        let mut quiet = b.clone();
        quiet.recipients[0].silent = true;
        let window = stored_window("p", "h", 3);
        let plan = plan(&[&a, &quiet], &fresh(2), vec![window], NOW, WINDOW).unwrap();
        assert!(plan.batches.is_empty());
        assert_eq!(plan.updates.len(), 1);
        let update = &plan.updates[0];
        assert_eq!((update.read_count, update.member_count), (3, 5));
        assert_eq!(update.due, NOW + 1000, "joining keeps the window's end");
        assert_eq!(update.silent, Some(true), "the last joiner's sound");
        assert_eq!(update.deadline_at_least, NOW + MAX_LIFETIME_MS);
        assert_eq!(plan.results[0].next_due_at, Some(NOW + 1000));
    }

    #[test]
    fn another_hosts_or_an_ended_window_is_not_joined() {
        let a = alert("h", 1, &["p"]);
        let mut ended = stored_window("p", "h", 1);
        ended.window_ends_at = NOW;
        let plan = plan(
            &[&a],
            &fresh(1),
            vec![stored_window("p", "other", 1), ended],
            NOW,
            WINDOW,
        )
        .unwrap();
        assert_eq!(plan.batches.len(), 1);
        assert!(plan.updates.is_empty());
    }

    #[test]
    fn a_window_that_fills_is_due_at_once_and_the_burst_goes_on_in_a_new_one() {
        let a = alert("h", 1, &["p"]);
        let b = alert("h", 2, &["p"]);
        let window = stored_window("p", "h", MAX_BATCH_MEMBERS - 1);
        let plan = plan(&[&a, &b], &fresh(2), vec![window], NOW, WINDOW).unwrap();
        assert_eq!(plan.updates[0].member_count, MAX_BATCH_MEMBERS);
        assert_eq!(plan.updates[0].due, NOW);
        assert_eq!(plan.results[0].next_due_at, Some(NOW));
        assert_eq!(plan.batches.len(), 1, "the next member opens a window");
        assert_eq!(plan.results[1].next_due_at, Some(NOW + WINDOW));
    }

    #[test]
    fn a_member_that_does_not_fit_closes_the_window_and_opens_the_next() {
        let mut a = alert("h", 1, &["p"]);
        a.content.notification_id = Some("x".repeat(2000));
        let mut window = stored_window("p", "h", 2);
        window.members_bytes = 2000;
        let plan = plan(&[&a], &fresh(1), vec![window], NOW, WINDOW).unwrap();
        let update = &plan.updates[0];
        assert_eq!(
            (update.member_count, update.due),
            (2, NOW),
            "closed, not joined"
        );
        assert_eq!(update.silent, None, "a closed window keeps its sound");
        assert_eq!(plan.batches.len(), 1);
        assert_eq!(plan.batches[0].window_ends_at, NOW + WINDOW);
    }

    #[test]
    fn without_a_notification_id_or_a_window_each_alert_goes_alone() {
        let mut a = alert("h", 1, &["p"]);
        a.content.notification_id = None;
        let b = alert("h", 2, &["p"]);
        let plan_no_id = plan(&[&a], &fresh(1), vec![], NOW, WINDOW).unwrap();
        assert!(!plan_no_id.batches[0].coalescible);
        assert_eq!(plan_no_id.batches[0].window_ends_at, NOW);
        let c = alert("h", 3, &["p"]);
        let plan_no_window = plan(&[&b, &c], &fresh(2), vec![], NOW, 0).unwrap();
        assert_eq!(plan_no_window.batches.len(), 2);
        assert!(plan_no_window.batches.iter().all(|b| !b.coalescible));
    }
}
