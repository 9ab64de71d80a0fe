//! Group commit: admissions that arrive together share one transaction, yet each keeps its own
//! outcome, quota stays exact, and one failing admission never fails its neighbours.

mod support;

use std::collections::HashMap;

use orca_push_queue::model::{AdmissionStatus, Kind, QUOTA_PER_KIND};
use orca_push_queue::store::{QueueStore as _, Skip};
use orca_push_storage::Pool;
use orca_push_storage::testing::Backend;
use support::*;

/// Makes every admission of `host` fail inside the database, as a broken row would.
async fn poison(config: &orca_push_storage::DatabaseConfig, host: &str) {
    poison_with(config, host, "ABORT").await;
}

/// `poison`, failing on SQLite with `raise`: `ABORT` undoes the failed statement's rows, `FAIL`
/// (as a statement written `OR FAIL` meeting a broken constraint) keeps those it wrote before.
async fn poison_with(config: &orca_push_storage::DatabaseConfig, host: &str, raise: &str) {
    let pool = orca_push_queue::open_and_migrate(config).await.unwrap();
    match pool {
        Pool::Sqlite(pool) => {
            sqlx::query(&format!(
                "CREATE TRIGGER poison BEFORE INSERT ON push_events \
                 WHEN NEW.host_fingerprint = '{host}' BEGIN SELECT RAISE({raise}, 'poisoned'); END"
            ))
            .execute(&pool)
            .await
            .unwrap();
        }
        Pool::Postgres(pool) => {
            sqlx::query(&format!(
                "CREATE FUNCTION poison() RETURNS trigger AS $$ BEGIN \
                 IF NEW.host_fingerprint = '{host}' THEN RAISE EXCEPTION 'poisoned'; END IF; \
                 RETURN NEW; END $$ LANGUAGE plpgsql"
            ))
            .execute(&pool)
            .await
            .unwrap();
            sqlx::query(
                "CREATE TRIGGER poison BEFORE INSERT ON push_events \
                 FOR EACH ROW EXECUTE FUNCTION poison()",
            )
            .execute(&pool)
            .await
            .unwrap();
        }
    }
}

fn from(host: &str, seq: i64, phone: &str) -> orca_push_queue::model::Admission {
    let mut a = alert(seq, &[phone]);
    a.host_fingerprint = host.into();
    a
}

async fn one_failing_admission_never_fails_its_neighbours(backend: Backend) {
    let h = harness(backend).await;
    poison(&h.config, "hostPOISONPOISON").await;
    one_failing_admission_is_admitted_apart(&h).await;
}

/// SQLite's round statements are written `OR FAIL` (no statement journal): one that stops midway
/// keeps the rows it wrote before in the transaction, and the round must roll them back with the
/// rest before it admits each apart. The poisoned event comes after its neighbour's, in the same
/// insert.
#[tokio::test]
async fn a_round_statement_stopped_midway_leaves_nothing_behind() {
    let h = harness(Backend::Sqlite).await;
    poison_with(&h.config, "hostPOISONPOISON", "FAIL").await;
    one_failing_admission_is_admitted_apart(&h).await;
}

/// A group of three whose middle admission fails inside the database: the others are admitted,
/// once each, and nothing of the failed one is kept.
async fn one_failing_admission_is_admitted_apart(h: &Harness) {
    let good = from("hostGOODGOODGOOD", 1, "phone-1");
    let bad = from("hostPOISONPOISON", 1, "phone-2");
    let also_good = from("hostOTHEROTHEROT", 1, "phone-3");
    let results = h
        .queue
        .store()
        .enqueue_group(&[&good, &bad, &also_good], T0 as i64, 0, None)
        .await;
    assert_eq!(results.len(), 3);
    assert!(results[1].is_err(), "the poisoned admission fails");
    for (i, a) in [(0, &good), (2, &also_good)] {
        let statuses = &results[i]
            .as_ref()
            .expect("a neighbour is admitted")
            .statuses;
        assert_eq!(statuses[0].1, AdmissionStatus::Queued);
        let record = h
            .queue
            .event_record(&a.host_fingerprint, Kind::Alert, &a.notification_epoch, 1)
            .await
            .unwrap();
        assert!(record.is_some(), "a neighbour's event is committed");
    }
    let record = h
        .queue
        .event_record("hostPOISONPOISON", Kind::Alert, "epoch-1", 1)
        .await
        .unwrap();
    assert!(record.is_none(), "nothing of the failed admission is kept");
    // Its neighbours' batches are due, exactly one each.
    let claimed = h.claim_all().await;
    let mut phones: Vec<_> = claimed.iter().map(|b| b.registration_id.as_str()).collect();
    phones.sort();
    assert_eq!(phones, ["phone-1", "phone-3"]);
}

fn sent(batch: &orca_push_queue::store::ClaimedBatch) -> orca_push_queue::store::Completion {
    orca_push_queue::store::Completion {
        batch_id: batch.batch_id.clone(),
        lease_token: batch.lease_token.clone(),
        outcome: orca_push_queue::store::Outcome::Sent,
        reason: "sent".into(),
        answered: true,
    }
}

async fn status_of(h: &Harness, host: &str, seq: i64) -> String {
    let record = h
        .queue
        .event_record(host, Kind::Alert, "epoch-1", seq)
        .await
        .unwrap()
        .expect("stored");
    record.recipients[0].status.clone()
}

/// A writer's round records lanes' reports in its admissions' transaction; a round that fails
/// (here a poisoned admission) loses neither: each is done apart, the bad admission alone failing.
async fn a_round_records_reports_with_its_admissions_or_apart_when_it_fails(backend: Backend) {
    let h = harness_with(backend, 0).await;
    poison(&h.config, "hostPOISONPOISON").await;
    h.admit(&from("hostGOODGOODGOOD", 1, "phone-1")).await;
    h.admit(&from("hostGOODGOODGOOD", 2, "phone-2")).await;
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 2);
    let lost = orca_push_queue::store::Completion {
        lease_token: "not-the-lease".into(),
        ..sent(&claimed[1])
    };
    let bad = from("hostPOISONPOISON", 1, "phone-3");
    let good = from("hostOTHEROTHEROT", 1, "phone-4");
    let store = h.queue.store();
    let round = store
        .write_round(
            &[&bad, &good],
            &[sent(&claimed[0]), lost],
            &[],
            T0 as i64,
            0,
            None,
        )
        .await;
    assert!(round.admitted[0].is_err(), "the poisoned admission fails");
    assert!(round.admitted[1].is_ok(), "its neighbour is admitted");
    assert_eq!(
        round.reported.unwrap(),
        vec![true, false],
        "each report on its own lease"
    );
    assert_eq!(status_of(&h, "hostGOODGOODGOOD", 1).await, "sent");
    assert_eq!(status_of(&h, "hostGOODGOODGOOD", 2).await, "pending");

    let round = store
        .write_round(
            &[&from("hostOTHEROTHEROT", 2, "phone-4")],
            &[sent(&claimed[1])],
            &[],
            T0 as i64,
            0,
            None,
        )
        .await;
    assert!(round.admitted[0].is_ok());
    assert_eq!(round.reported.unwrap(), vec![true]);
    assert_eq!(status_of(&h, "hostGOODGOODGOOD", 2).await, "sent");
    assert_eq!(status_of(&h, "hostOTHEROTHEROT", 2).await, "pending");
}

/// Two reports of one batch together (a lane whose lease lapsed, then the lane that reclaimed it,
/// as one round on SQLite may carry them): the stale one records nothing and does not hide the
/// holder's.
async fn a_stale_report_does_not_hide_the_lease_holders(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&from("hostGOODGOODGOOD", 1, "phone-1")).await;
    let lapsed = h.claim_all().await;
    h.clock.advance(LEASE as u64);
    let holder = h.claim_all().await;
    assert_eq!(holder[0].batch_id, lapsed[0].batch_id);
    assert!(holder[0].recovered);
    let recorded = h
        .queue
        .store()
        .complete(&[sent(&lapsed[0]), sent(&holder[0])], T0 as i64 + LEASE)
        .await
        .unwrap();
    assert_eq!(recorded, vec![false, true]);
    assert_eq!(status_of(&h, "hostGOODGOODGOOD", 1).await, "sent");
}

