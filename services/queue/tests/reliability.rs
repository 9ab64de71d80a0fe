//! What the queue keeps for a send answered `queued` through failures: attempts counted only when a
//! provider answered, each coalesced member expiring at its own deadline, a failing provider's
//! work held in one statement and released when it recovers. On SQLite and PostgreSQL.

mod support;

use orca_push_queue::model::{Kind, Provider};
use orca_push_queue::store::{Outcome, Retry, RetryResult};
use orca_push_storage::Clock as _;
use orca_push_storage::testing::Backend;
use support::*;

on_both_backends!(
    only_provider_answers_count_as_attempts,
    each_coalesced_member_keeps_its_own_deadline,
    a_failing_providers_work_is_held_and_released,
    a_released_batch_never_goes_before_its_own_retry_time,
    a_held_backlog_is_written_once_and_probed_one_batch_at_a_time,
    a_probe_is_never_a_batch_past_its_deadline,
    a_retry_under_a_lapsed_lease_writes_nothing,
    a_batch_reported_twice_in_one_call_is_finished_once,
);

/// Reports are finished in one statement: a batch named twice in one call is finished by the first
/// report only, as one statement per report did (the second found the lease gone).
async fn a_batch_reported_twice_in_one_call_is_finished_once(backend: Backend) {
    use orca_push_queue::store::Completion;
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1"])).await;
    let b = h.claim_all().await.pop().unwrap();
    let report = |outcome, answered| Completion {
        batch_id: b.batch_id.clone(),
        lease_token: b.lease_token.clone(),
        outcome,
        reason: "x".into(),
        answered,
    };
    let recorded = h
        .queue
        .complete_many(vec![
            report(Outcome::Sent, true),
            report(Outcome::Dead, true),
        ])
        .await
        .unwrap();
    assert_eq!(recorded, [true, false]);
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients[0].status, "sent");
    assert_eq!(record.recipients[0].attempts, 1, "one answer counted");
}

/// The retry's one-statement path checks the lease: a lane whose lease lapsed and was claimed again
/// by another cannot move the batch from under it.
async fn a_retry_under_a_lapsed_lease_writes_nothing(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1"])).await;
    let first = h.claim_all().await.pop().unwrap();
    h.clock.advance(LEASE as u64 + 1);
    let second = h.claim_all().await.pop().unwrap();
    assert!(second.recovered);
    let at = h.clock.now_ms() as i64 + 1_000;
    let late = h
        .queue
        .retry(
            &first.batch_id,
            &first.lease_token,
            at,
            "x",
            Retry::Answered,
        )
        .await
        .unwrap();
    assert_eq!(late, RetryResult::LeaseLost);
    // Still the second lane's: its own retry goes through, with no attempt added by the first.
    let own = h
        .queue
        .retry(
            &second.batch_id,
            &second.lease_token,
            at,
            "x",
            Retry::Unanswered,
        )
        .await
        .unwrap();
    assert_eq!(own, RetryResult::Scheduled);
    h.clock.set(at as u64);
    let third = h.claim_all().await.pop().unwrap();
    assert_eq!((third.attempt, third.retries), (1, 1));
}

async fn only_provider_answers_count_as_attempts(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1"])).await;
    let mut at = T0 as i64;
    let mut next = |h: &Harness| {
        at += 1_000;
        h.clock.set(at as u64);
    };
    // Never reached the provider (connection refused, registry down): a retry, not an attempt.
    let b = h.claim_all().await.pop().unwrap();
    assert_eq!((b.attempt, b.retries), (1, 0));
    let retry = |b: &orca_push_queue::store::ClaimedBatch, how| {
        let queue = h.queue.clone();
        let (id, token) = (b.batch_id.clone(), b.lease_token.clone());
        let at = h.clock.now_ms() as i64 + 1_000;
        async move { queue.retry(&id, &token, at, "x", how).await.unwrap() }
    };
    assert_eq!(retry(&b, Retry::Unanswered).await, RetryResult::Scheduled);
    next(&h);
    let b = h.claim_all().await.pop().unwrap();
    assert_eq!((b.attempt, b.retries), (1, 1));
    // Handed back untried (a stopping lane, a held provider): neither.
    assert_eq!(retry(&b, Retry::HandBack).await, RetryResult::Scheduled);
    next(&h);
    let b = h.claim_all().await.pop().unwrap();
    assert_eq!((b.attempt, b.retries), (1, 1));
    // A provider's answer: both.
    assert_eq!(retry(&b, Retry::Answered).await, RetryResult::Scheduled);
    next(&h);
    let b = h.claim_all().await.pop().unwrap();
    assert_eq!((b.attempt, b.retries), (2, 2));
    // A lease that lapsed: neither.
    h.clock.advance(LEASE as u64 + 1);
    let b = h.claim_all().await.pop().unwrap();
    assert!(b.recovered);
    assert_eq!((b.attempt, b.retries), (2, 2));
    assert!(
        h.queue
            .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "200", true)
            .await
            .unwrap()
    );
    let record = h
        .queue
        .event_record(HOST, Kind::Alert, "epoch-1", 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.recipients[0].attempts, 2, "two provider answers");
}

