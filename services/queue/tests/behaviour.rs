//! The queue's behaviour with a manual clock, run unchanged against SQLite and PostgreSQL.

use std::sync::Arc;

use orca_push_queue::model::{AdmissionStatus, Kind, delivery_of};
use orca_push_queue::store::{Completion, Outcome, Retry, RetryResult};
use orca_push_queue::{AnyQueueStore, DeliveryQueue};
use orca_push_storage::testing::Backend;

mod support;

use support::*;

on_both_backends!(
    cleanup_sweeps_payloads_by_acceptance_time,
    the_payload_sweep_reads_the_last_minutes_on_every_pass,
    quota_is_300_alerts_and_300_dismissals_per_rolling_15_minutes,
    quota_counts_what_came_before_a_restart_and_a_clock_stepped_back,
    an_event_fanned_out_to_many_phones_counts_once,
    a_phone_named_twice_in_one_admission_gets_it_once,
    a_retry_of_the_same_event_is_queued_again_and_changes_nothing,
    ten_racing_copies_of_one_event_enqueue_it_once,
    fifty_parallel_sends_at_299_used_admit_exactly_one,
    a_burst_within_the_window_is_one_summary,
    one_event_in_the_window_goes_out_as_itself,
    a_full_batch_is_due_at_once_and_the_burst_goes_on,
    the_payload_budget_closes_a_batch_before_32,
    an_event_without_a_notification_id_stays_alone,
    a_dismissal_cancels_pending_alerts_and_fences_older_ones,
    expired_work_is_not_handed_out,
    a_member_past_its_deadline_expires_at_the_claim_and_the_rest_go_out,
    a_deadline_inside_the_window_brings_the_window_forward,
    leases_lapse_renew_and_guard_completion,
    retries_are_persistent_and_never_pass_the_deadline,
    outcomes_are_recorded_per_recipient,
    many_outcomes_commit_together_each_against_its_own_lease,
    concurrent_reports_on_shared_events_all_commit,
    dismissals_racing_the_reports_of_their_alerts_both_commit,
    cleanup_never_clears_a_payload_under_a_recipient_being_added,
    cleanup_clears_payloads_and_forgets_after_24_hours,
    silent_recipients_are_delivered_silently,
    a_new_recipient_of_a_known_event_is_enqueued_without_quota,
    a_dismissal_stops_an_alert_in_flight_from_being_retried,
);

/// 300 alerts of `HOST`, a millisecond apart from the clock's time on, each queued.
async fn spend_the_alert_quota(h: &Harness) {
    for seq in 0..300 {
        assert_eq!(
            h.admit(&alert(seq, &["r1"])).await,
            [AdmissionStatus::Queued],
            "{seq}"
        );
        h.clock.advance(1);
    }
}

async fn quota_is_300_alerts_and_300_dismissals_per_rolling_15_minutes(backend: Backend) {
    let h = harness(backend).await;
    spend_the_alert_quota(&h).await;
    assert_eq!(
        h.admit(&alert(300, &["r1"])).await,
        [AdmissionStatus::RateLimited]
    );
    // Dismissals have their own 300.
    let first = alert(0, &["r1"]);
    assert_eq!(
        h.admit(&dismiss(&first, 1000, &["r1"])).await,
        [AdmissionStatus::Queued]
    );
    // Rolling: the first alert (at T0) leaves the window 15 minutes later, and only it.
    h.clock.set(T0 + 15 * 60 * 1000);
    assert_eq!(
        h.admit(&alert(301, &["r1"])).await,
        [AdmissionStatus::Queued]
    );
    assert_eq!(
        h.admit(&alert(302, &["r1"])).await,
        [AdmissionStatus::RateLimited]
    );
    // A refused event was not stored: after the window it is admitted as new.
    h.clock.set(T0 + 16 * 60 * 1000);
    assert_eq!(
        h.admit(&alert(300, &["r1"])).await,
        [AdmissionStatus::Queued]
    );
}

/// SQLite's writer counts the quota in memory (`store::quota`): what it counts is read from the
/// table, at its first round after a start and again once the clock went back past what it kept.
/// PostgreSQL counts in its statements; the same answers hold.
async fn quota_counts_what_came_before_a_restart_and_a_clock_stepped_back(backend: Backend) {
    const MINUTE: u64 = 60 * 1000;
    let h = harness(backend).await;
    spend_the_alert_quota(&h).await;
    let restarted = h.reopened().await;
    assert_eq!(
        restarted.admit(&alert(300, &["r1"])).await,
        [AdmissionStatus::RateLimited],
        "the 300 admitted before the restart count"
    );
    // An hour on, the window is empty, and what it kept of the first minutes is let go ...
    h.clock.set(T0 + 60 * MINUTE);
    assert_eq!(
        restarted.admit(&alert(301, &["r1"])).await,
        [AdmissionStatus::Queued]
    );
    // ... until the clock steps back: the window then holds the first 300 again, and the one
    // accepted "later", as the table says.
    h.clock.set(T0 + 1000);
    assert_eq!(
        restarted.admit(&alert(302, &["r1"])).await,
        [AdmissionStatus::RateLimited]
    );
    // Dismissals, which take the path one statement at a time, count apart: 300, then refused.
    for seq in 0..300 {
        assert_eq!(
            restarted
                .admit(&dismiss(&alert(seq, &["r1"]), 1000 + seq, &["r1"]))
                .await,
            [AdmissionStatus::Queued],
            "dismissal {seq}"
        );
    }
    assert_eq!(
        restarted
            .admit(&dismiss(&alert(300, &["r1"]), 1300, &["r1"]))
            .await,
        [AdmissionStatus::RateLimited]
    );
}