fn ask(lane: &str, max: i64) -> orca_push_queue::store::ClaimAsk {
    orca_push_queue::store::ClaimAsk {
        lane: lane.into(),
        max,
        lease_ms: LEASE,
        skip: orca_push_queue::store::Skip::default(),
    }
}

fn no_orphans() -> orca_push_queue::handoff::Handoff {
    orca_push_queue::handoff::Handoff::new(Box::new(|batches| {
        panic!("nothing is orphaned here: {batches:?}")
    }))
}

/// Claims riding in a writer's round take what waited in the table first, then the round's new
/// work due at once, written leased to them with its members (never read back). Every batch goes
/// to one claim, under its lease.
async fn a_rounds_claims_take_the_table_first_then_its_new_work(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&from("hostGOODGOODGOOD", 1, "phone-1")).await;
    let handoff = no_orphans();
    let second = from("hostGOODGOODGOOD", 2, "phone-2");
    let third = from("hostOTHEROTHEROT", 1, "phone-3");
    let round = h
        .queue
        .store()
        .write_round(
            &[&second, &third],
            &[],
            &[ask("lane-a", 2), ask("lane-b", 64)],
            T0 as i64,
            0,
            Some(&handoff),
        )
        .await;
    assert!(round.admitted.iter().all(Result::is_ok));
    let claimed: Vec<Vec<orca_push_queue::store::ClaimedBatch>> =
        round.claimed.into_iter().map(Result::unwrap).collect();
    let phones = |batches: &[orca_push_queue::store::ClaimedBatch]| -> Vec<String> {
        batches.iter().map(|b| b.registration_id.clone()).collect()
    };
    assert_eq!(
        phones(&claimed[0]),
        ["phone-1", "phone-2"],
        "the table's first"
    );
    assert_eq!(
        phones(&claimed[1]),
        ["phone-3"],
        "what was left of the round's"
    );
    let handed = &claimed[0][1];
    assert_eq!(handed.members.len(), 1);
    assert_eq!(handed.members[0].notification_seq, 2);
    assert_eq!(handed.members[0].content.title, "Task 2 done");
    assert_eq!(handed.lease_expires_at, T0 as i64 + LEASE);
    assert_eq!(handed.attempt, 1);
    assert!(h.claim_all().await.is_empty(), "all three leased");
    let reports: Vec<_> = claimed.iter().flatten().map(sent).collect();
    let recorded = h.queue.store().complete(&reports, T0 as i64).await.unwrap();
    assert_eq!(recorded, vec![true; 3], "each under the lease it was given");
    assert_eq!(status_of(&h, "hostGOODGOODGOOD", 2).await, "sent");
    assert_eq!(status_of(&h, "hostOTHEROTHEROT", 1).await, "sent");
}

/// A round whose transaction fails (a poisoned admission) still answers its claims, each claimed
/// apart from the admissions; without a hand-off a claim takes only what the table holds.
///
/// SQLite only: PostgreSQL keeps claims out of rounds (`PgQueueStore::CLAIMS_IN_ROUNDS`), and there
/// the failed transaction's row locks last until its connection's deferred rollback, which a claim
/// on another connection skips (`SKIP LOCKED`).
#[tokio::test]
async fn a_failed_rounds_claims_are_claimed_apart() {
    let backend = Backend::Sqlite;
    let h = harness_with(backend, 0).await;
    poison(&h.config, "hostPOISONPOISON").await;
    h.admit(&from("hostGOODGOODGOOD", 1, "phone-1")).await;
    let bad = from("hostPOISONPOISON", 1, "phone-2");
    let good = from("hostOTHEROTHEROT", 1, "phone-3");
    let handoff = no_orphans();
    let round = h
        .queue
        .store()
        .write_round(
            &[&bad, &good],
            &[],
            &[ask("lane-a", 64)],
            T0 as i64,
            0,
            Some(&handoff),
        )
        .await;
    assert!(round.admitted[0].is_err(), "the poisoned admission fails");
    assert!(round.admitted[1].is_ok(), "its neighbour is admitted");
    let claimed = round.claimed.into_iter().next().unwrap().unwrap();
    let phones: Vec<&str> = claimed.iter().map(|b| b.registration_id.as_str()).collect();
    assert_eq!(
        phones,
        ["phone-1"],
        "the claim, on its own, took the table's"
    );
    let left = h.claim_all().await;
    assert_eq!(left.len(), 1, "the neighbour's work waits for a claim");
    assert_eq!(left[0].registration_id, "phone-3");
}

async fn concurrent_admissions_commit_in_groups_and_quota_stays_exact(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let total = QUOTA_PER_KIND + 100;
    let mut calls = tokio::task::JoinSet::new();
    for seq in 0..total {
        let queue = h.queue.clone();
        calls.spawn(async move {
            let a = alert(seq, &["phone-1"]);
            queue.enqueue(&a).await.expect("enqueue").statuses[0].1
        });
    }
    let mut counts: HashMap<AdmissionStatus, i64> = HashMap::new();
    while let Some(status) = calls.join_next().await {
        *counts.entry(status.unwrap()).or_default() += 1;
    }
    assert_eq!(counts.get(&AdmissionStatus::Queued), Some(&QUOTA_PER_KIND));
    assert_eq!(counts.get(&AdmissionStatus::RateLimited), Some(&100));
    // The events the quota let in are exactly the ones committed.
    let mut kept = 0;
    for seq in 0..total {
        if h.queue
            .event_record(HOST, Kind::Alert, "epoch-1", seq)
            .await
            .unwrap()
            .is_some()
        {
            kept += 1;
        }
    }
    assert_eq!(kept, QUOTA_PER_KIND);
    let groups = h.queue.admission_groups();
    assert!(
        groups <= total as u64 / 2,
        "{total} concurrent admissions took {groups} transactions"
    );
}

async fn a_hosts_admissions_answered_in_turn_keep_their_order(backend: Backend) {
    // A host that waits for each answer before the next send: each is in a later group, so an
    // alert sent after its dismissal's answer is fenced, and one sent before is taken back.
    let h = harness(backend).await;
    let first = alert(1, &["phone-1"]);
    assert_eq!(h.admit(&first).await, [AdmissionStatus::Queued]);
    let dismissal = dismiss(&first, 2, &["phone-1"]);
    assert_eq!(h.admit(&dismissal).await, [AdmissionStatus::Queued]);
    let mut late = alert(1, &["phone-2"]);
    late.content = first.content.clone();
    assert_eq!(h.admit(&late).await, [AdmissionStatus::Queued]);
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    let statuses: HashMap<_, _> = record
        .recipients
        .iter()
        .map(|r| (r.registration_id.as_str(), r.status.as_str()))
        .collect();
    assert_eq!(statuses.get("phone-1"), Some(&"cancelled"));
    assert_eq!(statuses.get("phone-2"), Some(&"cancelled"));
}

/// Lanes that find work due at the same moment take turns, and the first claims it all, so the
/// others do not each spend an empty claim (on SQLite a write transaction in the one writer's way;
/// on PostgreSQL four round trips of the server's CPU); while claims come back full, the next lane
/// claims what is left. Either way each batch goes to one lane.
async fn lanes_finding_work_together_claim_it_once(backend: Backend) {
    let h = harness(backend).await;
    for seq in 1..=3 {
        let phone = format!("phone-{seq}");
        h.admit(&alert(seq, &[phone.as_str()])).await;
    }
    h.clock.advance(WINDOW);
    let lanes: Vec<_> = (0..4)
        .map(|i| {
            let queue = h.queue.clone();
            tokio::spawn(async move { queue.claim(&format!("lane-{i}"), 64, 30_000, 300).await })
        })
        .collect();
    let mut claimed = Vec::new();
    for lane in lanes {
        claimed.extend(lane.await.unwrap().unwrap());
    }
    let mut ids: Vec<_> = claimed.iter().map(|b| b.batch_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        (claimed.len(), ids.len()),
        (3, 3),
        "each batch claimed once"
    );
    assert_eq!(h.queue.claim_transactions(), 1, "one claim took it all");
    // A claim that comes back full leaves more due: the next lane claims it, none goes empty.
    for seq in 4..=7 {
        let phone = format!("phone-{seq}");
        h.admit(&alert(seq, &[phone.as_str()])).await;
    }
    h.clock.advance(WINDOW);
    let before = h.queue.claim_transactions();
    let lanes: Vec<_> = (0..4)
        .map(|i| {
            let queue = h.queue.clone();
            tokio::spawn(async move { queue.claim(&format!("lane-{i}"), 1, 30_000, 300).await })
        })
        .collect();
    for lane in lanes {
        assert_eq!(lane.await.unwrap().unwrap().len(), 1, "each lane its one");
    }
    assert_eq!(
        h.queue.claim_transactions() - before,
        4,
        "no claim came back empty"
    );
}

