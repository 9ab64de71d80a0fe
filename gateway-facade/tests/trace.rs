//! One trace spans the HTTP request and every gRPC hop behind it, continuing an incoming
//! `traceparent`. Alone in its binary: it installs the process-wide subscriber.

use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use opentelemetry::trace::{SpanKind, TraceId};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use orca_push::app::{AppState, router};
use orca_push::backends::{BackendTargets, Backends};
use orca_push::limits::Limits;
use orca_push_storage::SystemClock;
use orca_push_storage::testing::{Backend, fresh};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_the_http_request_and_the_grpc_call() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let _telemetry = orca_push_telemetry::init(
        provider.clone(),
        orca_push_telemetry::LogFormat::Text,
        orca_push_telemetry::SpanDetail::Exported,
    )
    .expect("telemetry");

    // The auth service, for real, on a loopback port; the others are never reached.
    let (database, _guard) = fresh(Backend::Sqlite).await;
    let pool = orca_push_auth::open_and_migrate(&database).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let auth_url = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let nowhere = "http://127.0.0.1:9".to_owned();
    let key = orca_push_internal_auth::InternalKey::generate();
    tokio::spawn(orca_push_auth::serve(
        listener,
        pool,
        "http://127.0.0.1:8080".into(),
        Arc::new(SystemClock),
        orca_push_auth::registry_client(&nowhere.clone().into(), &key).unwrap(),
        key.clone(),
        shutdown.clone(),
    ));
    let backends = Backends::connect(
        &BackendTargets {
            auth: auth_url.into(),
            registry: nowhere.clone().into(),
            queue: nowhere.clone().into(),
            sender: nowhere.into(),
        },
        &key,
    )
    .unwrap();
    let app = router(AppState::serving(backends, Limits::new(0)));

    let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let body = format!(
        r#"{{"v":1,"hostPublicKeyB64":"{}"}}"#,
        "B".repeat(42) + "A="
    );
    let challenge = |traceparent: &str, tracestate: Option<String>| {
        let mut request = Request::post("/v1/host/challenge").header("traceparent", traceparent);
        if let Some(tracestate) = tracestate {
            request = request.header("tracestate", tracestate);
        }
        app.clone()
            .oneshot(request.body(Body::from(body.clone())).unwrap())
    };
    let response = challenge(incoming, Some("vendor=kept".into()))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // A caller's `tracestate` over 512 characters (here 150 KB of valid entries, each value at
    // W3C's 256-character limit) is not copied into every span.
    let long_state = (0..600)
        .map(|i| format!("k{i}={}", "v".repeat(256)))
        .collect::<Vec<_>>()
        .join(",");
    let long = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let response = challenge(long, Some(long_state)).await.unwrap();
    assert_eq!(response.status(), 200);
    provider.force_flush().unwrap();
    shutdown.cancel();

    let finished = exporter.get_finished_spans().unwrap();
    let of_trace = |hex: &str| {
        let trace_id = TraceId::from_hex(hex).unwrap();
        finished
            .iter()
            .filter(|s| s.span_context.trace_id() == trace_id)
            .cloned()
            .collect::<Vec<SpanData>>()
    };
    let spans = of_trace("4bf92f3577b34da6a3ce929d0e0e4736");
    let long_spans = of_trace("5bf92f3577b34da6a3ce929d0e0e4736");
    assert!(
        !long_spans.is_empty(),
        "the request with a long tracestate is traced"
    );
    for span in &long_spans {
        assert_eq!(
            span.span_context.trace_state().header(),
            "",
            "{}",
            span.name
        );
    }
    assert!(
        spans
            .iter()
            .all(|s| s.span_context.trace_state().header() == "vendor=kept"),
        "a short tracestate is continued"
    );
    let find = |kind: SpanKind, name_part: &str| {
        spans
            .iter()
            .find(|s| s.span_kind == kind && s.name.contains(name_part))
            .unwrap_or_else(|| panic!("no {kind:?} span {name_part}: {spans:#?}"))
    };
    let http = find(SpanKind::Server, "POST /v1/host/challenge");
    let client = find(SpanKind::Client, "AuthService/IssueChallenge");
    let server = find(SpanKind::Server, "AuthService/IssueChallenge");
    // The incoming traceparent is continued, and each hop is the child of the one before.
    assert_eq!(
        http.parent_span_id,
        opentelemetry::trace::SpanId::from_hex("00f067aa0ba902b7").unwrap()
    );
    assert_eq!(client.parent_span_id, http.span_context.span_id());
    assert_eq!(server.parent_span_id, client.span_context.span_id());
    assert_eq!(
        attribute(http, "http.request.method").as_deref(),
        Some("POST")
    );
    assert_eq!(
        attribute(http, "http.route").as_deref(),
        Some("/v1/host/challenge")
    );
    assert_eq!(
        attribute(http, "http.response.status_code").as_deref(),
        Some("200")
    );
    for span in [client, server] {
        assert_eq!(attribute(span, "rpc.system").as_deref(), Some("grpc"));
        assert_eq!(
            attribute(span, "rpc.service").as_deref(),
            Some("orca.push.auth.v1.AuthService")
        );
        assert_eq!(
            attribute(span, "rpc.method").as_deref(),
            Some("IssueChallenge")
        );
    }
}
