//! What an older gateway is sent: no `kind`, `expiresAt` or `sound`, and no dismissals.

use std::time::Duration;

use orca_push_api::{ErrorCode, Kind};

use super::*;
use crate::dispatch::Skip;

fn dismiss_with_deadline(silent_too: bool) -> (Vec<Registration>, DispatchEvent) {
    let mut regs = phones(1);
    if silent_too {
        regs.push(with_filter(1, |f| f.sound = Some(false)));
    }
    let mut e = event(0);
    e.kind = Kind::Dismiss;
    e.expires_at = Some((BASE_MS + 60_000) as i64);
    (regs, e)
}

#[tokio::test(start_paused = true)]
async fn a_new_gateway_is_sent_kind_expires_at_and_sound() {
    let (regs, e) = dismiss_with_deadline(true);
    let h = harness(regs, 2);
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(report.delivery_protocol, Some(2));
    let requests = h.gateway.requests();
    assert_eq!(requests.len(), 2);
    for r in &requests {
        assert_eq!(json(r)["kind"], "dismiss");
        assert_eq!(json(r)["expiresAt"], BASE_MS + 60_000);
    }
    assert_eq!(json(&requests[1])["sound"], false);
}

#[tokio::test(start_paused = true)]
async fn an_older_gateway_is_sent_none_of_them_and_silence_needs_no_request_of_its_own() {
    let (regs, mut e) = dismiss_with_deadline(true);
    e.kind = Kind::Alert;
    let h = harness(regs, 1);
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(report.delivery_protocol, Some(1));
    let requests = h.gateway.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(ids(&requests[0]), ["reg-0", "reg-1"]);
    let sent = json(&requests[0]);
    for field in ["kind", "expiresAt", "sound"] {
        assert!(!sent.as_object().unwrap().contains_key(field), "{field}");
    }
}

#[tokio::test(start_paused = true)]
async fn an_older_gateway_is_sent_no_dismissal() {
    let (regs, e) = dismiss_with_deadline(false);
    let h = harness(regs, 1);
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(report.skipped.get("reg-0"), Some(&Skip::DismissUnsupported));
    assert!(h.gateway.requests().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_protocol_is_asked_once_per_ttl_and_only_when_needed() {
    let h = harness(phones(1), 2);
    // No phone takes it: the gateway is not asked.
    let mut disabled = event(0);
    disabled.desktop_allowed = false;
    h.dispatcher.dispatch(disabled).await;
    assert_eq!(h.gateway.health_calls(), 0);

    h.dispatcher.dispatch(event(0)).await;
    h.dispatcher.dispatch(event(10_000)).await;
    assert_eq!(h.gateway.health_calls(), 1);
    // A gateway upgraded meanwhile is noticed once the cache is stale.
    h.gateway.set_protocol(Some(1));
    tokio::time::sleep(config().protocol_ttl).await;
    let report = h.dispatcher.dispatch(event(20_000)).await;
    assert_eq!(h.gateway.health_calls(), 2);
    assert_eq!(report.delivery_protocol, Some(1));
}

#[tokio::test(start_paused = true)]
async fn a_failed_health_call_assumes_protocol_1_for_this_dispatch_only() {
    let (regs, mut e) = dismiss_with_deadline(false);
    e.kind = Kind::Alert;
    let h = harness(regs, 2);
    h.gateway.set_protocol(None);
    let report = h.dispatcher.dispatch(e.clone()).await;
    assert_eq!(report.delivery_protocol, Some(1));
    assert_eq!(report.failures["health.busy"], 1);
    assert!(
        !json(&h.gateway.requests()[0])
            .as_object()
            .unwrap()
            .contains_key("expiresAt")
    );

    h.gateway.set_protocol(Some(2));
    e.emitted_at = Some(BASE_MS + 10_000);
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(h.gateway.health_calls(), 2);
    assert_eq!(report.delivery_protocol, Some(2));
    assert_eq!(
        json(&h.gateway.requests()[1])["expiresAt"],
        BASE_MS + 60_000
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_refresh_keeps_the_protocol_the_gateway_last_answered() {
    let h = harness(phones(1), 2);
    let mut e = event(0);
    e.kind = Kind::Dismiss;
    h.dispatcher.dispatch(e.clone()).await;
    // The cached answer expires, and the gateway cannot answer /health for a while: a dismissal
    // still goes, as to the gateway it last heard from.
    tokio::time::advance(Duration::from_secs(11 * 60)).await;
    h.gateway.set_protocol(None);
    let report = h.dispatcher.dispatch(e).await;
    assert_eq!(h.gateway.health_calls(), 2);
    assert_eq!(report.delivery_protocol, Some(2));
    assert_eq!(json(&h.gateway.requests()[1])["kind"], "dismiss");
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_as_invalid_makes_the_protocol_be_asked_again() {
    let h = harness(phones(1), 2);
    h.gateway.then_err(400, ErrorCode::InvalidRequest, None);
    h.dispatcher.dispatch(event(0)).await;
    assert_eq!(h.gateway.health_calls(), 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    h.dispatcher.dispatch(event(10_000)).await;
    assert_eq!(h.gateway.health_calls(), 2);
}