on_both_backends!(
    a_rounds_claims_take_the_table_first_then_its_new_work,
    lanes_finding_work_together_claim_it_once,
    one_failing_admission_never_fails_its_neighbours,
    a_round_records_reports_with_its_admissions_or_apart_when_it_fails,
    a_stale_report_does_not_hide_the_lease_holders,
    concurrent_admissions_commit_in_groups_and_quota_stays_exact,
    a_hosts_admissions_answered_in_turn_keep_their_order,
    waking_lanes_claim_only_when_something_is_due,
    a_claim_leaves_a_held_providers_work_alone,
    a_claim_takes_the_earliest_due_across_providers,
    lanes_woken_together_share_one_read,
    a_held_providers_new_work_does_not_wake_claims_that_skip_it,
    a_failed_round_wakes_the_lanes_to_look,
    a_lane_woken_by_work_due_now_claims_without_a_read,
);

/// News of work due at once says what a read of the earliest due time would: the lane it wakes
/// claims without one. On PostgreSQL that read was a round trip between a send's commit and its
/// claim; on SQLite the round hands such work to the waiting claim.
async fn a_lane_woken_by_work_due_now_claims_without_a_read(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, 30_000, 5_000).await });
    let before = h.settled_due_reads().await;
    h.admit(&alert(1, &["phone-1"])).await;
    let claimed = waiting.await.unwrap().unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(h.queue.due_reads() - before, 0, "claimed on the news alone");
}

/// Every admission group wakes the waiting lanes; a window due seconds later must not cost them a
/// write transaction each (on SQLite they would queue in the one writer's way).
async fn waking_lanes_claim_only_when_something_is_due(backend: Backend) {
    let h = harness(backend).await;
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, 30_000, 4_000).await });
    // Waiting before the admissions (its first read done), so that they reach it.
    h.settled_due_reads().await;
    for seq in 1..=20 {
        let phone = format!("phone-{seq}");
        h.admit(&alert(seq, &[phone.as_str()])).await;
    }
    assert!(!waiting.is_finished(), "still waiting");
    let claimed = waiting.await.unwrap().unwrap();
    assert!(claimed.is_empty(), "every window is still open");
    assert_eq!(
        h.queue.claim_transactions(),
        0,
        "woken 20 times, claimed never"
    );
    h.clock.advance(WINDOW);
    assert_eq!(h.claim_all().await.len(), 20);
    assert_eq!(h.queue.claim_transactions(), 1);
}

/// A lane whose breaker holds a provider neither claims nor waits for that provider's work, so an
/// outage costs no claim and no hand-back per new send; the other provider's work flows on.
async fn a_claim_leaves_a_held_providers_work_alone(backend: Backend) {
    use orca_push_queue::model::Provider;
    let h = harness_with(backend, 0).await;
    let mut to_apns = alert(1, &["phone-apns"]);
    to_apns.recipients[0].provider = Provider::Apns;
    let mut to_fcm = alert(2, &["phone-fcm"]);
    to_fcm.recipients[0].provider = Provider::Fcm;
    h.admit(&to_apns).await;
    let apns_held = Skip::of([Provider::Apns]);
    let started = std::time::Instant::now();
    let claimed = h
        .queue
        .claim_skipping("lane", 64, 30_000, 300, apns_held)
        .await
        .unwrap();
    assert!(claimed.is_empty(), "only held work is due");
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(300),
        "it waited"
    );
    assert_eq!(h.queue.claim_transactions(), 0, "no claim for held work");
    h.admit(&to_fcm).await;
    let claimed = h
        .queue
        .claim_skipping("lane", 64, 30_000, 0, apns_held)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].registration_id, "phone-fcm");
    // The hold over, the held work is claimed as before.
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].registration_id, "phone-apns");
}

/// Each provider's due work is read apart (`push_delivery_batches_due` is keyed by provider,
/// then time), and a claim still takes the earliest due first across the providers it takes, up
/// to its size; the earliest due time leaves the skipped providers out the same way.
async fn a_claim_takes_the_earliest_due_across_providers(backend: Backend) {
    use orca_push_queue::model::Provider;
    let (config, _guard) = orca_push_storage::testing::fresh(backend).await;
    let store = orca_push_queue::AnyQueueStore::new(
        orca_push_queue::open_and_migrate(&config).await.unwrap(),
    );
    // One phone each, due 1 ms apart, providers interleaved.
    let due = [
        (1, Provider::Fcm),
        (2, Provider::Apns),
        (3, Provider::Unknown),
        (4, Provider::Fcm),
        (5, Provider::Apns),
    ];
    for (at, provider) in due {
        let mut admission = alert(at, &[format!("phone-{at}").as_str()]);
        admission.recipients[0].provider = provider;
        for result in store
            .enqueue_group(&[&admission], T0 as i64 + at, 0, None)
            .await
        {
            result.unwrap();
        }
    }
    let fcm_held = Skip::of([Provider::Fcm]);
    let both_held = Skip::of([Provider::Apns, Provider::Fcm]);
    for (skip, next) in [
        (Skip::default(), 1),
        (Skip::of([Provider::Apns]), 1),
        (fcm_held, 2),
        (both_held, 3),
    ] {
        assert_eq!(
            store.next_available_at(skip).await.unwrap(),
            Some(T0 as i64 + next),
            "{skip:?}"
        );
    }
    let now = T0 as i64 + 10;
    let phones = |claimed: Vec<orca_push_queue::store::ClaimedBatch>| -> Vec<String> {
        claimed.into_iter().map(|b| b.registration_id).collect()
    };
    let claimed = store
        .claim("lane", 2, LEASE, now, Skip::default())
        .await
        .unwrap();
    assert_eq!(phones(claimed), ["phone-1", "phone-2"], "the two due first");
    let claimed = store.claim("lane", 64, LEASE, now, fcm_held).await.unwrap();
    assert_eq!(
        phones(claimed),
        ["phone-3", "phone-5"],
        "all but FCM's, in order"
    );
    assert_eq!(
        store.next_available_at(fcm_held).await.unwrap(),
        Some(now + LEASE),
        "only leases are left to lapse"
    );
    let claimed = store
        .claim("lane", 64, LEASE, now, both_held)
        .await
        .unwrap();
    assert!(claimed.is_empty(), "only FCM's is left");
    let claimed = store
        .claim("lane", 64, LEASE, now, Skip::default())
        .await
        .unwrap();
    assert_eq!(phones(claimed), ["phone-4"]);
}

/// The lanes woken by one commit share reads of the earliest due time instead of one each; and an
/// admission whose window ends after the lanes would wake anyway wakes none of them (before, each
/// admission group woke every lane to read the same due time again: 2,000 reads a second in the
/// admission benchmark).
async fn lanes_woken_together_share_one_read(backend: Backend) {
    // Windows of 2 s, and lanes that wait at most 3 s: the first window is news to them.
    let h = harness_with(backend, 2_000).await;
    let lanes: Vec<_> = (0..8)
        .map(|i| {
            let queue = h.queue.clone();
            tokio::spawn(async move { queue.claim(&format!("lane-{i}"), 64, 30_000, 3_000).await })
        })
        .collect();
    // Every lane makes its first read and goes to sleep before the wake is counted: a lane that
    // starts late reads on its own, which under a loaded suite once took longer than a fixed
    // 200 ms and counted eight reads for one wake.
    let before = h.settled_due_reads().await;
    h.admit(&alert(1, &["phone-1"])).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let first = h.queue.due_reads() - before;
    // Eight lanes woken at once would read eight times on their own; a lane scheduled after
    // another's read began must read again, so a wake costs one to three reads.
    assert!(
        (1..=3).contains(&first),
        "{first} reads for one wake of 8 lanes"
    );
    // Asleep until the first window ends, the lanes sleep through windows that end later.
    for seq in 2..=10 {
        let phone = format!("phone-{seq}");
        h.admit(&alert(seq, &[phone.as_str()])).await;
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        h.queue.due_reads() - before,
        first,
        "nine later windows, no read"
    );
    for lane in lanes {
        assert!(lane.await.unwrap().unwrap().is_empty());
    }
}

