//! OTLP export when the standard variables ask for it: a real gateway process sends its spans to an
//! OTLP/gRPC receiver running in this test, under the service's name.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use orca_push_host::HostKey;
use orca_push_tests::{Backend, Gateway, Raw};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};

#[derive(Clone, Default)]
struct Receiver {
    /// Names of the metrics received by OTLP.
    metrics: Arc<Mutex<Vec<String>>>,
    /// The bucket bounds of each histogram received by OTLP.
    histogram_bounds: Arc<Mutex<std::collections::HashMap<String, Vec<f64>>>>,
    spans: Arc<Mutex<Vec<(String, String)>>>,
    /// The `grpc-encoding` of each export request.
    encodings: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let encoding = request
            .metadata()
            .get("grpc-encoding")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("identity")
            .to_owned();
        self.encodings.lock().unwrap().push(encoding);
        let mut got = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .map(|v| format!("{:?}", v.value))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    got.push((service.clone(), span.name));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// How the in-test collector listens.
enum Collector {
    /// OTLP/gRPC in the clear.
    Grpc,
    /// OTLP/gRPC over TLS with a self-signed certificate for `localhost`, written to the file.
    GrpcTls(tempfile::NamedTempFile),
    /// OTLP/HTTP with protobuf bodies at `/v1/traces`.
    Http,
}

impl Collector {
    fn grpc_tls() -> Self {
        Self::GrpcTls(tempfile::NamedTempFile::new().unwrap())
    }