async fn an_event_fanned_out_to_many_phones_counts_once(backend: Backend) {
    let h = harness(backend).await;
    let phones: Vec<String> = (0..20).map(|i| format!("r{i}")).collect();
    let phones: Vec<&str> = phones.iter().map(String::as_str).collect();
    for seq in 0..300 {
        assert!(
            h.admit(&alert(seq, &phones))
                .await
                .iter()
                .all(|s| *s == AdmissionStatus::Queued)
        );
    }
    assert_eq!(
        h.admit(&alert(300, &["r0"])).await,
        [AdmissionStatus::RateLimited]
    );
}

async fn a_retry_of_the_same_event_is_queued_again_and_changes_nothing(backend: Backend) {
    let h = harness(backend).await;
    let mut first = alert(1, &["r1"]);
    first.expires_at_ms = Some(T0 as i64 + 60_000);
    assert_eq!(h.admit(&first).await, [AdmissionStatus::Queued]);
    h.clock.advance(1_000);
    // Same identity and content, another deadline asked: queued, first deadline kept.
    let mut retry = first.clone();
    retry.expires_at_ms = Some(T0 as i64 + 200_000);
    assert_eq!(h.admit(&retry).await, [AdmissionStatus::Queued]);
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.deadline, T0 as i64 + 60_000);
    assert_eq!(record.recipients.len(), 1);
    // Changed content: error, as the original answers.
    let mut changed = first.clone();
    changed.content.body = "Something else".into();
    assert_eq!(h.admit(&changed).await, [AdmissionStatus::Error]);
    // Nothing new was enqueued: one batch, one member.
    h.clock.advance(WINDOW);
    let batches = h.claim_all().await;
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].members.len(), 1);
    // Past its deadline a retry is an error too.
    h.clock.set(T0 + 60_000);
    assert_eq!(h.admit(&first).await, [AdmissionStatus::Error]);
    // A deadline already past at first acceptance is refused.
    let mut late = alert(2, &["r1"]);
    late.expires_at_ms = Some(T0 as i64);
    assert_eq!(h.admit(&late).await, [AdmissionStatus::Error]);
    // The deadline is capped at five minutes after first acceptance.
    let mut far = alert(3, &["r1"]);
    far.expires_at_ms = Some(i64::MAX);
    h.admit(&far).await;
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 3)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.deadline, record.accepted_at + 5 * 60 * 1000);
}

async fn ten_racing_copies_of_one_event_enqueue_it_once(backend: Backend) {
    let h = harness(backend).await;
    for seq in 0..290 {
        h.admit(&alert(seq, &["other"])).await;
    }
    let copies = (0..10).map(|_| {
        let queue = h.queue.clone();
        tokio::spawn(async move {
            queue
                .enqueue(&alert(500, &["r1", "r2"]))
                .await
                .unwrap()
                .statuses
        })
    });
    for statuses in futures::future::join_all(copies).await {
        assert!(
            statuses
                .unwrap()
                .iter()
                .all(|(_, s)| *s == AdmissionStatus::Queued)
        );
    }
    // One quota unit: 9 more fit, the tenth does not.
    for seq in 1000..1009 {
        assert_eq!(
            h.admit(&alert(seq, &["other"])).await,
            [AdmissionStatus::Queued]
        );
    }
    assert_eq!(
        h.admit(&alert(2000, &["other"])).await,
        [AdmissionStatus::RateLimited]
    );
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 500)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients.len(), 2);
}

async fn fifty_parallel_sends_at_299_used_admit_exactly_one(backend: Backend) {
    let h = harness(backend).await;
    for seq in 0..299 {
        h.admit(&alert(seq, &["r1"])).await;
    }
    let sends = (0..50).map(|i| {
        let queue = h.queue.clone();
        tokio::spawn(async move {
            queue
                .enqueue(&alert(1000 + i, &["r1"]))
                .await
                .unwrap()
                .statuses[0]
                .1
        })
    });
    let statuses: Vec<_> = futures::future::join_all(sends)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == AdmissionStatus::Queued)
            .count(),
        1
    );
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == AdmissionStatus::RateLimited)
            .count(),
        49
    );
}