/// A round whose transaction fails wakes this replica's lanes to look: a commit whose answer was
/// lost may have stored work that no result says is due, and the replica no longer hears its own
/// notifications (`wake::payload_from`).
async fn a_failed_round_wakes_the_lanes_to_look(backend: Backend) {
    let h = harness(backend).await;
    poison(&h.config, "hostPOISONPOISON").await;
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, 30_000, 3_000).await });
    let before = h.settled_due_reads().await;
    let bad = from("hostPOISONPOISON", 1, "phone-1");
    assert!(
        h.queue.enqueue(&bad).await.is_err(),
        "the poisoned admission fails"
    );
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(
        h.queue.due_reads() - before,
        1,
        "woken once by the failed round"
    );
    assert!(waiting.await.unwrap().unwrap().is_empty());
}

/// During an outage every admission group is news for the failing provider only. A lane that
/// leaves that provider's work alone sleeps through it: before, each group woke every lane to read
/// the next due time, a read that walks every held batch (a fifth of the gateway's CPU in the
/// admission benchmark). News of the other provider's work still wakes it at once.
async fn a_held_providers_new_work_does_not_wake_claims_that_skip_it(backend: Backend) {
    use orca_push_queue::model::Provider;
    let h = harness_with(backend, 0).await;
    let fcm_held = Skip::of([Provider::Fcm]);
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let claimed = queue
            .claim_skipping("lane", 64, 30_000, 10_000, fcm_held)
            .await
            .unwrap();
        (claimed, started.elapsed())
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let before = h.queue.due_reads();
    for seq in 1..=10 {
        let phone = format!("phone-fcm-{seq}");
        let mut to_fcm = alert(seq, &[phone.as_str()]);
        to_fcm.recipients[0].provider = Provider::Fcm;
        h.admit(&to_fcm).await;
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        h.queue.due_reads() - before,
        0,
        "ten groups of held work, no read"
    );
    let mut to_apns = alert(11, &["phone-apns"]);
    to_apns.recipients[0].provider = Provider::Apns;
    h.admit(&to_apns).await;
    let (claimed, waited) = waiting.await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].registration_id, "phone-apns");
    assert!(
        waited < std::time::Duration::from_secs(5),
        "woken by the APNs work, not by the timeout: {waited:?}"
    );
}

/// On SQLite a group's statements stay prepared, one per size and kind, so a round does not
/// prepare them again; those of more than 128 rows are not kept, so the writer's cache cannot
/// fill with statements of hundreds of kilobytes each.
#[tokio::test]
async fn group_statements_stay_prepared_up_to_a_bound() {
    use sqlx::Connection as _;
    let (config, _guard) = orca_push_storage::testing::fresh(Backend::Sqlite).await;
    let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
    let Pool::Sqlite(writer) = &pool else {
        unreachable!("a SQLite configuration opens SQLite");
    };
    let store = orca_push_queue::AnyQueueStore::new(pool.clone());
    let group = |from: i64, n: i64| -> Vec<_> {
        (from..from + n)
            .map(|seq| alert(seq, &[format!("phone-{seq}").as_str()]))
            .collect()
    };
    let admit = |admissions: Vec<_>| {
        let store = store.clone();
        async move {
            let refs: Vec<_> = admissions.iter().collect();
            for result in store.enqueue_group(&refs, T0 as i64, 0, None).await {
                result.unwrap();
            }
        }
    };
    let cached = || async { writer.acquire().await.unwrap().cached_statements_size() };
    let before = cached().await;
    admit(group(1, 10)).await;
    let kept = cached().await;
    assert!(kept > before, "a group's statements are kept");
    admit(group(11, 10)).await;
    assert_eq!(cached().await, kept, "the same size prepares nothing new");
    admit(group(21, 129)).await;
    assert_eq!(cached().await, kept, "statements of 129 rows are not kept");
}

/// A migrated queue database through a pool of one connection: the statements kept, and the
/// plans made, on that connection's session are the ones every group used.
async fn one_connection(config: &orca_push_storage::DatabaseConfig) -> Pool {
    orca_push_queue::open_and_migrate(config)
        .await
        .expect("open and migrate");
    let one = orca_push_storage::ServiceStorage {
        max_connections: 1,
        ..orca_push_queue::STORAGE
    };
    orca_push_storage::open(config, &one).await.expect("open")
}

/// On PostgreSQL a group's statements stay prepared and are planned once per connection, not on
/// every call: profiled, planning the seen read cost the server seven times its execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgresql_plans_a_groups_reads_once_per_connection() {
    let (config, _db) = orca_push_storage::testing::fresh(Backend::Postgres).await;
    let pool = one_connection(&config).await;
    let clock = orca_push_storage::ManualClock::new(T0);
    let store = orca_push_queue::AnyQueueStore::new(pool.clone());
    let queue = orca_push_queue::DeliveryQueue::new(
        store.clone(),
        std::sync::Arc::new(clock),
        WINDOW,
        std::sync::Arc::new(orca_push_queue::Wake::new()),
    );
    for seq in 1..=8 {
        let phone = format!("phone-{seq}");
        let admitted = queue.enqueue(&alert(seq, &[phone.as_str()])).await.unwrap();
        let statuses: Vec<AdmissionStatus> =
            admitted.statuses.into_iter().map(|(_, s)| s).collect();
        assert_eq!(statuses, vec![AdmissionStatus::Queued]);
    }
    // The rounds ran on the writers' own connection (one, as the pool has one).
    let pg = store
        .rounds_pool()
        .expect("PostgreSQL's rounds pool")
        .clone();
    let setting: String = sqlx::query_scalar("SHOW plan_cache_mode")
        .fetch_one(&pg)
        .await
        .unwrap();
    assert_eq!(
        setting, "auto",
        "the setting ended with each group's transaction"
    );
    const READS: &str = "FROM pg_prepared_statements \
         WHERE statement LIKE 'WITH a (i, host%' \
         OR statement LIKE 'SELECT batch_id, registration_id, host_fingerprint, member_count%'";
    let kept: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) {READS}"))
        .fetch_one(&pg)
        .await
        .unwrap();
    assert_eq!(kept, 2, "both reads kept prepared");
    // The plan counts are PostgreSQL 14's.
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&pg)
        .await
        .unwrap();
    if version < 140_000 {
        return;
    }
    let plans: Vec<(String, i64, i64)> = sqlx::query_as(&format!(
        "SELECT statement, generic_plans, custom_plans {READS}"
    ))
    .fetch_all(&pg)
    .await
    .unwrap();
    for (statement, generic, custom) in plans {
        assert_eq!(
            (generic, custom),
            (8, 0),
            "one generic plan, used by every group: {statement}"
        );
    }
}

/// On PostgreSQL the admission writers run on a thread of their own, over connections opened
/// there: a round's round trips go on while the runtime serving requests is busy. On that runtime
/// each answer from the server waited behind every ready request task before the round could send
/// its next statement.
#[tokio::test]
async fn postgresql_rounds_go_on_while_the_request_runtime_is_busy() {
    let h = harness(Backend::Postgres).await;
    let admission = alert(1, &["phone-1"]);
    let mut admitting = Box::pin(h.queue.enqueue(&admission));
    // Polled once, the admission is handed to the writers and waits for its answer.
    assert!(futures::poll!(&mut admitting).is_pending());
    // This runtime's one thread is now held (as by requests), while another thread watches the
    // table from a runtime of its own.
    let config = h.config.clone();
    let watching = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let pool = orca_push_storage::open(&config, &orca_push_queue::STORAGE)
                .await
                .unwrap();
            let Pool::Postgres(pg) = pool else {
                unreachable!("a PostgreSQL pool")
            };
            let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while std::time::Instant::now() < until {
                let events: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM push_events")
                    .fetch_one(&pg)
                    .await
                    .unwrap();
                if events == 1 {
                    return true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            false
        })
    });
    let committed = watching.join().unwrap();
    assert!(
        committed,
        "the round committed while the request runtime was held"
    );
    let admitted = admitting.await.unwrap();
    assert_eq!(admitted.statuses.len(), 1);
}

