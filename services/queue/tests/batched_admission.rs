//! The batched admission path (crate::admission) must leave the database and the answers exactly as
//! admitting one statement at a time does: the same events, the same batches with the same members,
//! windows, deadlines and sound, the same quota refusals, on both backends.

mod support;

use orca_push_queue::AnyQueueStore;
use orca_push_queue::model::{Admission, AdmissionStatus, Kind, Provider};
use orca_push_queue::store::QueueStore as _;
use orca_push_storage::Pool;
use orca_push_storage::testing::{Backend, fresh};
use support::*;

/// A small deterministic generator, so a failure replays.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next(100) < percent
    }
}

const HOSTS: [&str; 4] = [
    "hostAAAAAAAAAAAA",
    "hostBBBBBBBBBBBB",
    "hostCCCCCCCCCCCC",
    "hostDDDDDDDDDDDD",
];

/// Rounds of groups: mostly new alerts from a busy host and three quieter ones (bursts into open
/// windows, long ids that overflow a summary, phones named twice, expired deadlines, silent phones,
/// both providers, enough from the busy host to run into its quota), and every fifth round some
/// retries and dismissals, which go row by row.
fn workload(seed: u64, rounds: usize) -> Vec<(i64, Vec<Admission>)> {
    let mut rng = Lcg(seed);
    let mut seqs = [0_i64; 4];
    let mut sent: Vec<Admission> = Vec::new();
    (0..rounds)
        .map(|round| {
            let now = T0 as i64 + round as i64 * 700;
            let size = 1 + rng.next(40) as usize;
            let mut group: Vec<Admission> = Vec::with_capacity(size);
            for _ in 0..size {
                let h = if rng.chance(60) {
                    0
                } else {
                    1 + rng.next(3) as usize
                };
                seqs[h] += 1;
                let phones: Vec<String> = (0..1 + rng.next(3))
                    .map(|_| format!("{}-phone-{}", &HOSTS[h][4..6], rng.next(3)))
                    .collect();
                let phones: Vec<&str> = phones.iter().map(String::as_str).collect();
                let mut a = alert(seqs[h], &phones);
                a.host_fingerprint = HOSTS[h].into();
                a.content.notification_id = match rng.next(10) {
                    0 => None,
                    1 => Some(format!("{}-{}", "x".repeat(600), rng.next(4))),
                    n => Some(format!("task-{n}")),
                };
                if rng.chance(5) {
                    a.expires_at_ms = Some(now - 1);
                } else if rng.chance(10) {
                    a.expires_at_ms = Some(now + 60_000 + rng.next(1000) as i64);
                } else if rng.chance(10) {
                    // Within the window: it comes due a second before this deadline.
                    a.expires_at_ms = Some(now + 500 + rng.next(3500) as i64);
                }
                for r in &mut a.recipients {
                    r.silent = rng.chance(20);
                    if rng.chance(30) {
                        r.provider = Provider::Fcm;
                    }
                }
                group.push(a);
            }
            if round % 5 == 4 && !sent.is_empty() {
                let earlier = sent[rng.next(sent.len() as u64) as usize].clone();
                let mut fence = dismiss(&earlier, earlier.notification_seq + 1_000_000, &[]);
                fence.host_fingerprint = earlier.host_fingerprint.clone();
                fence.recipients = earlier.recipients.clone();
                group.push(earlier);
                group.push(fence);
            }
            sent.extend(group.iter().filter(|a| a.kind == Kind::Alert).cloned());
            (now, group)
        })
        .collect()
}

/// Every row of `sql` as text.
async fn rows(pool: &Pool, sql: &str) -> Vec<Vec<Option<String>>> {
    use sqlx::Row as _;
    match pool {
        Pool::Sqlite(p) => sqlx::query(sql)
            .fetch_all(p)
            .await
            .unwrap()
            .iter()
            .map(|r| (0..r.len()).map(|i| r.try_get(i).unwrap()).collect())
            .collect(),
        Pool::Postgres(p) => sqlx::query(sql)
            .fetch_all(p)
            .await
            .unwrap()
            .iter()
            .map(|r| (0..r.len()).map(|i| r.try_get(i).unwrap()).collect())
            .collect(),
    }
}

/// Events, and each recipient with its batch (named by its first member, since ids are random).
const EVENTS: &str = "SELECT host_fingerprint, kind, notification_epoch, \
     CAST(notification_seq AS TEXT), notification_id, content_hash, payload_json, \
     CAST(accepted_at AS TEXT), CAST(expires_at AS TEXT) FROM push_events \
     ORDER BY host_fingerprint, kind, notification_seq";
const RECIPIENTS: &str = "SELECT e.host_fingerprint, e.kind, CAST(e.notification_seq AS TEXT), \
     r.registration_id, r.status, CAST(r.silent AS TEXT), CAST(r.created_at AS TEXT), \
     b.host_fingerprint, b.registration_id, b.kind, b.state, CAST(b.coalescible AS TEXT), \
     CAST(b.window_ends_at AS TEXT), CAST(b.available_at AS TEXT), CAST(b.member_count AS TEXT), \
     CAST(b.members_bytes AS TEXT), CAST(b.routing_bytes AS TEXT), CAST(b.deadline AS TEXT), \
     CAST(b.silent AS TEXT), b.provider, CAST(b.created_at AS TEXT), \
     (SELECT MIN(e2.host_fingerprint || ':' || e2.kind || ':' || CAST(e2.notification_seq AS TEXT)) \
        FROM push_event_recipients r2 JOIN push_events e2 ON e2.event_id = r2.event_id \
        WHERE r2.batch_id = r.batch_id) \
     FROM push_event_recipients r JOIN push_events e ON e.event_id = r.event_id \
     LEFT JOIN push_delivery_batches b ON b.batch_id = r.batch_id \
     ORDER BY e.host_fingerprint, e.kind, e.notification_seq, r.registration_id";