async fn a_burst_within_the_window_is_one_summary(backend: Backend) {
    let h = harness(backend).await;
    let mut needs = alert(1, &["r1"]);
    needs.content.agent_state = Some("needs-input".into());
    h.admit(&needs).await;
    h.clock.advance(1_000);
    h.admit(&alert(2, &["r1"])).await;
    h.clock.advance(1_000);
    h.admit(&alert(3, &["r1", "r2"])).await;
    // Not due before the window (opened by the first event) ends.
    h.clock.advance(WINDOW - 2_001);
    assert!(h.claim_all().await.is_empty());
    h.clock.advance(1);
    let batches = h.claim_all().await;
    assert_eq!(
        batches.len(),
        1,
        "r1's window ends; r2's, opened later, has not"
    );
    let r1 = batches.iter().find(|b| b.registration_id == "r1").unwrap();
    assert_eq!(r1.members.len(), 3);
    let d = delivery_of(HOST, &r1.members).unwrap();
    assert_eq!(
        (d.title.as_str(), d.body.as_str()),
        ("Orca", "3 agents need attention")
    );
    assert_eq!(d.notification_seq, 3, "the latest event's routing fields");
    assert_eq!(d.coalesced_count, 3);
    assert_eq!(
        d.summary_members,
        vec![
            ("n-1".to_owned(), "epoch-1".to_owned(), 1),
            ("n-2".to_owned(), "epoch-1".to_owned(), 2),
            ("n-3".to_owned(), "epoch-1".to_owned(), 3),
        ]
    );
    h.clock.set(T0 + 2_000 + WINDOW);
    let r2 = h.claim_all().await;
    assert_eq!(
        (
            r2.len(),
            r2[0].registration_id.as_str(),
            r2[0].members.len()
        ),
        (1, "r2", 1)
    );
    // An event after the window was claimed opens a new window.
    h.admit(&alert(4, &["r1"])).await;
    assert!(h.claim_all().await.is_empty());
    h.clock.advance(WINDOW);
    let later = h.claim_all().await;
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].members.len(), 1);
}

async fn one_event_in_the_window_goes_out_as_itself(backend: Backend) {
    let h = harness(backend).await;
    h.admit(&alert(1, &["r1"])).await;
    h.clock.advance(WINDOW);
    let batches = h.claim_all().await;
    let d = delivery_of(HOST, &batches[0].members).unwrap();
    assert_eq!(
        (d.title.as_str(), d.body.as_str()),
        ("Task 1 done", "All good")
    );
    assert_eq!(d.coalesced_count, 1);
    assert!(d.summary_members.is_empty());
}

async fn a_full_batch_is_due_at_once_and_the_burst_goes_on(backend: Backend) {
    let h = harness(backend).await;
    for seq in 0..40 {
        let mut a = alert(seq, &["r1"]);
        a.content.notification_id = Some(format!("{seq}"));
        a.notification_epoch = "e".into();
        h.admit(&a).await;
    }
    let now = h.claim_all().await;
    assert_eq!(now.len(), 1, "the full batch is due before its window ends");
    assert_eq!(now[0].members.len(), 32);
    h.clock.advance(WINDOW);
    let rest = h.claim_all().await;
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].members.len(), 8);
}

async fn the_payload_budget_closes_a_batch_before_32(backend: Backend) {
    let h = harness(backend).await;
    for seq in 0..12 {
        let mut a = alert(seq, &["r1"]);
        a.content.notification_id = Some(format!("{seq:0>400}"));
        h.admit(&a).await;
    }
    // Batches that ran out of payload room are due at once, well before 32 members.
    let due = h.claim_all().await;
    assert!(!due.is_empty());
    h.clock.advance(WINDOW);
    let all: Vec<_> = due.into_iter().chain(h.claim_all().await).collect();
    assert!(all.len() >= 3, "{}", all.len());
    assert_eq!(all.iter().map(|b| b.members.len()).sum::<usize>(), 12);
    for batch in &all {
        // Every summary the provider gets stays within 4 KB with its envelope.
        let d = delivery_of(HOST, &batch.members).unwrap();
        let members_json = serde_json::to_string(&d.summary_members).unwrap();
        assert!(
            members_json.len() + 400 + 700 < 4096,
            "{}",
            members_json.len()
        );
        assert!(batch.members.len() < 32);
    }
}

async fn an_event_without_a_notification_id_stays_alone(backend: Backend) {
    let h = harness(backend).await;
    h.admit(&alert(1, &["r1"])).await;
    let mut bell = alert(2, &["r1"]);
    bell.content.notification_id = None;
    bell.content.source = "terminal-bell".into();
    h.admit(&bell).await;
    let now = h.claim_all().await;
    assert_eq!(now.len(), 1, "due at once, not coalesced");
    assert_eq!(now[0].members.len(), 1);
    assert_eq!(
        delivery_of(HOST, &now[0].members).unwrap().collapse_id,
        format!("host:{HOST}")
    );
}