/// A pool of its own on the harness's PostgreSQL database, beside the queue's.
async fn postgres_pool(h: &Harness) -> sqlx::PgPool {
    match orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap()
    {
        Pool::Postgres(pg) => pg,
        Pool::Sqlite(_) => unreachable!("a PostgreSQL pool"),
    }
}

/// Has the server close every connection to the database but `pool`'s own; how many it closed.
async fn close_every_other_connection(pool: &sqlx::PgPool) -> usize {
    let closed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    closed.len()
}

/// The pools no longer ping a connection before every use (a round trip before every round), but
/// ping one that sat idle for longer than `PING_IDLE_AFTER`: after the server closes idle
/// connections (a restart, a fail-over, an idle timeout), the writer's next round and a statement
/// on a service's pool still succeed, on new connections, rather than failing on the dead ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_work_goes_on_after_the_server_closes_idle_connections() {
    let h = harness(Backend::Postgres).await;
    let (service, closer) = (postgres_pool(&h).await, postgres_pool(&h).await);
    let count = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM push_events")
            .fetch_one(&pool)
            .await
    };
    let first = h.queue.enqueue(&alert(1, &["phone-1"])).await.unwrap();
    assert_eq!(first.statuses[0].1, AdmissionStatus::Queued);
    assert_eq!(count(service.clone()).await.unwrap(), 1);
    // Every other connection to this database, the writer's and `service`'s among them.
    assert!(
        close_every_other_connection(&closer).await >= 2,
        "the writer's and the service's connections"
    );
    tokio::time::sleep(orca_push_storage::PING_IDLE_AFTER + std::time::Duration::from_millis(200))
        .await;
    let second = h.queue.enqueue(&alert(2, &["phone-1"])).await.unwrap();
    assert_eq!(second.statuses[0].1, AdmissionStatus::Queued);
    assert_eq!(count(service).await.unwrap(), 2);
}

/// A connection the server closed less than `PING_IDLE_AFTER` after its last use is not pinged
/// before the next round: the round's first statement fails on it, and the admission goes again
/// on a new connection rather than being answered `dependency_unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_an_admission_whose_connection_was_just_closed_goes_again_on_a_new_one() {
    let h = harness(Backend::Postgres).await;
    let closer = postgres_pool(&h).await;
    let first = h.queue.enqueue(&alert(1, &["phone-1"])).await.unwrap();
    assert_eq!(first.statuses[0].1, AdmissionStatus::Queued);
    assert!(
        close_every_other_connection(&closer).await >= 1,
        "the writer's connection"
    );
    // At once: the writer's connection was used a moment ago, so nothing pings it first.
    let second = h.queue.enqueue(&alert(2, &["phone-1"])).await.unwrap();
    assert_eq!(second.statuses[0].1, AdmissionStatus::Queued);
    let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM push_events")
        .fetch_one(&closer)
        .await
        .unwrap();
    assert_eq!(stored, 2);
}

/// A round whose host lock fails on the server (here the database's `lock_timeout`, while
/// another connection holds the host's lock) fails its admission cleanly, and the rounds after it
/// run: the aborted transaction its `BEGIN` left on the writer's connection is ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_a_round_whose_lock_fails_leaves_the_writer_able_to_go_on() {
    let h = harness(Backend::Postgres).await;
    let other = postgres_pool(&h).await;
    // Before the writer's connection opens (at its first round), so that it gets the setting.
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&other)
        .await
        .unwrap();
    sqlx::raw_sql(&format!(
        "ALTER DATABASE \"{database}\" SET lock_timeout = '300ms'"
    ))
    .execute(&other)
    .await
    .unwrap();
    let mut holder = other.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('push_events:' || $1, 0))")
        .bind(HOST)
        .execute(&mut *holder)
        .await
        .unwrap();
    assert!(
        h.queue.enqueue(&alert(1, &["phone-1"])).await.is_err(),
        "the host's lock is held past the lock timeout"
    );
    holder.commit().await.unwrap();
    for seq in 2..=3 {
        let admitted = h.queue.enqueue(&alert(seq, &["phone-1"])).await.unwrap();
        assert_eq!(admitted.statuses[0].1, AdmissionStatus::Queued);
    }
}

/// On PostgreSQL a group's plans, made once per connection, look rows up by key however the
/// tables grow after: made on new, nearly empty tables (a fresh deployment, a benchmark run), the
/// seen read scanned all of `push_events` and the window update every open window on each call,
/// until the connection closed or an `ANALYZE` made them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_plans_made_on_empty_tables_look_up_by_key_once_they_grow() {
    plans_made_on_empty_tables_look_up_by_key(false, 0).await;
}

/// The same, with the plans made on a table of a few hundred batches, not yet analyzed (a
/// deployment's first minutes): the windows read of a group took the due index, whose condition
/// its own implied, and filtered every live batch by phone, however many piled up after (held
/// while a provider refuses connections; round 32, docs/benchmarks.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_plans_made_on_a_small_table_find_a_phones_windows_by_phone() {
    plans_made_on_empty_tables_look_up_by_key(false, 300).await;
}

/// The same, one admission at a time (what a round falls back to, and where a retry or a
/// dismissal goes): its window is joined by a statement of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_row_by_row_plans_made_on_empty_tables_look_up_by_key_once_they_grow() {
    plans_made_on_empty_tables_look_up_by_key(true, 0).await;
}

/// `seeded`: open windows of other phones in the table when the plans are made.
async fn plans_made_on_empty_tables_look_up_by_key(row_by_row: bool, seeded: i64) {
    let probe = PlanProbe::new(&["push_events", "push_delivery_batches"]).await;
    let pg = probe.pg.clone();
    let store = orca_push_queue::AnyQueueStore::new(probe.pool.clone());
    let store = if row_by_row {
        store.row_by_row()
    } else {
        store
    };
    let window = WINDOW as i64;
    let round = |seq: i64| {
        let store = store.clone();
        async move {
            let group: Vec<_> = (1..=8)
                .map(|phone| from(HOST, seq * 10 + phone, &format!("phone-{phone}")))
                .collect();
            let refs: Vec<_> = group.iter().collect();
            for result in store
                .enqueue_group(&refs, T0 as i64 + seq, window, None)
                .await
            {
                result.unwrap();
            }
        }
    };
    let open_windows = |prefix: &'static str, count: i64| {
        sqlx::query(
            "INSERT INTO push_delivery_batches (batch_id, registration_id, host_fingerprint, kind, \
             state, coalescible, window_ends_at, available_at, member_count, members_bytes, \
             routing_bytes, deadline, silent, attempts, created_at, provider) \
             SELECT $2 || i, $2 || 'phone-' || i, 'bulkhost' || (i % 500), 'alert', 'open', 1, \
             $1 + 60000, $1 + 60000, 1, 10, 10, $1 + 60000, 0, 0, $1, 'apns' \
             FROM generate_series(1, $3) AS i",
        )
        .bind(T0 as i64)
        .bind(prefix)
        .bind(count)
        .execute(&pg)
    };
    open_windows("seed-", seeded).await.unwrap();
    // On the empty (or small) tables: the first group opens each phone's window, the second joins
    // them.
    round(1).await;
    round(2).await;
    // The tables grow: 20,000 events of other hosts, 20,000 open windows of other phones, and
    // 5,000 events of this host from an hour ago (kept for the day, outside its quota's 15
    // minutes), which a look-up of an event by its identity must not read.
    sqlx::query(
        "INSERT INTO push_events (event_id, host_fingerprint, kind, notification_epoch, \
         notification_seq, content_hash, accepted_at, expires_at) \
         SELECT 'bulk-' || i, 'bulkhost' || (i % 500), 'alert', 'e', i, 'h', $1, $1 + 60000 \
         FROM generate_series(1, 20000) AS i \
         UNION ALL SELECT 'old-' || i, $2, 'alert', 'old', i, 'h', $1 - 3600000, $1 - 3300000 \
         FROM generate_series(1, 5000) AS i",
    )
    .bind(T0 as i64)
    .bind(HOST)
    .execute(&pg)
    .await
    .unwrap();
    open_windows("bulk", 20000).await.unwrap();
    let before = probe.reads().await;
    round(3).await;
    let after = probe.reads().await;
    // Every round went the way asked with the plans made on the empty tables (a batched round that
    // fell back to one statement at a time would have planned other texts, on the grown tables),
    // and the last two joined the windows the first opened.
    let batched = if row_by_row { 0 } else { 3 };
    assert_eq!(store.batched_groups(), batched, "rounds batched");
    let joined: Vec<i32> = sqlx::query_scalar(
        "SELECT member_count FROM push_delivery_batches \
         WHERE registration_id LIKE 'phone-%' ORDER BY registration_id",
    )
    .fetch_all(&pg)
    .await
    .unwrap();
    assert_eq!(
        joined,
        vec![3; 8],
        "each phone's window holds the three rounds' alerts"
    );
    probe.assert_by_key(&before, &after, "a group of 8");
}