const COUNTS: &str = "SELECT CAST((SELECT COUNT(*) FROM push_delivery_batches) AS TEXT), \
     CAST((SELECT COUNT(*) FROM push_dismissed_events) AS TEXT)";

async fn batched_and_row_by_row_admissions_write_the_same_rows(backend: Backend) {
    let (batched_config, _a) = fresh(backend).await;
    let (row_config, _b) = fresh(backend).await;
    let batched_pool = orca_push_queue::open_and_migrate(&batched_config)
        .await
        .unwrap();
    let row_pool = orca_push_queue::open_and_migrate(&row_config)
        .await
        .unwrap();
    let batched = AnyQueueStore::new(batched_pool.clone());
    let row_by_row = AnyQueueStore::new(row_pool.clone()).row_by_row();

    let mut refused = 0;
    for (now, group) in workload(7, 40) {
        let group: Vec<&Admission> = group.iter().collect();
        let a = batched
            .enqueue_group(&group, now, WINDOW as i64, None)
            .await;
        let b = row_by_row
            .enqueue_group(&group, now, WINDOW as i64, None)
            .await;
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_eq!(a.statuses, b.statuses, "admission {i} at {now}");
            assert_eq!(a.next_due_at, b.next_due_at, "admission {i} at {now}");
            refused += a
                .statuses
                .iter()
                .filter(|(_, s)| *s == AdmissionStatus::RateLimited)
                .count();
        }
    }
    assert!(refused > 0, "the busy host ran into its quota");
    assert!(
        batched.batched_groups() >= 30,
        "most groups took the batched path: {}",
        batched.batched_groups()
    );
    assert_eq!(row_by_row.batched_groups(), 0);
    for sql in [EVENTS, RECIPIENTS, COUNTS] {
        let (a, b) = (rows(&batched_pool, sql).await, rows(&row_pool, sql).await);
        assert!(!a.is_empty());
        assert_eq!(a.len(), b.len(), "{sql}");
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x, y, "{sql}");
        }
    }
    let summaries = rows(&batched_pool, RECIPIENTS)
        .await
        .iter()
        .filter(|r| r[14].as_deref().is_some_and(|n| n != "1"))
        .count();
    assert!(summaries > 0, "some windows were joined");
}

on_both_backends!(batched_and_row_by_row_admissions_write_the_same_rows);

/// A round on PostgreSQL writes its hosts into its `BEGIN` when each is made only of a
/// fingerprint's characters, and binds them otherwise: a group mixing both kinds is admitted,
/// retried and held to its quota the same way on both backends.
async fn hosts_of_any_characters_are_locked_admitted_and_counted(backend: Backend) {
    let (config, _guard) = fresh(backend).await;
    let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
    let store = AnyQueueStore::new(pool);
    let hosts = ["hostAAAAAAAAAAAA", "it's", "back\\slash", "two words; é"];
    let group_of = |from: i64| -> Vec<Admission> {
        hosts
            .iter()
            .flat_map(|host| {
                (from..from + 50).map(move |seq| {
                    let mut a = alert(seq, &[&format!("{host}-phone")]);
                    a.host_fingerprint = (*host).into();
                    a
                })
            })
            .collect()
    };
    let now = T0 as i64;
    let mut queued = 0;
    let mut limited = 0;
    for from in (1..=301).step_by(50) {
        let group = group_of(from);
        let group: Vec<&Admission> = group.iter().collect();
        for result in store.enqueue_group(&group, now, 0, None).await {
            match result.unwrap().statuses[0].1 {
                AdmissionStatus::Queued => queued += 1,
                AdmissionStatus::RateLimited => limited += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(
        (queued, limited),
        (4 * 300, 4 * 50),
        "each host held to 300"
    );
    // The first group again: retries, answered queued, spending no quota.
    let again = group_of(1);
    let again: Vec<&Admission> = again.iter().collect();
    for result in store.enqueue_group(&again, now, 0, None).await {
        assert_eq!(result.unwrap().statuses[0].1, AdmissionStatus::Queued);
    }
}

on_both_backends!(hosts_of_any_characters_are_locked_admitted_and_counted);

/// A window that a member's payload closes before its end is due now, and the admission that
/// closed it says so: its `next_due_at` is what wakes lanes asleep until the window's old end.
/// Before, it named only the new window's end, and the closed batch waited for its old one.
async fn a_window_the_payload_budget_closes_is_told_due_now(backend: Backend) {
    for row_by_row in [false, true] {
        let (config, _guard) = fresh(backend).await;
        let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
        let store = AnyQueueStore::new(pool);
        let store = if row_by_row {
            store.row_by_row()
        } else {
            store
        };
        let mut closed_by = None;
        for seq in 0..12_i64 {
            let mut a = alert(seq, &["r1"]);
            a.content.notification_id = Some(format!("{seq:0>400}"));
            let now = T0 as i64 + seq * 10;
            let admitted = store
                .enqueue_group(&[&a], now, WINDOW as i64, None)
                .await
                .remove(0)
                .unwrap();
            let due = admitted.next_due_at.expect("an alert makes work due");
            if due == now {
                closed_by.get_or_insert(seq);
            } else {
                assert!(due > now, "{due} at {now}");
            }
        }
        let first = closed_by.unwrap_or_else(|| {
            panic!("no admission told of a window it closed (row by row: {row_by_row})")
        });
        assert!(first > 0, "the first member opens a window");
    }
}

on_both_backends!(a_window_the_payload_budget_closes_is_told_due_now);
