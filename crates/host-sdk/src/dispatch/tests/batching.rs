//! Requests of at most 20, silent phones apart, answers read by id, dead registrations dropped.

use std::collections::BTreeSet;

use orca_push_api::{SendResult, SendStatus};

use super::*;
use crate::dispatch::Outcome;

#[tokio::test(start_paused = true)]
async fn more_than_twenty_phones_get_more_requests_and_none_is_dropped() {
    let h = harness(phones(45), 2);
    let report = h.dispatcher.dispatch(event(0)).await;
    let sizes: Vec<usize> = h
        .gateway
        .requests()
        .iter()
        .map(|r| r.registration_ids.len())
        .collect();
    assert_eq!(sizes, [20, 20, 5]);
    let sent: BTreeSet<&str> = report.sent_ids().into_iter().collect();
    assert_eq!(sent.len(), 45);
    assert_eq!(report.outcomes.len(), 45);
    assert!(
        report
            .outcomes
            .values()
            .all(|o| *o == Outcome::Status(SendStatus::Queued))
    );
    for request in h.gateway.requests() {
        assert!(request.validate().is_ok());
    }
}

#[tokio::test(start_paused = true)]
async fn silent_phones_get_requests_of_their_own_with_sound_false() {
    let mut all = phones(3);
    all.extend((3..25).map(|n| with_filter(n, |f| f.sound = Some(false))));
    // An explicit `sound: true` is an audible phone.
    all.push(with_filter(25, |f| f.sound = Some(true)));
    let h = harness(all, 2);
    let report = h.dispatcher.dispatch(event(0)).await;
    let requests = h.gateway.requests();
    let shape: Vec<(usize, Option<bool>)> = requests
        .iter()
        .map(|r| (r.registration_ids.len(), r.notification.sound))
        .collect();
    assert_eq!(shape, [(4, None), (20, Some(false)), (2, Some(false))]);
    assert_eq!(ids(&requests[0]), ["reg-0", "reg-1", "reg-2", "reg-25"]);
    assert!(
        !json(&requests[0])
            .as_object()
            .unwrap()
            .contains_key("sound")
    );
    assert_eq!(json(&requests[1])["sound"], false);
    assert_eq!(
        report.requests.iter().map(|r| r.silent).collect::<Vec<_>>(),
        [false, true, true]
    );
}

#[tokio::test(start_paused = true)]
async fn answers_are_read_by_registration_id_not_position() {
    let h = harness(phones(3), 2);
    h.gateway.then(|request| {
        let mut reply = all(request, SendStatus::Queued);
        reply.results.reverse();
        reply.results[0].status = SendStatus::Dead; // reg-2
        reply.results[1].status = SendStatus::RateLimited; // reg-1
        Ok(reply)
    });
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(
        report.outcomes["reg-0"],
        Outcome::Status(SendStatus::Queued)
    );
    assert_eq!(
        report.outcomes["reg-1"],
        Outcome::Status(SendStatus::RateLimited)
    );
    assert_eq!(report.outcomes["reg-2"], Outcome::Status(SendStatus::Dead));
    assert_eq!(report.dropped_dead, ["reg-2"]);
    let drops = h.source.drop_calls.lock().unwrap().clone();
    assert_eq!(drops, [phone(2)]);
}

#[tokio::test(start_paused = true)]
async fn missing_and_unexpected_answers_are_counted() {
    let h = harness(phones(2), 2);
    h.gateway.then(|_| {
        Ok(SendReply {
            results: vec![
                SendResult {
                    registration_id: "someone-else".to_owned(),
                    status: SendStatus::Queued,
                },
                SendResult {
                    registration_id: "reg-1".to_owned(),
                    status: SendStatus::Queued,
                },
            ],
        })
    });
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(report.outcomes["reg-0"], Outcome::NoResult);
    assert_eq!(
        report.outcomes["reg-1"],
        Outcome::Status(SendStatus::Queued)
    );
    assert_eq!(report.failures["result.missing"], 1);
    assert_eq!(report.failures["result.unexpected"], 1);
}

#[tokio::test(start_paused = true)]
async fn a_dead_registration_is_dropped_with_the_exact_snapshot_that_was_sent() {
    let h = harness(phones(2), 2);
    h.gateway.then(|request| Ok(all(request, SendStatus::Dead)));
    // reg-1's phone registers a new token while the send is in flight.
    *h.source.after_active.lock().unwrap() = Some(Box::new(|stored: &mut Vec<Registration>| {
        stored[1].token = "secret-token-new".to_owned();
    }));
    let report = h.dispatcher.dispatch(event(0)).await;
    assert_eq!(report.dropped_dead, ["reg-0"]);
    let drops = h.source.drop_calls.lock().unwrap().clone();
    assert_eq!(drops, [phone(0), phone(1)]);
    // The re-registered phone keeps its new token.
    let stored = h.source.stored();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].token, "secret-token-new");
    assert_eq!(report.failures["result.dead"], 2);
}
