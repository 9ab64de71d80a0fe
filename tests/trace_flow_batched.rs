//! Sends the facade batches to a queue across a socket (`EnqueueMany`; all in one with
//! `ORCA_PUSH_INTERNAL_TRANSPORT=loopback`, as split mode calls it) keep a followable trace each:
//! the queue's span for the admission is in the send's trace, the delivery links back to it, and
//! no token, title, body, session token or fingerprint (beyond 4 characters) reaches a span or log.
//! A binary of its own: the tracing subscriber is global.

use std::time::Duration;

use opentelemetry::trace::TraceId;
use opentelemetry_sdk::trace::SpanData;
use orca_push_host::HostKey;
use orca_push_tests::bearer;
use orca_push_tests::traced::{TracedGateway, marked_alert};
use serde_json::json;

/// Sends made together per burst; bursts until one was batched.
const SENDS: u64 = 16;
const BURSTS: u64 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_sends_keep_their_own_traces_and_leak_nothing() {
    let gateway = TracedGateway::start(&[("ORCA_PUSH_INTERNAL_TRANSPORT", "loopback")]).await;
    let (raw, apns) = (&gateway.raw, &gateway.apns);
    let key = HostKey::generate();
    let session = raw.login(&key, &[]).await;
    let auth = bearer(&session);
    let token = "feedfacecafe0042d00d";
    let id = raw.register(&auth, &json!({ "v": 1, "deviceId": "phone-marker-8", "platform": "ios", "token": token, "apnsEnvironment": "sandbox" })).await;
    let (title, body) = ("MARKER-TITLE-77b1c4", "MARKER-BODY-3e90d2");

    // Bursts of sends made at once, each continuing a trace of its own, until one went in a
    // batch (a span of the queue's `queue.admission` in its trace).
    let mut batched = Vec::new();
    for burst in 0..BURSTS {
        let sends = (0..SENDS).map(|i| {
            let seq = burst * SENDS + i + 1;
            let trace = format!("{:032x}", 0xba7c_0000_0000_u64 + seq);
            let traceparent = format!("00-{trace}-b7ad6b7169203331-01");
            let (raw, auth, id) = (raw.clone(), auth.clone(), id.clone());
            async move {
                let reply = raw
                    .post(
                        "/v1/send",
                        &marked_alert(&id, seq, title, body),
                        &[("authorization", &auth), ("traceparent", &traceparent)],
                    )
                    .await;
                assert_eq!(reply.body["results"][0]["status"], "queued");
                TraceId::from_hex(&trace).unwrap()
            }
        });
        let sent = futures::future::join_all(sends).await;
        let spans = gateway.spans();
        let in_trace = |trace: TraceId, name: &str| {
            spans
                .iter()
                .any(|s| s.span_context.trace_id() == trace && s.name == name)
        };
        for trace in sent {
            // Every send's admission is in its trace: its own call's, or its batch's admission.
            if in_trace(trace, "queue.admission") {
                batched.push(trace);
            } else {
                assert!(
                    in_trace(trace, "orca.push.queue.v1.QueueService/Enqueue"),
                    "a send's trace has neither its Enqueue call nor a batched admission"
                );
            }
        }
        if !batched.is_empty() {
            break;
        }
    }
    assert!(
        !batched.is_empty(),
        "no send was batched in {BURSTS} bursts of {SENDS}"
    );

    // The phone hears, and each batched send's delivery links back to its trace (a delivery
    // links to every send it carries, summaries included).
    apns.wait_for(token, 1, Duration::from_secs(20)).await;
    let linked = |spans: &[SpanData], trace: TraceId| {
        spans.iter().any(|s| {
            s.name == "deliver batch" && s.links.iter().any(|l| l.span_context.trace_id() == trace)
        })
    };
    let mut spans = Vec::new();
    for _ in 0..100 {
        spans = gateway.spans();
        if batched.iter().all(|trace| linked(&spans, *trace)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for trace in &batched {
        assert!(
            linked(&spans, *trace),
            "a batched send's delivery links to its trace"
        );
        // The batch's call is a trace of its own, linked to each send it carried.
        assert!(
            spans.iter().any(|s| s.name == "queue.enqueue_many"
                && s.links.iter().any(|l| l.span_context.trace_id() == *trace)),
            "the batch's call links to the send"
        );
    }

    // Nothing personal anywhere.
    let fingerprint = key.fingerprint();
    gateway.assert_nothing_leaked(
        &spans,
        &[token, title, body, session.as_str(), &fingerprint[..5]],
    );
    gateway.stop().await;
}