async fn a_dismissal_cancels_pending_alerts_and_fences_older_ones(backend: Backend) {
    let h = harness(backend).await;
    let a5 = alert(5, &["r1", "r2"]);
    h.admit(&a5).await;
    h.admit(&alert(6, &["r1"])).await;
    // The dismissal (seq 7) covers alert 5 for r1 only.
    assert_eq!(
        h.admit(&dismiss(&a5, 7, &["r1"])).await,
        [AdmissionStatus::Queued]
    );
    let due = h.claim_all().await;
    assert_eq!(due.len(), 1, "a dismissal skips coalescing");
    assert_eq!(due[0].kind, Kind::Dismiss);
    h.clock.advance(WINDOW);
    let alerts = h.claim_all().await;
    let r1 = alerts.iter().find(|b| b.registration_id == "r1").unwrap();
    assert_eq!(r1.members.len(), 1, "alert 5 was taken back");
    assert_eq!(r1.members[0].notification_seq, 6);
    assert!(
        alerts.iter().any(|b| b.registration_id == "r2"),
        "r2 was not dismissed"
    );
    // An older alert of that notification arriving afterwards is never delivered.
    let mut late = alert(4, &["r3"]);
    late.content.notification_id = Some("n-5".into());
    assert_eq!(h.admit(&late).await, [AdmissionStatus::Queued]);
    h.clock.advance(WINDOW);
    assert!(h.claim_all().await.is_empty());
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 4)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients[0].status, "cancelled");
    // A newer one still is.
    let mut newer = alert(8, &["r3"]);
    newer.content.notification_id = Some("n-5".into());
    h.admit(&newer).await;
    h.clock.advance(WINDOW);
    assert_eq!(h.claim_all().await.len(), 1);
}

async fn expired_work_is_not_handed_out(backend: Backend) {
    let h = harness(backend).await;
    let mut short = alert(1, &["r1"]);
    short.expires_at_ms = Some(T0 as i64 + 2_000);
    h.admit(&short).await;
    h.clock.advance(WINDOW);
    assert!(h.claim_all().await.is_empty());
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients[0].status, "expired");
}

/// A window's members keep their own deadlines: one past its own when the window is claimed (no
/// lane took it in time) is recorded expired and left out; the others go out in the batch.
async fn a_member_past_its_deadline_expires_at_the_claim_and_the_rest_go_out(backend: Backend) {
    let h = harness(backend).await;
    let mut short = alert(1, &["r1"]);
    short.expires_at_ms = Some(T0 as i64 + 2_000);
    h.admit(&short).await;
    h.clock.advance(500);
    h.admit(&alert(2, &["r1"])).await;
    h.clock.advance(WINDOW - 500);
    let batches = h.claim_all().await;
    assert_eq!(batches.len(), 1);
    let seqs: Vec<i64> = batches[0]
        .members
        .iter()
        .map(|m| m.notification_seq)
        .collect();
    assert_eq!(seqs, [2], "the short-lived member is left out");
    let record = |seq| h.queue.event_record(HOST, Kind::Alert, "epoch-1", seq);
    let short = record(1).await.unwrap().unwrap();
    assert_eq!(short.recipients[0].status, "expired");
    let kept = record(2).await.unwrap().unwrap();
    assert_eq!(kept.recipients[0].status, "pending");
}

/// A member whose deadline falls inside the window brings the window forward, to a second before
/// that deadline: it is sent, where at the window's end it would have expired unsent. Members
/// that join later go with it.
async fn a_deadline_inside_the_window_brings_the_window_forward(backend: Backend) {
    let h = harness(backend).await;
    let mut short = alert(1, &["r1"]);
    short.expires_at_ms = Some(T0 as i64 + 2_000);
    h.admit(&short).await;
    h.clock.advance(500);
    h.admit(&alert(2, &["r1"])).await;
    h.clock.advance(499);
    assert!(
        h.claim_all().await.is_empty(),
        "not due before the second ahead"
    );
    h.clock.advance(1);
    let batches = h.claim_all().await;
    assert_eq!(batches.len(), 1);
    let seqs: Vec<i64> = batches[0]
        .members
        .iter()
        .map(|m| m.notification_seq)
        .collect();
    assert_eq!(seqs, [1, 2], "one summary, the short-lived member in it");
    // A window already open is brought forward by a later member's deadline too.
    h.admit(&alert(3, &["r2"])).await;
    let mut later = alert(4, &["r2"]);
    later.expires_at_ms = Some(T0 as i64 + 1_000 + 1_500);
    h.admit(&later).await;
    h.clock.advance(500);
    let batches = h.claim_all().await;
    assert_eq!(batches.len(), 1, "due 500 ms in, not at the window's end");
    assert_eq!(batches[0].members.len(), 2);
}

async fn leases_lapse_renew_and_guard_completion(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1"])).await;
    let first = h.claim_all().await.pop().unwrap();
    assert_eq!(first.attempt, 1);
    assert!(
        h.claim_all().await.is_empty(),
        "leased work is not handed out twice"
    );
    h.clock.advance(LEASE as u64 - 1);
    assert!(
        h.queue
            .renew(&first.batch_id, &first.lease_token, LEASE)
            .await
            .unwrap()
            .is_some()
    );
    h.clock.advance(LEASE as u64 - 1);
    assert!(
        h.claim_all().await.is_empty(),
        "the renewed lease still holds"
    );
    h.clock.advance(2);
    // The lane stopped answering: its lease lapsed and another lane takes the batch.
    let second = h
        .claim_all()
        .await
        .pop()
        .expect("reclaimed after the lease lapsed");
    assert_eq!(second.batch_id, first.batch_id);
    // A lease that lapsed is not a provider answer: it costs the batch no attempt.
    assert_eq!(second.attempt, 1);
    assert!(second.recovered);
    // The first lane's late answer is not recorded.
    assert!(
        !h.queue
            .complete(
                &first.batch_id,
                &first.lease_token,
                Outcome::Sent,
                "200",
                true
            )
            .await
            .unwrap()
    );
    assert!(
        h.queue
            .renew(&first.batch_id, &first.lease_token, LEASE)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        h.queue
            .complete(
                &second.batch_id,
                &second.lease_token,
                Outcome::Sent,
                "200",
                true
            )
            .await
            .unwrap()
    );
    h.clock.advance(LEASE as u64 * 2);
    assert!(h.claim_all().await.is_empty(), "completed work is done");
}