async fn each_coalesced_member_keeps_its_own_deadline(backend: Backend) {
    let h = harness(backend).await;
    let mut short = alert(1, &["r1"]);
    short.expires_at_ms = Some(T0 as i64 + 5_000);
    let mut long = alert(2, &["r1"]);
    long.expires_at_ms = Some(T0 as i64 + 60_000);
    h.admit(&short).await;
    h.admit(&long).await;
    // One summary of both, sent no later than its earliest member's deadline.
    h.clock.advance(WINDOW);
    let b = h.claim_all().await.pop().unwrap();
    assert_eq!(b.members.len(), 2);
    assert_eq!(b.deadline, T0 as i64 + 5_000);
    // The provider asked for a retry that lands past the first member's deadline.
    let at = T0 as i64 + 10_000;
    assert_eq!(
        h.queue
            .retry(&b.batch_id, &b.lease_token, at, "http_503", Retry::Answered)
            .await
            .unwrap(),
        RetryResult::Scheduled,
        "the second member is still before its deadline"
    );
    h.clock.set(at as u64);
    let b = h.claim_all().await.pop().unwrap();
    assert_eq!(b.members.len(), 1, "the expired member is not sent");
    assert_eq!(b.members[0].notification_seq, 2);
    assert_eq!(b.deadline, T0 as i64 + 60_000);
    assert!(
        h.queue
            .complete(&b.batch_id, &b.lease_token, Outcome::Sent, "200", true)
            .await
            .unwrap()
    );
    let status = |seq| {
        let queue = h.queue.clone();
        async move {
            queue
                .event_record(HOST, Kind::Alert, "epoch-1", seq)
                .await
                .unwrap()
                .unwrap()
                .recipients[0]
                .status
                .clone()
        }
    };
    assert_eq!(status(1).await, "expired", "not reported as sent");
    assert_eq!(status(2).await, "sent");
}

async fn a_failing_providers_work_is_held_and_released(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let mut ios = alert(1, &["iphone"]);
    ios.recipients[0].provider = Provider::Apns;
    let mut android = alert(2, &["pixel"]);
    android.recipients[0].provider = Provider::Fcm;
    h.admit(&ios).await;
    h.admit(&android).await;
    let until = T0 as i64 + 20_000;
    assert_eq!(h.queue.hold(Provider::Apns, until, None).await.unwrap(), 1);
    // Only the other provider's work is handed out meanwhile.
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].registration_id, "pixel");
    assert_eq!(claimed[0].provider, Provider::Fcm);
    h.clock.advance(5_000);
    assert!(h.claim_all().await.is_empty(), "held");
    // The provider answers again: its work is due at once, not at the end of the hold.
    assert_eq!(h.queue.release(Provider::Apns, None).await.unwrap(), 1);
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].registration_id, "iphone");
    // Bad requests are errors, not writes.
    assert!(h.queue.hold(Provider::Unknown, until, None).await.is_err());
    assert!(h.queue.hold(Provider::Fcm, T0 as i64, None).await.is_err());
}

async fn a_released_batch_never_goes_before_its_own_retry_time(backend: Backend) {
    let h = harness_with(backend, 0).await;
    h.admit(&alert(1, &["r1"])).await;
    let b = h.claim_all().await.pop().unwrap();
    // The provider asked for 30 s (Retry-After); then the breaker held the provider for 60 s.
    let retry_after = T0 as i64 + 30_000;
    h.queue
        .retry(
            &b.batch_id,
            &b.lease_token,
            retry_after,
            "http_429",
            Retry::Answered,
        )
        .await
        .unwrap();
    assert_eq!(
        h.queue
            .hold(Provider::Apns, T0 as i64 + 60_000, None)
            .await
            .unwrap(),
        1
    );
    h.clock.advance(10_000);
    h.queue.release(Provider::Apns, None).await.unwrap();
    assert!(
        h.claim_all().await.is_empty(),
        "Retry-After is never shortened"
    );
    h.clock.set(retry_after as u64);
    assert_eq!(h.claim_all().await.len(), 1);
}