/// Lanes woken while another lane's claim is still running wait for their turn rather than claim
/// beside it: beside it, `SKIP LOCKED` passes over the batches it holds, and each came back empty
/// and looked again (profiled at 100 end-to-end flows on PostgreSQL: two claims in three came back
/// empty, each four round trips of the server's CPU). The first claim is held here on a lock of a
/// table it reads, so that the others find the work still due.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgresql_lanes_woken_while_one_claims_wait_for_its_turn() {
    let h = harness_with(Backend::Postgres, 60_000).await;
    let Pool::Postgres(pg) = orca_push_queue::open_and_migrate(&h.config).await.unwrap() else {
        unreachable!("a PostgreSQL pool")
    };
    h.admit(&alert(1, &["phone-1"])).await;
    let lanes: Vec<_> = (0..8)
        .map(|i| {
            let queue = h.queue.clone();
            tokio::spawn(async move { queue.claim(&format!("lane-{i}"), 64, 30_000, 3_000).await })
        })
        .collect();
    // Every lane asleep (the work is due in a minute) before the wake.
    h.settled_due_reads().await;
    let mut lock = pg.begin().await.unwrap();
    sqlx::query("LOCK TABLE push_event_recipients IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    h.clock.advance(60_000);
    h.wake.any();
    // A lane that finds the work due while the claim is held waits for its turn no longer than
    // it waits for work.
    let impatient = {
        let queue = h.queue.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let claimed = queue.claim("lane-impatient", 64, 30_000, 200).await;
            (claimed, started.elapsed())
        })
    };
    let (impatient_claimed, waited) = impatient.await.unwrap();
    assert!(impatient_claimed.unwrap().is_empty());
    assert!(
        waited < std::time::Duration::from_millis(800),
        "gave up its turn at its wait: {waited:?}"
    );
    tokio::time::sleep(std::time::Duration::from_millis(1_000).saturating_sub(waited)).await;
    lock.commit().await.unwrap();
    let mut claimed = 0;
    for lane in lanes {
        claimed += lane.await.unwrap().unwrap().len();
    }
    assert_eq!(claimed, 1);
    assert_eq!(
        h.queue.claim_transactions(),
        1,
        "the other lanes waited for the claim, and found the work taken"
    );
}

/// One alert to a phone of its own (an APNs one), due at once; claimed by a lane skipping `skip`,
/// and reported sent.
async fn lane_cycle(store: &orca_push_queue::AnyQueueStore, seq: i64, skip: Skip) {
    use orca_push_queue::store::{Completion, Outcome};
    let now = T0 as i64 + seq;
    let admission = from(HOST, seq, &format!("lane-phone-{seq}"));
    for result in store.enqueue_group(&[&admission], now, 0, None).await {
        result.unwrap();
    }
    let claimed = store.claim("lane", 1, 30_000, now, skip).await.unwrap();
    assert_eq!(claimed.len(), 1, "cycle {seq}: the alert was due");
    let completions: Vec<Completion> = claimed
        .into_iter()
        .map(|b| Completion {
            batch_id: b.batch_id,
            lease_token: b.lease_token,
            outcome: Outcome::Sent,
            reason: "200".into(),
            answered: true,
        })
        .collect();
    assert_eq!(store.complete(&completions, now).await.unwrap(), vec![true]);
}

/// 20,000 events of other hosts, each with its batch for `provider` and its recipient, the batches
/// live and due at `due_at` (as a held provider's pile up).
async fn grow_with_live_batches(pg: &sqlx::PgPool, provider: &str, due_at: i64) {
    for statement in [
        "INSERT INTO push_events (event_id, host_fingerprint, kind, notification_epoch, \
         notification_seq, content_hash, accepted_at, expires_at, payload_json) \
         SELECT 'bulk-' || i, 'bulkhost' || (i % 500), 'alert', 'e', i, 'h', $1, $1 + 60000, '{}' \
         FROM generate_series(1, 20000) AS i",
        "INSERT INTO push_delivery_batches (batch_id, registration_id, host_fingerprint, kind, \
         state, coalescible, window_ends_at, available_at, member_count, members_bytes, \
         routing_bytes, deadline, silent, attempts, created_at, provider) \
         SELECT 'bulk-' || i, 'bulkphone-' || i, 'bulkhost' || (i % 500), 'alert', 'pending', 0, \
         $1, $3, 1, 10, 10, $1 + 60000, 0, 1, $1, $2 \
         FROM generate_series(1, 20000) AS i",
        "INSERT INTO push_event_recipients (event_id, registration_id, batch_id, status, silent, \
         created_at, updated_at) \
         SELECT 'bulk-' || i, 'bulkphone-' || i, 'bulk-' || i, 'pending', 0, $1, $1 \
         FROM generate_series(1, 20000) AS i",
    ] {
        let query = sqlx::query(statement).bind(T0 as i64);
        let query = if statement.contains("$3") {
            query.bind(provider).bind(due_at)
        } else {
            query
        };
        query.execute(pg).await.unwrap();
    }
}

const LANE_TABLES: &[&str] = &[
    "push_events",
    "push_delivery_batches",
    "push_event_recipients",
];

/// A lane's transactions (its claim and its report, with the report's payload clean-up) plan as
/// a group's do: made on the empty tables of a fresh deployment and kept, PostgreSQL's own plans
/// scanned the recipients and events whole on every report (round 29, docs/benchmarks.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_lane_plans_made_on_empty_tables_look_up_by_key_once_they_grow() {
    let probe = PlanProbe::new(LANE_TABLES).await;
    let store = orca_push_queue::AnyQueueStore::new(probe.pool.clone());
    // PostgreSQL plans a kept statement itself five times, then settles on a generic plan.
    for seq in 1..=7 {
        lane_cycle(&store, seq, Skip::default()).await;
    }
    // The tables grow, the batches due in a minute: the claim must find what is due by time, not
    // walk every live batch.
    grow_with_live_batches(&probe.pg, "apns", T0 as i64 + 60_000).await;
    let before = probe.reads().await;
    lane_cycle(&store, 8, Skip::default()).await;
    // What a lane asks before it sleeps: the earliest due time, the minute's piled-up batches.
    let next = store.next_available_at(Skip::default()).await.unwrap();
    assert_eq!(next, Some(T0 as i64 + 60_000));
    let after = probe.reads().await;
    probe.assert_by_key(&before, &after, "one claim, its report and a next-due read");
}

/// A lane whose breaker holds a provider reads none of that provider's piled-up work, with plans
/// made on empty tables: with the due index keyed by time alone, its claim and its next-due read
/// walked every held batch due before the other providers' work (round 47, docs/benchmarks.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_a_lane_leaving_a_held_provider_alone_reads_none_of_its_work() {
    use orca_push_queue::model::Provider;
    let probe = PlanProbe::new(LANE_TABLES).await;
    let store = orca_push_queue::AnyQueueStore::new(probe.pool.clone());
    let fcm_held = Skip::of([Provider::Fcm]);
    for seq in 1..=7 {
        lane_cycle(&store, seq, fcm_held).await;
    }
    // FCM's work piles up, all of it due.
    grow_with_live_batches(&probe.pg, "fcm", T0 as i64).await;
    let before = probe.reads().await;
    lane_cycle(&store, 8, fcm_held).await;
    assert_eq!(store.next_available_at(fcm_held).await.unwrap(), None);
    let after = probe.reads().await;
    probe.assert_by_key(&before, &after, "a claim and a next-due read skipping FCM");
}