async fn retries_are_persistent_and_never_pass_the_deadline(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1"])).await;
    let b = h.claim_all().await.pop().unwrap();
    let at = T0 as i64 + 10_000;
    assert_eq!(
        h.queue
            .retry(&b.batch_id, &b.lease_token, at, "http_429", Retry::Answered)
            .await
            .unwrap(),
        RetryResult::Scheduled
    );
    h.clock.set(T0 + 9_999);
    assert!(h.claim_all().await.is_empty(), "not before the retry time");
    h.clock.set(T0 + 10_000);
    let b = h.claim_all().await.pop().unwrap();
    assert_eq!(b.attempt, 2);
    // A Retry-After beyond the deadline is not shortened: the work expires.
    let past = b.deadline + 1;
    assert_eq!(
        h.queue
            .retry(
                &b.batch_id,
                &b.lease_token,
                past,
                "http_429",
                Retry::Answered
            )
            .await
            .unwrap(),
        RetryResult::Expired
    );
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients[0].status, "expired");
    assert_eq!(record.recipients[0].attempts, 2);
}

async fn outcomes_are_recorded_per_recipient(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1", "r2", "r3"])).await;
    let batches = h.claim_all().await;
    assert_eq!(batches.len(), 3);
    for b in &batches {
        let outcome = match b.registration_id.as_str() {
            "r1" => Outcome::Sent,
            "r2" => Outcome::Dead,
            _ => Outcome::Failed,
        };
        assert!(
            h.queue
                .complete(&b.batch_id, &b.lease_token, outcome, "x", true)
                .await
                .unwrap()
        );
    }
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    let status = |r: &str| {
        record
            .recipients
            .iter()
            .find(|x| x.registration_id == r)
            .unwrap()
            .status
            .clone()
    };
    assert_eq!(
        (status("r1"), status("r2"), status("r3")),
        ("sent".into(), "dead".into(), "failed".into())
    );
    assert!(
        h.queue
            .event_record(HOST, Kind::Alert, "epoch-1", 2)
            .await
            .unwrap()
            .is_none()
    );
}

async fn many_outcomes_commit_together_each_against_its_own_lease(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1", "r2", "r3"])).await;
    h.admit(&alert(2, &["r1"])).await;
    let batches = h.claim_all().await;
    assert_eq!(batches.len(), 4);
    let report = |b: &orca_push_queue::store::ClaimedBatch, token: &str, outcome| Completion {
        batch_id: b.batch_id.clone(),
        lease_token: token.into(),
        outcome,
        reason: "x".into(),
        answered: true,
    };
    let by = |r: &str, seq: i64| {
        batches
            .iter()
            .find(|b| b.registration_id == r && b.members[0].notification_seq == seq)
            .unwrap()
    };
    let (r1, r2, r3, second) = (by("r1", 1), by("r2", 1), by("r3", 1), by("r1", 2));
    let recorded = h
        .queue
        .complete_many(vec![
            report(r1, &r1.lease_token, Outcome::Sent),
            // Someone else's lease: nothing is written for it, and the others still commit.
            report(r2, "not-the-lease", Outcome::Sent),
            report(r3, &r3.lease_token, Outcome::Dead),
            report(second, &second.lease_token, Outcome::Failed),
        ])
        .await
        .unwrap();
    assert_eq!(recorded, [true, false, true, true]);
    let status = |seq: i64, r: &'static str| {
        let queue = h.queue.clone();
        async move {
            queue
                .event_record(HOST, Kind::Alert, "epoch-1", seq)
                .await
                .unwrap()
                .unwrap()
                .recipients
                .into_iter()
                .find(|x| x.registration_id == r)
                .unwrap()
                .status
        }
    };
    assert_eq!(status(1, "r1").await, "sent");
    assert_eq!(status(1, "r2").await, "pending", "its lease still holds it");
    assert_eq!(status(1, "r3").await, "dead");
    assert_eq!(status(2, "r1").await, "failed");
    // Event 2 is finished for everyone: its payload is cleared; event 1 still waits for r2.
    assert_eq!(payload_count(&h).await, 1);
    // The lane that holds r2 answers later, alone.
    assert!(
        h.queue
            .complete(&r2.batch_id, &r2.lease_token, Outcome::Sent, "200", true)
            .await
            .unwrap()
    );
    assert_eq!(payload_count(&h).await, 0);
    assert!(h.queue.complete_many(Vec::new()).await.unwrap().is_empty());
    let too_many = vec![report(r1, &r1.lease_token, Outcome::Sent); 257];
    assert!(matches!(
        h.queue.complete_many(too_many).await,
        Err(orca_push_queue::QueueError::InvalidRequest(_))
    ));
}