async fn a_held_backlog_is_written_once_and_probed_one_batch_at_a_time(backend: Backend) {
    let h = harness_with(backend, 0).await;
    for seq in 0..5 {
        h.admit(&alert(seq, &["iphone"])).await;
    }
    let five_minutes = T0 as i64 + 300_000;
    let probe_at = T0 as i64 + 2_000;
    assert_eq!(
        h.queue
            .hold(Provider::Apns, five_minutes, Some(probe_at))
            .await
            .unwrap(),
        5
    );
    // The next hold (a failed probe) writes only what would come due before its probe.
    h.admit(&alert(9, &["iphone"])).await;
    h.clock.advance(2_000);
    assert_eq!(
        h.queue
            .hold(Provider::Apns, five_minutes, Some(probe_at + 4_000))
            .await
            .unwrap(),
        1,
        "the backlog already held is not written again"
    );
    // A probe releases one batch, the earliest deadline still ahead first.
    assert_eq!(h.queue.release(Provider::Apns, Some(1)).await.unwrap(), 1);
    let claimed = h.claim_all().await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].members[0].notification_seq, 0);
    // The provider answers: everything else is due at once.
    assert_eq!(h.queue.release(Provider::Apns, None).await.unwrap(), 5);
    assert_eq!(h.claim_all().await.len(), 5);
}

async fn a_probe_is_never_a_batch_past_its_deadline(backend: Backend) {
    let h = harness_with(backend, 0).await;
    let mut short = alert(1, &["iphone"]);
    short.expires_at_ms = Some(T0 as i64 + 1_000);
    h.admit(&short).await;
    h.admit(&alert(2, &["iphone"])).await;
    h.queue
        .hold(Provider::Apns, T0 as i64 + 300_000, None)
        .await
        .unwrap();
    h.clock.advance(2_000);
    assert_eq!(h.queue.release(Provider::Apns, Some(1)).await.unwrap(), 1);
    let claimed = h.claim_all().await;
    assert_eq!(
        claimed.len(),
        1,
        "the probe is the batch still before its deadline"
    );
    assert_eq!(claimed[0].members[0].notification_seq, 2);
}

/// On PostgreSQL a claim's lease commits without waiting for the WAL to reach the disk (lost in a
/// crash, its batch is due again and claimed again, as on SQLite); the admission before it and the
/// delivery's report after it still wait. A trigger records the setting each write to the batch
/// ran under.
#[tokio::test]
async fn postgresql_syncs_admissions_and_reports_but_not_leases() {
    use orca_push_queue::store::Completion;
    let h = harness_with(Backend::Postgres, 0).await;
    let orca_push_storage::Pool::Postgres(pg) =
        orca_push_queue::open_and_migrate(&h.config).await.unwrap()
    else {
        unreachable!("a PostgreSQL pool")
    };
    for statement in [
        "CREATE TABLE sync_seen (n serial, op text, state text, sync text)",
        "CREATE FUNCTION record_sync() RETURNS trigger AS $$ BEGIN \
         INSERT INTO sync_seen (op, state, sync) \
         VALUES (TG_OP, NEW.state, current_setting('synchronous_commit')); \
         RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER record_sync AFTER INSERT OR UPDATE ON push_delivery_batches \
         FOR EACH ROW EXECUTE FUNCTION record_sync()",
    ] {
        sqlx::query(statement).execute(&pg).await.unwrap();
    }
    let default: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pg)
        .await
        .unwrap();
    assert_eq!(
        default, "on",
        "the test server syncs commits unless told otherwise"
    );
    h.admit(&alert(1, &["r1"])).await;
    let b = h.claim_all().await.pop().unwrap();
    let recorded = h
        .queue
        .complete_many(vec![Completion {
            batch_id: b.batch_id.clone(),
            lease_token: b.lease_token.clone(),
            outcome: Outcome::Sent,
            reason: "x".into(),
            answered: true,
        }])
        .await
        .unwrap();
    assert_eq!(recorded, [true]);
    let seen: Vec<(String, String, String)> =
        sqlx::query_as("SELECT op, state, sync FROM sync_seen ORDER BY n")
            .fetch_all(&pg)
            .await
            .unwrap();
    let sync_of = |op: &str, state: &str| {
        seen.iter()
            .filter(|(o, s, _)| o == op && (s == state || state == "*"))
            .map(|(_, _, sync)| sync.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(sync_of("INSERT", "*"), ["on"], "the admission: {seen:?}");
    assert_eq!(sync_of("UPDATE", "leased"), ["off"], "the lease: {seen:?}");
    let report = seen.last().unwrap();
    assert_ne!(report.1, "leased", "the report ends the lease: {seen:?}");
    assert_eq!(report.2, "on", "the report: {seen:?}");
}