/// The clean-up's payload sweep finds events by acceptance time, a step at a time from where the
/// last sweep ended: once the events table has grown far past what the plans were made on, a
/// pass still reads only what was accepted in the last minutes, by key (round 31,
/// docs/benchmarks.md: no index names the payload any more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_payload_sweep_reads_only_the_last_minutes_by_key() {
    let probe = PlanProbe::new(&[
        "push_events",
        "push_event_recipients",
        "push_delivery_batches",
        "push_dismissed_events",
    ])
    .await;
    let pg = probe.pg.clone();
    let store = orca_push_queue::AnyQueueStore::new(probe.pool.clone());
    let minute = 60_000;
    // Passes a minute apart over a few events, each finished with its payload left: the plans are
    // made (five times, then a generic one) on a nearly empty table, and the first pass sweeps the
    // whole retention window.
    for pass in 1..=7_i64 {
        let now = T0 as i64 + pass * minute;
        let admission = from(HOST, pass, &format!("sweep-phone-{pass}"));
        for result in store.enqueue_group(&[&admission], now, 0, None).await {
            result.unwrap();
        }
        sqlx::query("UPDATE push_event_recipients SET status = 'sent'")
            .execute(&pg)
            .await
            .unwrap();
        let cleaned = store.cleanup(now).await.unwrap();
        assert_eq!(cleaned.cleared_payloads, 1, "pass {pass}");
    }
    // 20,000 finished events of other hosts, accepted before the sweep's end.
    sqlx::query(
        "INSERT INTO push_events (event_id, host_fingerprint, kind, notification_epoch, \
         notification_seq, content_hash, accepted_at, expires_at) \
         SELECT 'bulk-' || i, 'bulkhost' || (i % 500), 'alert', 'e', i, 'h', $1, $1 + 60000 \
         FROM generate_series(1, 20000) AS i",
    )
    .bind(T0 as i64 - 60 * minute)
    .execute(&pg)
    .await
    .unwrap();
    // A payload completion left on the last pass's event (cleared, by key) ...
    sqlx::query("UPDATE push_events SET payload_json = '{}' WHERE accepted_at = $1")
        .bind(T0 as i64 + 7 * minute)
        .execute(&pg)
        .await
        .unwrap();
    // ... and one alert still waiting for its phone: its payload stays, its recipients looked up
    // by key.
    let waiting = from(HOST, 8, "sweep-phone-8");
    for result in store
        .enqueue_group(&[&waiting], T0 as i64 + 8 * minute, 0, None)
        .await
    {
        result.unwrap();
    }
    let before = probe.reads().await;
    let cleaned = store.cleanup(T0 as i64 + 8 * minute).await.unwrap();
    let after = probe.reads().await;
    assert_eq!(cleaned.cleared_payloads, 1);
    probe.assert_by_key(&before, &after, "a clean-up pass");
}

/// A fresh PostgreSQL queue whose plans, made on its empty tables, are the ones used after: one
/// connection, and no autovacuum on `tables` (an ANALYZE would make the plans again, on the grown
/// tables). Its statistics are read on a connection of their own.
struct PlanProbe {
    pool: Pool,
    pg: sqlx::PgPool,
    watcher: sqlx::PgPool,
    tables: &'static [&'static str],
}

impl PlanProbe {
    async fn new(tables: &'static [&'static str]) -> Self {
        let url = orca_push_storage::testing::fresh_postgres_url().await;
        let config = orca_push_storage::DatabaseConfig::Postgres {
            url: url.clone().into(),
        };
        let pool = one_connection(&config).await;
        let Pool::Postgres(pg) = pool.clone() else {
            unreachable!("a PostgreSQL pool")
        };
        let watcher = sqlx::PgPool::connect(&url).await.unwrap();
        for table in tables {
            sqlx::query(&format!(
                "ALTER TABLE {table} SET (autovacuum_enabled = false)"
            ))
            .execute(&pg)
            .await
            .unwrap();
        }
        Self {
            pool,
            pg,
            watcher,
            tables,
        }
    }

    /// Each table's sequential scans and index entries read so far (`table_reads`).
    async fn reads(&self) -> Vec<(i64, i64)> {
        table_reads(&self.pg, &self.watcher, self.tables).await
    }

    /// No table was scanned whole between `before` and `after`, and fewer than 1,000 index entries
    /// of each were read for `work`.
    fn assert_by_key(&self, before: &[(i64, i64)], after: &[(i64, i64)], work: &str) {
        for ((table, (scans_before, rows_before)), (scans_after, rows_after)) in
            self.tables.iter().zip(before).zip(after)
        {
            assert_eq!(scans_after, scans_before, "no sequential scan of {table}");
            assert!(
                rows_after - rows_before < 1000,
                "{table}: {} index entries read for {work}",
                rows_after - rows_before
            );
        }
    }
}