async fn a_phone_named_twice_in_one_admission_gets_it_once(backend: Backend) {
    let h = harness_with(backend, 0).await;
    assert_eq!(
        h.admit(&alert(1, &["r1", "r2", "r1"])).await,
        [AdmissionStatus::Queued; 3],
        "one status per id named"
    );
    let batches = h.claim_all().await;
    let mut phones: Vec<_> = batches.iter().map(|b| b.registration_id.as_str()).collect();
    phones.sort_unstable();
    assert_eq!(phones, ["r1", "r2"]);
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients.len(), 2);
    // One claim leases every due batch, each checked on its own when it is answered.
    assert!(batches.iter().all(|b| b.attempt == 1 && !b.recovered));
    for b in &batches {
        assert!(
            h.queue
                .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "200", true)
                .await
                .unwrap()
        );
        assert!(
            !h.queue
                .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "200", true)
                .await
                .unwrap(),
            "a finished batch is not finished twice"
        );
    }
}

async fn concurrent_reports_on_shared_events_all_commit(backend: Backend) {
    let h = harness_with(backend, 0).await;
    for round in 0..4 {
        let first = round * 30;
        for seq in first..first + 30 {
            h.admit(&alert(seq, &["r1", "r2"])).await;
        }
        let batches = h.claim_all().await;
        assert_eq!(batches.len(), 60);
        let report = |r: &str, order: &dyn Fn(i64) -> i64| {
            let mut mine: Vec<_> = batches.iter().filter(|b| b.registration_id == r).collect();
            mine.sort_by_key(|b| order(b.members[0].notification_seq));
            mine.into_iter()
                .map(|b| Completion {
                    batch_id: b.batch_id.clone(),
                    lease_token: b.lease_token.clone(),
                    outcome: Outcome::Sent,
                    reason: "200".into(),
                    answered: true,
                })
                .collect::<Vec<_>>()
        };
        // Two lanes finish the two recipients of the same events, in opposite orders, at once.
        let (a, b) = tokio::join!(
            h.queue.complete_many(report("r1", &|seq| seq)),
            h.queue.complete_many(report("r2", &|seq| -seq)),
        );
        assert_eq!(a.expect("first lane's reports"), [true; 30]);
        assert_eq!(b.expect("second lane's reports"), [true; 30]);
    }
    // Each of two concurrent transactions may still see the other's recipient pending and keep
    // the payload; the minute's cleanup clears what completion missed, before any deadline.
    restore_payloads(&h).await;
    assert_eq!(payload_count(&h).await, 120);
    let cleaned = h.queue.cleanup().await.unwrap();
    assert_eq!(
        (cleaned.cleared_payloads, cleaned.expired_batches),
        (120, 0)
    );
    assert_eq!(payload_count(&h).await, 0);
}

async fn cleanup_clears_payloads_and_forgets_after_24_hours(backend: Backend) {
    let h = harness_with(backend, 0).await;
    delivered(&h, 1).await;
    h.admit(&alert(2, &["r1"])).await;
    h.clock.advance(5 * 60 * 1000);
    let cleaned = h.queue.cleanup().await.unwrap();
    assert_eq!(
        cleaned.expired_batches, 1,
        "alert 2 was never claimed before its deadline"
    );
    // Identities and outcomes stay for 24 hours, then go.
    assert!(
        h.queue
            .event_record(HOST, Kind::Alert, "epoch-1", 1)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        payload_count(&h).await == 0,
        "payloads are cleared at completion or expiry"
    );
    h.clock.set(T0 + 24 * 60 * 60 * 1000 + 1);
    let cleaned = h.queue.cleanup().await.unwrap();
    assert_eq!(cleaned.deleted_events, 2);
    assert_eq!(cleaned.deleted_batches, 2);
    assert!(
        h.queue
            .event_record(HOST, Kind::Alert, "epoch-1", 1)
            .await
            .unwrap()
            .is_none()
    );
}

/// The clean-up finds payloads that completion missed by acceptance time (no index names the
/// payload, so clearing it stays a heap-only update on PostgreSQL): its first pass reads the
/// whole retention window, later ones only what was accepted since, and the last minutes again.
async fn cleanup_sweeps_payloads_by_acceptance_time(backend: Backend) {
    let h = harness_with(backend, 0).await;
    delivered(&h, 1).await;
    assert_eq!(payload_count(&h).await, 0, "cleared at completion");
    // Left by completion, and found twenty hours later by the first pass.
    restore_payloads(&h).await;
    h.clock.advance(20 * 60 * 60 * 1000);
    let cleaned = h.queue.cleanup().await.unwrap();
    assert_eq!(
        cleaned.cleared_payloads, 1,
        "the first pass reads the retention window"
    );
    // An expired event's payload never comes back (an admission of it is refused): one put back
    // here by hand shows that the sweep does not read what it swept again.
    restore_payloads(&h).await;
    h.clock.advance(60 * 1000);
    assert_eq!(h.queue.cleanup().await.unwrap().cleared_payloads, 0);
    assert_eq!(payload_count(&h).await, 1);
    // Work of the last minutes is read on every pass.
    clear_payloads(&h).await;
    delivered(&h, 2).await;
    restore_payloads(&h).await;
    assert_eq!(payload_count(&h).await, 2);
    h.clock.advance(1_000);
    assert_eq!(h.queue.cleanup().await.unwrap().cleared_payloads, 1);
    h.clock.advance(60 * 1000);
    restore_payloads(&h).await;
    assert_eq!(h.queue.cleanup().await.unwrap().cleared_payloads, 1);
}

