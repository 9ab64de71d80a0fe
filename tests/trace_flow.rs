//! One alert through the whole gateway, in process, with spans captured by the SDK's in-memory
//! exporter and logs by a buffer: the span tree an SRE follows from request to provider, and no
//! token, title, body, session token or fingerprint (beyond 4 characters) in any span or log.

use std::time::Duration;

use opentelemetry::trace::{SpanKind, TraceId};
use opentelemetry_sdk::trace::SpanData;
use orca_push_host::HostKey;
use orca_push_tests::bearer;
use orca_push_tests::traced::{TracedGateway, marked_alert};
use serde_json::json;

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_alert_is_one_followable_trace_and_leaks_nothing() {
    let gateway = TracedGateway::start(&[]).await;
    let (raw, apns) = (&gateway.raw, &gateway.apns);
    let key = HostKey::generate();
    let session = raw.login(&key, &[]).await;
    let auth = bearer(&session);
    let token = "deadbeefcafe0042d00d";
    let id = raw.register(&auth, &json!({ "v": 1, "deviceId": "phone-marker-7", "platform": "ios", "token": token, "apnsEnvironment": "sandbox" })).await;
    // The facade trusts a verified session (for 30 s while auth's session watch vouches): log in
    // again, so this request's bearer is new to it and its trace shows the session look-up.
    let auth = bearer(&raw.login(&key, &[]).await);
    let (title, body) = ("MARKER-TITLE-5f3e91", "MARKER-BODY-0a77c2");
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let reply = raw
        .post(
            "/v1/send",
            &marked_alert(&id, 1, title, body),
            &[("authorization", &auth), ("traceparent", traceparent)],
        )
        .await;
    assert_eq!(reply.body["results"][0]["status"], "queued");
    apns.wait_for(token, 1, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let spans = gateway.spans();

    // The request's trace: facade, then every gRPC hop as client and server, then SQL.
    let trace_id = TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap();
    let request: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.span_context.trace_id() == trace_id)
        .collect();
    let find = |kind: SpanKind, name: &str| {
        request
            .iter()
            .copied()
            .find(|s| s.span_kind == kind && s.name == name)
            .unwrap_or_else(|| {
                panic!(
                    "no {kind:?} span {name} in {:#?}",
                    request.iter().map(|s| &s.name).collect::<Vec<_>>()
                )
            })
    };
    let http = find(SpanKind::Server, "POST /v1/send");
    assert_eq!(attribute(http, "http.route").as_deref(), Some("/v1/send"));
    // The host's first send since it registered asks the registry.
    assert_eq!(
        attribute(http, "orca.resolve.source").as_deref(),
        Some("registry")
    );
    for (service, method) in [
        ("orca.push.auth.v1.AuthService", "Authenticate"),
        (
            "orca.push.registry.v1.RegistryService",
            "ResolveRegistrations",
        ),
        ("orca.push.queue.v1.QueueService", "Enqueue"),
    ] {
        let name = format!("{service}/{method}");
        let client = find(SpanKind::Client, &name);
        let server = find(SpanKind::Server, &name);
        assert_eq!(
            server.parent_span_id,
            client.span_context.span_id(),
            "{name}"
        );
        assert_eq!(attribute(server, "rpc.system").as_deref(), Some("grpc"));
        assert_eq!(attribute(server, "rpc.service").as_deref(), Some(service));
        assert_eq!(attribute(server, "rpc.method").as_deref(), Some(method));
        // The caller its internal token named (never the token).
        assert_eq!(attribute(server, "enduser.id").as_deref(), Some("facade"));
        // The SQL work of the service is under its server span: a child, or (admissions) a
        // child of the group commit its request was part of.
        let under_server = |s: &SpanData| {
            s.parent_span_id == server.span_context.span_id()
                || request.iter().any(|group| {
                    group.name == "queue.group_commit"
                        && group.parent_span_id == server.span_context.span_id()
                        && s.parent_span_id == group.span_context.span_id()
                })
        };
        assert!(
            request
                .iter()
                .any(|s| under_server(s) && attribute(s, "db.system").as_deref() == Some("sqlite")),
            "{name} has a db span under it"
        );
    }

    // Delivery: its own trace, linked to the request's, with the provider call as its child.
    let delivery = spans
        .iter()
        .find(|s| {
            s.name == "deliver batch"
                && s.links
                    .iter()
                    .any(|l| l.span_context.trace_id() == trace_id)
        })
        .expect("a delivery span linked to the request's trace");
    let call = spans
        .iter()
        .find(|s| s.name == "POST apns" && s.parent_span_id == delivery.span_context.span_id())
        .expect("the provider call is a child of the delivery");
    assert_eq!(call.span_kind, SpanKind::Client);
    assert_eq!(attribute(call, "orca.provider").as_deref(), Some("apns"));
    assert_eq!(
        attribute(call, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(attribute(call, "orca.verdict").as_deref(), Some("sent"));

    // A later send is resolved from the facade's memory once the registry's watch vouches for it
    // (and a second has passed since the registration): its span says so, and its trace has no
    // registry hop.
    let mut from_memory = None;
    for seq in 2..60 {
        let reply = raw
            .post(
                "/v1/send",
                &marked_alert(&id, seq, title, body),
                &[("authorization", &auth)],
            )
            .await;
        assert_eq!(reply.body["results"][0]["status"], "queued");
        from_memory = gateway.spans().into_iter().find(|s| {
            s.name == "POST /v1/send"
                && attribute(s, "orca.resolve.source").as_deref() == Some("memory")
        });
        if from_memory.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let from_memory = from_memory.expect("a send resolved from memory within 6 s");
    let its_trace = from_memory.span_context.trace_id();
    assert!(
        !gateway.spans().iter().any(|s| {
            s.span_context.trace_id() == its_trace && s.name.contains("ResolveRegistrations")
        }),
        "a send resolved from memory makes no registry call"
    );
    let spans = gateway.spans();

    // Nothing personal anywhere.
    let fingerprint = key.fingerprint();
    gateway.assert_nothing_leaked(
        &spans,
        &[
            token,
            title,
            body,
            session.as_str(),
            &fingerprint[..5],
            &apns.key_pem[30..60],
        ],
    );
    gateway.stop().await;
}