    /// Starts the collector for `receiver`; its endpoint URL.
    async fn start(&self, receiver: &Receiver) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let service = TraceServiceServer::new(receiver.clone())
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
        match self {
            Self::Grpc => {
                tokio::spawn(
                    tonic::transport::Server::builder()
                        .add_service(service)
                        .add_service(MetricsServiceServer::new(receiver.clone()))
                        .serve_with_incoming(incoming),
                );
                format!("http://127.0.0.1:{port}")
            }
            Self::GrpcTls(ca_file) => {
                let certified = rcgen::generate_simple_self_signed(vec!["localhost".into()])
                    .expect("self-signed certificate");
                std::fs::write(ca_file.path(), certified.cert.pem()).unwrap();
                let identity = tonic::transport::Identity::from_pem(
                    certified.cert.pem(),
                    certified.signing_key.serialize_pem(),
                );
                tokio::spawn(
                    tonic::transport::Server::builder()
                        .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                        .unwrap()
                        .add_service(service)
                        .serve_with_incoming(incoming),
                );
                format!("https://localhost:{port}")
            }
            Self::Http => {
                let receiver = receiver.clone();
                let app = axum::Router::new().route(
                    "/v1/traces",
                    axum::routing::post(move |body: axum::body::Bytes| {
                        let receiver = receiver.clone();
                        async move {
                            let request =
                                <ExportTraceServiceRequest as prost::Message>::decode(body)
                                    .unwrap();
                            receiver.encodings.lock().unwrap().push("http".into());
                            let _ =
                                TraceService::export(&receiver, tonic::Request::new(request)).await;
                            ""
                        }
                    }),
                );
                let listener = incoming.into_inner();
                tokio::spawn(async move { axum::serve(listener, app).await });
                format!("http://127.0.0.1:{port}")
            }
        }
    }
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        use opentelemetry_proto::tonic::metrics::v1::metric::Data;
        let mut got = self.metrics.lock().unwrap();
        for resource in request.into_inner().resource_metrics {
            for scope in resource.scope_metrics {
                for metric in scope.metrics {
                    if let Some(Data::Histogram(histogram)) = &metric.data
                        && let Some(point) = histogram.data_points.first()
                    {
                        self.histogram_bounds
                            .lock()
                            .unwrap()
                            .insert(metric.name.clone(), point.explicit_bounds.clone());
                    }
                    got.push(metric.name);
                }
            }
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// Starts a receiver (accepting gzip) and a gateway exporting to it with `env`, logs a host in,
/// and waits for the handshake's spans.
async fn export_a_login(env: &[(&str, &str)]) -> Receiver {
    export_a_login_to(Collector::Grpc, env).await
}

async fn export_a_login_to(collector: Collector, env: &[(&str, &str)]) -> Receiver {
    let receiver = Receiver::default();
    let endpoint = collector.start(&receiver).await;
    let ca_path;
    let mut env: Vec<(&str, &str)> = env.to_vec();
    env.push(("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint));
    env.push(("OTEL_SERVICE_NAME", "orca-push-under-test"));
    if let Collector::GrpcTls(ca_file) = &collector {
        ca_path = ca_file.path().display().to_string();
        env.push(("ORCA_PUSH_CA_FILE", &ca_path));
    }
    if let Collector::Http = collector {
        env.push(("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"));
    }
    let gateway = Gateway::start_with(Backend::Sqlite, &env).await;
    Raw::new(&gateway).login(&HostKey::generate(), &[]).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = receiver.spans.lock().unwrap().clone();
        if got.iter().any(|(_, name)| name == "POST /v1/host/session")
            && got
                .iter()
                .any(|(_, name)| name == "orca.push.auth.v1.AuthService/CreateSession")
        {
            assert!(
                got.iter()
                    .all(|(service, _)| service.contains("orca-push-under-test")),
                "{got:?}"
            );
            return receiver;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "spans received: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_by_otlp_when_the_environment_asks() {
    let receiver = export_a_login(&[]).await;
    assert!(
        receiver
            .encodings
            .lock()
            .unwrap()
            .iter()
            .all(|e| e == "identity")
    );
}

/// `OTEL_EXPORTER_OTLP_COMPRESSION=gzip` used to stop start-up (gzip was not compiled in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_gzipped_when_the_environment_asks() {
    let receiver = export_a_login(&[("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")]).await;
    let encodings = receiver.encodings.lock().unwrap().clone();
    assert!(!encodings.is_empty());
    assert!(encodings.iter().all(|e| e == "gzip"), "{encodings:?}");
}

/// An `https://` collector is reached over TLS, trusting `ORCA_PUSH_CA_FILE` besides the system's
/// roots. (TLS used to be missing: such an endpoint was accepted and every export failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_tls_to_an_https_collector() {
    export_a_login_to(Collector::grpc_tls(), &[]).await;
}

/// `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` posts to `<endpoint>/v1/traces`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_http_protobuf_when_asked() {
    let receiver = export_a_login_to(Collector::Http, &[]).await;
    // The spans arrived through the HTTP route, which tags its requests "http".
    let encodings = receiver.encodings.lock().unwrap().clone();
    assert!(encodings.iter().any(|e| e == "http"), "{encodings:?}");
}

/// `OTEL_METRICS_EXPORTER=otlp`: the metrics Prometheus serves also go to the collector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_exported_by_otlp_when_asked() {
    let receiver = export_a_login_to(
        Collector::Grpc,
        &[
            ("OTEL_METRICS_EXPORTER", "otlp"),
            ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
        ],
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = receiver.metrics.lock().unwrap().clone();
        let wanted = [
            "orca_push_build_info",
            "orca_push_http_requests_total",
            "process_open_fds",
        ];
        if wanted.iter().all(|name| got.iter().any(|m| m == name)) {
            // Latency histograms keep the seconds buckets Prometheus has, not the SDK's defaults.
            let bounds = receiver.histogram_bounds.lock().unwrap().clone();
            if let Some(http) = bounds.get("orca_push_http_request_duration_seconds") {
                assert_eq!(http.first(), Some(&0.0005), "{http:?}");
                assert_eq!(http.last(), Some(&30.0), "{http:?}");
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "metrics received: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Without `OTEL_METRICS_EXPORTER=otlp`, metrics stay Prometheus's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_stay_on_prometheus_unless_asked() {
    let receiver =
        export_a_login_to(Collector::Grpc, &[("OTEL_METRIC_EXPORT_INTERVAL", "500")]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(receiver.metrics.lock().unwrap().is_empty());
}

/// `OTEL_SDK_DISABLED=true` exports nothing, whatever endpoint is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_sdk_exports_nothing() {
    let receiver = Receiver::default();
    let endpoint = Collector::Grpc.start(&receiver).await;
    let gateway = Gateway::start_with(
        Backend::Sqlite,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_SDK_DISABLED", "true"),
        ],
    )
    .await;
    Raw::new(&gateway).login(&HostKey::generate(), &[]).await;
    // The batch processor exports every 5 s by default: wait past one round.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(receiver.spans.lock().unwrap().is_empty());
}

/// `ORCA_PUSH_LOG_FORMAT=json`: every line the gateway writes is one JSON object, and a line
/// written inside a request's span carries that span's trace and span ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_lead_to_their_traces() {
    let gateway = Gateway::start_with(Backend::Sqlite, &[("ORCA_PUSH_LOG_FORMAT", "json")]).await;
    let raw = Raw::new(&gateway);
    raw.login(&HostKey::generate(), &[]).await;
    let logs = gateway.logs();
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .all(|l| l["severity"].is_string() && l["timestamp"].is_string())
    );
    let created = lines
        .iter()
        .find(|l| l["message"] == "session created")
        .unwrap_or_else(|| panic!("no session line in {logs}"));
    let trace_id = created["trace_id"].as_str().expect("a trace id");
    assert_eq!(trace_id.len(), 32);
    assert!(trace_id.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(created["span_id"].as_str().map(str::len), Some(16));
    assert!(
        created["spans"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("grpc.server")),
        "the auth service's span (in process, or across loopback: its own process's stack)"
    );
}