/// Each pass reads the last six minutes whole, whatever the sweep's end: a payload completion left
/// on an event not yet expired, or one that has just expired, is cleared at the next pass.
async fn the_payload_sweep_reads_the_last_minutes_on_every_pass(backend: Backend) {
    let h = harness_with(backend, 0).await;
    delivered(&h, 1).await;
    // Passes each minute: the sweep's end moves along behind them.
    for _ in 0..3 {
        h.clock.advance(60 * 1000);
        assert_eq!(h.queue.cleanup().await.unwrap().cleared_payloads, 0);
    }
    restore_payloads(&h).await;
    assert_eq!(
        h.queue.cleanup().await.unwrap().cleared_payloads,
        1,
        "finished, not expired, three minutes after acceptance"
    );
    h.clock.set(T0 + 5 * 60 * 1000 + 30 * 1000);
    restore_payloads(&h).await;
    assert_eq!(
        h.queue.cleanup().await.unwrap().cleared_payloads,
        1,
        "expired, five and a half minutes after acceptance"
    );
}

/// On PostgreSQL, clearing a finished event's payload is a heap-only update: the new row version
/// stays on the old one's page and no index gets an entry for it (no index names the payload, and
/// the table's pages keep room for it). Profiled at 100 end-to-end flows, the clearing update
/// cost 0.92 ms a call while an index named the payload, 0.29 ms after (round 31,
/// docs/benchmarks.md).
#[tokio::test]
async fn postgresql_clears_a_payload_in_place() {
    let h = harness_with(Backend::Postgres, 0).await;
    delivered(&h, 1).await;
    assert_eq!(payload_count(&h).await, 0);
    let orca_push_storage::Pool::Postgres(pg) =
        orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
            .await
            .unwrap()
    else {
        unreachable!("a PostgreSQL pool")
    };
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pageinspect")
        .execute(&pg)
        .await
        .unwrap();
    // HEAP_ONLY_TUPLE (0x8000) in t_infomask2: a version that no index entry points at.
    let heap_only: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM heap_page_items(get_raw_page('push_events', 0)) \
         WHERE t_infomask2 & 32768 <> 0",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(heap_only, 1, "the cleared version is heap-only");
    let options: Option<Vec<String>> =
        sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE oid = 'push_events'::regclass")
            .fetch_one(&pg)
            .await
            .unwrap();
    assert_eq!(options, Some(vec!["fillfactor=70".to_owned()]));
}

async fn dismissals_racing_the_reports_of_their_alerts_both_commit(backend: Backend) {
    let h = harness_with(backend, 0).await;
    for round in 0..20 {
        let alerts: Vec<_> = (0..8)
            .map(|i| alert(round * 100 + i, &["r1", "r2"]))
            .collect();
        for a in &alerts {
            h.admit(a).await;
        }
        let batches = h.claim_all().await;
        assert_eq!(batches.len(), 16);
        let reports = batches
            .iter()
            .map(|b| Completion {
                batch_id: b.batch_id.clone(),
                lease_token: b.lease_token.clone(),
                outcome: Outcome::Sent,
                reason: "200".into(),
                answered: true,
            })
            .collect();
        // A lane reports the alerts while the host dismisses them (dismissals take back what is
        // still pending of their alerts, on the same phone's batches).
        let queue = h.queue.clone();
        let dismissals = tokio::spawn(async move {
            for (i, a) in alerts.iter().enumerate() {
                let phones: &[&str] = if i % 2 == 0 {
                    &["r1", "r2"]
                } else {
                    &["r2", "r1"]
                };
                queue
                    .enqueue(&dismiss(a, a.notification_seq + 50, phones))
                    .await
                    .expect("a dismissal");
            }
        });
        let reported = h.queue.complete_many(reports).await;
        dismissals.await.unwrap();
        reported.expect("the lane's reports");
        // Dismissal batches are due at once; clear them for the next round.
        for b in h.claim_all().await {
            h.queue
                .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "200", true)
                .await
                .unwrap();
        }
    }
}

