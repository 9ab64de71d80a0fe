//! Sends the facade batches to a queue across a socket (`EnqueueMany`; all in one with
//! `ORCA_PUSH_INTERNAL_TRANSPORT=loopback`, as split mode calls it) keep a followable trace each:
//! the queue's span for the admission is in the send's trace, the delivery links back to it, and
//! no token, title, body, session token or fingerprint (beyond 4 characters) reaches a span or log.
//! A binary of its own: the tracing subscriber is global.

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::TraceId;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use orca_push_host::HostKey;
use orca_push_tests::mock_apns::MockApns;
use orca_push_tests::{Raw, bearer};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuffer {
    type Writer = LogBuffer;
    fn make_writer(&'a self) -> LogBuffer {
        self.clone()
    }
}

/// Sends made together per burst; bursts until one was batched.
const SENDS: u64 = 16;
const BURSTS: u64 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_sends_keep_their_own_traces_and_leak_nothing() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let logs = LogBuffer::default();
    let _telemetry = orca_push_telemetry::init_with_log_writer(
        provider.clone(),
        orca_push_telemetry::LogFormat::Text,
        logs.clone(),
    )
    .unwrap();

    let apns = MockApns::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut vars = apns.env();
    vars.push((
        "ORCA_PUSH_DATA_DIR".into(),
        dir.path().display().to_string(),
    ));
    vars.push(("ORCA_PUSH_COALESCE_MS".into(), "0".into()));
    vars.push(("ORCA_PUSH_INTERNAL_TRANSPORT".into(), "loopback".into()));
    let config = orca_push::Config::from_lookup(|k| {
        vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    let drain = CancellationToken::new();
    let gateway = tokio::spawn(orca_push::topology::serve_all_in_one(
        Arc::new(config),
        listener,
        drain.clone(),
    ));
    let raw = Raw {
        http: reqwest::Client::new(),
        base,
    };
    for _ in 0..100 {
        if raw.get("/ready", &[]).await.status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
                        &json!({ "v": 1, "registrationIds": [id], "notification": {
                            "notificationId": format!("n-{seq}"), "notificationSeq": seq,
                            "notificationEpoch": "e-1", "source": "agent-task-complete",
                            "agentState": "finished", "title": title, "body": body } }),
                        &[("authorization", &auth), ("traceparent", &traceparent)],
                    )
                    .await;
                assert_eq!(reply.body["results"][0]["status"], "queued");
                TraceId::from_hex(&trace).unwrap()
            }
        });
        let sent = futures::future::join_all(sends).await;
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
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
        provider.force_flush().unwrap();
        spans = exporter.get_finished_spans().unwrap();
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
    let everything = format!("{spans:?}");
    let logged = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    let fingerprint = key.fingerprint();
    for secret in [token, title, body, session.as_str(), &fingerprint[..5]] {
        assert!(!everything.contains(secret), "{secret} in a span");
        assert!(!logged.contains(secret), "{secret} in the logs");
    }
    drain.cancel();
    let _ = logs.0.lock().unwrap().flush();
    let _ = tokio::time::timeout(Duration::from_secs(10), gateway).await;
}
