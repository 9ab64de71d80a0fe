//! Work due at once goes straight to a waiting claim: the admission writes its batch already
//! leased and answers the claim once the group commits, with no claim transaction after it.

mod support;

use std::time::Duration;

use orca_push_queue::model::Provider;
use orca_push_queue::store::{Outcome, Skip};
use orca_push_storage::testing::Backend;
use support::*;

on_both_backends!(
    a_waiting_claim_is_handed_work_due_at_once,
    a_claim_is_not_handed_its_held_providers_work_nor_windows,
);

/// PostgreSQL does not hand off (`PgQueueStore::HANDS_OFF`): its waiting claims are woken and claim
/// as before. Elsewhere in this file, what each backend does with it.
fn hands_off(backend: Backend) -> bool {
    matches!(backend, Backend::Sqlite)
}

async fn a_waiting_claim_is_handed_work_due_at_once(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, LEASE, 5_000).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut first = alert(1, &["phone-1", "phone-2"]);
    first.trace_parent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    h.admit(&first).await;
    let claimed = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("answered at the admission's commit, not at the claim's wait")
        .unwrap()
        .unwrap();
    let mut phones: Vec<&str> = claimed.iter().map(|b| b.registration_id.as_str()).collect();
    phones.sort_unstable();
    assert_eq!(phones, vec!["phone-1", "phone-2"]);
    if hands_off(backend) {
        assert_eq!(h.queue.claim_transactions(), 0, "no claim transaction");
        assert_eq!(h.queue.handed_claims(), 1);
    } else {
        assert_eq!(h.queue.claim_transactions(), 1, "claimed as before");
        assert_eq!(h.queue.handed_claims(), 0);
    }
    let batch = &claimed[0];
    assert_eq!(batch.members.len(), 1);
    assert_eq!(batch.members[0].notification_seq, 1);
    assert_eq!(batch.members[0].content.title, "Task 1 done");
    assert_eq!(batch.members[0].trace_parent, first.trace_parent);
    assert_eq!(batch.lease_expires_at, T0 as i64 + LEASE);
    assert_eq!(batch.attempt, 1);
    // Stored under that lease: no other lane claims it, its lease renews, and it reports.
    assert!(h.claim_all().await.is_empty(), "leased, so nothing is due");
    assert!(
        h.queue
            .renew(&batch.batch_id, &batch.lease_token, LEASE)
            .await
            .unwrap()
            .is_some()
    );
    for b in &claimed {
        let done = h
            .queue
            .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "sent", true)
            .await
            .unwrap();
        assert!(done, "reported under the handed lease");
    }
    let record = h
        .queue
        .event_record(HOST, orca_push_queue::model::Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert!(record.recipients.iter().all(|r| r.status == "sent"));
    // A lane that went quiet lets its handed lease lapse like a claimed one: recovered then.
    let queue = h.queue.clone();
    let waiting = tokio::spawn(async move { queue.claim("lane-wait", 64, LEASE, 5_000).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.admit(&alert(2, &["phone-1"])).await;
    let lost = waiting.await.unwrap().unwrap();
    assert_eq!(lost.len(), 1);
    assert_eq!(
        h.queue.handed_claims(),
        if hands_off(backend) { 2 } else { 0 }
    );
    h.clock.advance(LEASE as u64);
    let recovered = h.claim_all().await;
    assert_eq!(recovered.len(), 1);
    assert_eq!(recovered[0].batch_id, lost[0].batch_id);
    assert!(recovered[0].recovered);
}

/// A claim that skips a held provider is not handed that provider's work, and a coalescing window
/// is not due at once: both stay for claims, as before.
async fn a_claim_is_not_handed_its_held_providers_work_nor_windows(backend: Backend) {
    let h = harness(backend).await;
    let queue = h.queue.clone();
    let apns_held = Skip::of([Provider::Apns]);
    let waiting = tokio::spawn(async move {
        queue
            .claim_skipping("lane-wait", 64, LEASE, 600, apns_held)
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut no_window = alert(1, &["phone-apns"]);
    no_window.content.notification_id = None;
    h.admit(&no_window).await;
    let mut windowed = alert(2, &["phone-fcm"]);
    windowed.recipients[0].provider = Provider::Fcm;
    h.admit(&windowed).await;
    assert!(waiting.await.unwrap().unwrap().is_empty());
    assert_eq!(h.queue.handed_claims(), 0);
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1, "the APNs alert is due, for a claim");
    assert_eq!(claimed[0].registration_id, "phone-apns");
    h.clock.advance(WINDOW);
    assert_eq!(h.claim_all().await.len(), 1, "the window, once it ends");
}