async fn cleanup_never_clears_a_payload_under_a_recipient_being_added(backend: Backend) {
    let h = harness_with(backend, 0).await;
    delivered(&h, 1).await;
    // A payload with no pending recipient, as completion can leave it.
    restore_payloads(&h).await;
    // An admission of the same event for another phone is under way: it holds the event's row
    // (as `enqueue` does) and has added a pending recipient, not yet committed.
    let lock = "UPDATE push_events SET payload_json = COALESCE(payload_json, '{}')";
    let add = "INSERT INTO push_event_recipients (event_id, registration_id, batch_id, status, \
               silent, created_at, updated_at) SELECT event_id, 'r2', NULL, 'pending', 0, 0, 0 \
               FROM push_events";
    let cleanup = |queue: Arc<DeliveryQueue<AnyQueueStore>>| {
        tokio::spawn(async move { queue.cleanup().await.unwrap() })
    };
    let pause = std::time::Duration::from_millis(300);
    match orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap()
    {
        orca_push_storage::Pool::Sqlite(p) => {
            let mut tx = p.begin_with("BEGIN IMMEDIATE").await.unwrap();
            sqlx::query(lock).execute(&mut *tx).await.unwrap();
            sqlx::query(add).execute(&mut *tx).await.unwrap();
            let cleaning = cleanup(h.queue.clone());
            tokio::time::sleep(pause).await;
            tx.commit().await.unwrap();
            cleaning.await.unwrap();
        }
        orca_push_storage::Pool::Postgres(p) => {
            let mut tx = p.begin().await.unwrap();
            sqlx::query(lock).execute(&mut *tx).await.unwrap();
            sqlx::query(add).execute(&mut *tx).await.unwrap();
            let cleaning = cleanup(h.queue.clone());
            tokio::time::sleep(pause).await;
            tx.commit().await.unwrap();
            cleaning.await.unwrap();
        }
    }
    assert_eq!(payload_count(&h).await, 1, "r2 still needs the payload");
}

/// Alert `seq` to phone `r1`, claimed and reported sent.
async fn delivered(h: &Harness, seq: i64) {
    h.admit(&alert(seq, &["r1"])).await;
    let b = h.claim_all().await.pop().unwrap();
    assert!(
        h.queue
            .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "200", true)
            .await
            .unwrap(),
        "alert {seq} reported sent"
    );
}

/// Puts a payload back on every event, as if completion had missed clearing it.
async fn restore_payloads(h: &Harness) {
    set_payloads(h, "UPDATE push_events SET payload_json = '{}'").await;
}

/// Clears every payload by hand.
async fn clear_payloads(h: &Harness) {
    set_payloads(h, "UPDATE push_events SET payload_json = NULL").await;
}

async fn set_payloads(h: &Harness, sql: &str) {
    match orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap()
    {
        orca_push_storage::Pool::Sqlite(p) => drop(sqlx::query(sql).execute(&p).await.unwrap()),
        orca_push_storage::Pool::Postgres(p) => drop(sqlx::query(sql).execute(&p).await.unwrap()),
    }
}

async fn payload_count(h: &Harness) -> i64 {
    match orca_push_storage::open(&h.config, &orca_push_queue::STORAGE)
        .await
        .unwrap()
    {
        orca_push_storage::Pool::Sqlite(p) => {
            sqlx::query_scalar("SELECT COUNT(*) FROM push_events WHERE payload_json IS NOT NULL")
                .fetch_one(&p)
                .await
                .unwrap()
        }
        orca_push_storage::Pool::Postgres(p) => {
            sqlx::query_scalar("SELECT COUNT(*) FROM push_events WHERE payload_json IS NOT NULL")
                .fetch_one(&p)
                .await
                .unwrap()
        }
    }
}

async fn silent_recipients_are_delivered_silently(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let mut a = alert(1, &["loud", "quiet"]);
    a.recipients[1].silent = true;
    h.admit(&a).await;
    let batches = h.claim_all().await;
    assert!(
        !batches
            .iter()
            .find(|b| b.registration_id == "loud")
            .unwrap()
            .silent
    );
    assert!(
        batches
            .iter()
            .find(|b| b.registration_id == "quiet")
            .unwrap()
            .silent
    );
}

async fn a_new_recipient_of_a_known_event_is_enqueued_without_quota(backend: Backend) {
    let h = harness_with(backend, 0).await;
    for seq in 0..300 {
        h.admit(&alert(seq, &["r1"])).await;
    }
    // The host's 21st device gets the same event in its own request, even at the quota.
    assert_eq!(
        h.admit(&alert(299, &["r21"])).await,
        [AdmissionStatus::Queued]
    );
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 299)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients.len(), 2);
}

async fn a_dismissal_stops_an_alert_in_flight_from_being_retried(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let a5 = alert(5, &["r1"]);
    h.admit(&a5).await;
    let in_flight = h.claim_all().await.pop().unwrap();
    // The dismissal arrives while the alert is at the provider, which then asks for a retry.
    h.admit(&dismiss(&a5, 6, &["r1"])).await;
    let dismissal = h.claim_all().await.pop().unwrap();
    assert_eq!(dismissal.kind, Kind::Dismiss);
    let retried = h
        .queue
        .retry(
            &in_flight.batch_id,
            &in_flight.lease_token,
            T0 as i64 + 1_000,
            "http_503",
            Retry::Answered,
        )
        .await
        .unwrap();
    assert_eq!(retried, RetryResult::Scheduled);
    h.clock.advance(1_000);
    assert!(
        h.claim_all().await.is_empty(),
        "the dismissed alert is not delivered again"
    );
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 5)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients[0].status, "cancelled");
}