/// Each table's sequential scans and index entries read, once the statistics of everything `pg`'s
/// one connection ran so far are in: that connection scans a marker table, and the watcher waits
/// to see it (a server sends a connection's statistics all at once).
async fn table_reads(
    pg: &sqlx::PgPool,
    watcher: &sqlx::PgPool,
    tables: &[&str],
) -> Vec<(i64, i64)> {
    const MARKER: &str = "SELECT COALESCE(seq_scan, 0) FROM pg_stat_user_tables \
         WHERE relname = '_sqlx_migrations' AND schemaname = $1";
    let schema = orca_push_queue::STORAGE.postgres_schema;
    let marker = || {
        sqlx::query_scalar::<_, i64>(MARKER)
            .bind(schema)
            .fetch_one(watcher)
    };
    let marked = marker().await.unwrap();
    // PostgreSQL 15 waits up to 10 s to send an idle connection's statistics unless told not to;
    // before 15, a connection sends them as a transaction ends, at most every 500 ms.
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(pg)
        .await
        .unwrap();
    if version < 150_000 {
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    }
    let marker_scan = if version >= 150_000 {
        "SELECT COUNT(*), pg_stat_force_next_flush() FROM _sqlx_migrations"
    } else {
        "SELECT COUNT(*) FROM _sqlx_migrations"
    };
    sqlx::query(marker_scan).execute(pg).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if marker().await.unwrap() > marked {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server never reported the marker's scan"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut reads = Vec::new();
    for table in tables {
        let read: (i64, i64) = sqlx::query_as(
            "SELECT COALESCE(t.seq_scan, 0), \
             COALESCE((SELECT SUM(i.idx_tup_read) FROM pg_stat_user_indexes i \
               WHERE i.relid = t.relid), 0)::bigint \
             FROM pg_stat_user_tables t WHERE t.relname = $1 AND t.schemaname = $2",
        )
        .bind(table)
        .bind(schema)
        .fetch_one(watcher)
        .await
        .unwrap();
        reads.push(read);
    }
    reads
}

/// A queue whose WAL syncs each wait for the test's word, and answer with it.
fn gated_queue(
    pool: Pool,
) -> (
    std::sync::Arc<orca_push_queue::DeliveryQueue<orca_push_queue::AnyQueueStore>>,
    std::sync::mpsc::Sender<std::io::Result<()>>,
) {
    let (go, gate) = std::sync::mpsc::channel::<std::io::Result<()>>();
    let sync =
        orca_push_storage::WalSync::with_sync(Box::new(move || gate.recv().unwrap_or(Ok(()))));
    let queue = orca_push_queue::DeliveryQueue::new(
        orca_push_queue::AnyQueueStore::new(pool).with_wal_sync(sync),
        std::sync::Arc::new(orca_push_storage::ManualClock::new(T0)),
        WINDOW,
        std::sync::Arc::new(orca_push_queue::Wake::new()),
    );
    (std::sync::Arc::new(queue), go)
}

/// On SQLite (full durability, the default) the writer commits without waiting for the disk, and
/// an admission is answered only once a WAL sync after its commit is done. A failed sync answers
/// it as unavailable, never as `queued`, and so does every later one.
#[tokio::test]
async fn sqlite_answers_an_admission_only_once_its_commit_is_synced() {
    let (config, _guard) = orca_push_storage::testing::fresh(Backend::Sqlite).await;
    let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
    let Pool::Sqlite(writer) = &pool else {
        unreachable!("a SQLite configuration opens SQLite");
    };
    let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(writer)
        .await
        .unwrap();
    assert_eq!(level, 1, "the writer commits at NORMAL; the queue syncs");
    assert!(
        orca_push_queue::AnyQueueStore::new(pool.clone())
            .wal_sync()
            .is_some()
    );
    let (queue, go) = gated_queue(pool.clone());
    let admit = |seq: i64| {
        let queue = queue.clone();
        tokio::spawn(async move {
            let phone = format!("phone-{seq}");
            queue.enqueue(&alert(seq, &[phone.as_str()])).await
        })
    };
    let first = admit(1);
    // Committed (a reader finds it) yet not answered while its sync waits.
    let mut committed = false;
    for _ in 0..200 {
        if queue
            .event_record(HOST, Kind::Alert, "epoch-1", 1)
            .await
            .unwrap()
            .is_some()
        {
            committed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(committed, "the round committed");
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(
        !first.is_finished(),
        "answered before its commit was synced"
    );
    go.send(Ok(())).unwrap();
    let statuses = first.await.unwrap().expect("queued once synced").statuses;
    assert_eq!(statuses[0].1, AdmissionStatus::Queued);
    assert_eq!(queue.broken(), None);
    // The next sync fails: committed, but never answered as queued; nor is anything after it.
    let second = admit(2);
    go.send(Err(std::io::Error::other("the disk went away")))
        .unwrap();
    assert!(second.await.unwrap().is_err());
    assert!(admit(3).await.unwrap().is_err());
    // ...and nothing after it is even written: written, it would be delivered (and charged to
    // its host's quota) while its host was told it was not accepted.
    assert!(
        queue
            .event_record(HOST, Kind::Alert, "epoch-1", 3)
            .await
            .unwrap()
            .is_none(),
        "an admission refused as not durable was written"
    );
    // And its health says so (`routes` reports NOT_SERVING while this names a reason).
    assert!(queue.broken().is_some());
}

/// The SQLite writer keeps the pool's writer connection from one round to the next, and gives it
/// back once no work comes: a write waiting there (a retry, the checkpoint's last step) is not
/// kept waiting by a writer with nothing to do.
#[tokio::test]
async fn an_idle_sqlite_writer_gives_the_pools_writer_back() {
    let (config, _guard) = orca_push_storage::testing::fresh(Backend::Sqlite).await;
    let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
    let Pool::Sqlite(writer) = pool.clone() else {
        unreachable!("a SQLite configuration opens SQLite");
    };
    let queue = orca_push_queue::DeliveryQueue::new(
        orca_push_queue::AnyQueueStore::new(pool),
        std::sync::Arc::new(orca_push_storage::ManualClock::new(T0)),
        WINDOW,
        std::sync::Arc::new(orca_push_queue::Wake::new()),
    );
    queue.enqueue(&alert(1, &["phone-1"])).await.unwrap();
    let taken = tokio::time::timeout(std::time::Duration::from_secs(5), writer.acquire()).await;
    assert!(
        matches!(taken, Ok(Ok(_))),
        "the idle writer kept the pool's writer"
    );
}

/// With work piling up behind a round, its sync runs beside the next one: a later round commits
/// while the earlier one still waits for its sync, and neither is answered before its sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writes_the_next_round_while_a_busy_ones_sync_runs() {
    use std::time::Duration;
    let (config, _guard) = orca_push_storage::testing::fresh(Backend::Sqlite).await;
    let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
    let (queue, go) = gated_queue(pool);
    let admit = |seq: i64| {
        let queue = queue.clone();
        tokio::spawn(async move {
            let admission = from(&format!("host{seq:0>12}"), 1, &format!("phone-{seq}"));
            queue.enqueue(&admission).await
        })
    };
    let committed = |seqs: std::ops::RangeInclusive<i64>| {
        let queue = queue.clone();
        async move {
            for seq in seqs {
                let host = format!("host{seq:0>12}");
                let found = queue.event_record(&host, Kind::Alert, "epoch-1", 1).await;
                if !matches!(found, Ok(Some(_))) {
                    return false;
                }
            }
            true
        }
    };
    let until = |seqs: std::ops::RangeInclusive<i64>| async move {
        for _ in 0..500 {
            if committed(seqs.clone()).await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    };
    // The first round's sync holds the writer (little waited, so the writer syncs itself).
    let first = admit(0);
    assert!(until(0..=0).await);
    // Meanwhile more than a round and the threshold pile up.
    let rest: Vec<_> = (1..=160).map(admit).collect();
    for _ in 0..500 {
        if queue.waiting_for_writer() == 160 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(queue.waiting_for_writer(), 160);
    go.send(Ok(())).unwrap();
    first.await.unwrap().expect("queued once synced");
    // The next round (128) is synced beside the one after it (32), which commits meanwhile.
    assert!(
        until(1..=160).await,
        "the round after a busy one commits while the busy one's sync waits"
    );
    assert!(
        rest.iter().all(|r| !r.is_finished()),
        "nothing is answered before its sync"
    );
    go.send(Ok(())).unwrap();
    go.send(Ok(())).unwrap();
    for admitted in rest {
        let statuses = admitted.await.unwrap().expect("queued").statuses;
        assert_eq!(statuses[0].1, AdmissionStatus::Queued);
    }
}

/// PostgreSQL: a group's dismissals lock their phones' batches all at once, in id order, as a
/// report flush does. Locked a dismissal at a time, a group whose first dismissal's batch sorts
/// after its second's held the first while waiting for the second, and a report holding the
/// second while waiting for the first deadlocked with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_groups_dismissals_lock_their_batches_in_one_order_postgres() {
    let h = harness_with(Backend::Postgres, 0).await;
    let pool = orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap();
    let Pool::Postgres(pg) = &pool else {
        unreachable!("a PostgreSQL pool")
    };
    let other_host = "hostBBBBBBBBBBBB";
    let first = alert(1, &["r1"]);
    let mut second = alert(1, &["r2"]);
    second.host_fingerprint = other_host.into();
    h.admit(&first).await;
    h.admit(&second).await;
    let batch_of = |phone: &'static str| async move {
        sqlx::query_scalar::<_, String>(
            "SELECT batch_id FROM push_delivery_batches WHERE registration_id = $1",
        )
        .bind(phone)
        .fetch_one(pg)
        .await
        .unwrap()
    };
    let (b1, b2) = (batch_of("r1").await, batch_of("r2").await);
    let d1 = dismiss(&first, 2, &["r1"]);
    let mut d2 = dismiss(&second, 2, &["r2"]);
    d2.host_fingerprint = other_host.into();
    // The group's first dismissal names the phone whose batch sorts last.
    let (group, low, high) = if b1 > b2 {
        ([d1, d2], b2, b1)
    } else {
        ([d2, d1], b1, b2)
    };
    // A report flush, in id order: it holds the lower batch...
    let mut report = pg.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '500ms'")
        .execute(&mut *report)
        .await
        .unwrap();
    sqlx::query("SELECT batch_id FROM push_delivery_batches WHERE batch_id = $1 FOR UPDATE")
        .bind(&low)
        .execute(&mut *report)
        .await
        .unwrap();
    let store = h.queue.store().clone();
    let now = i64::try_from(T0).unwrap();
    let round = tokio::spawn(async move {
        let group: Vec<&orca_push_queue::model::Admission> = group.iter().collect();
        store.write_round(&group, &[], &[], now, 0, None).await
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    // ...and takes the higher next, which the group must not be holding while it waits.
    let higher =
        sqlx::query("SELECT batch_id FROM push_delivery_batches WHERE batch_id = $1 FOR UPDATE")
            .bind(&high)
            .execute(&mut *report)
            .await;
    assert!(
        higher.is_ok(),
        "the group held the higher batch: {higher:?}"
    );
    report.commit().await.unwrap();
    let round = round.await.unwrap();
    assert!(
        round.admitted.iter().all(Result::is_ok),
        "{:?}",
        round.admitted
    );
}
