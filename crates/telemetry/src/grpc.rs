//! Tower layers that give every gRPC call a client or server span and carry W3C trace context in
//! the call's metadata. Span fields follow the OpenTelemetry RPC conventions. A call to a server
//! in this process carries the context itself, in the request's extensions, rather than written
//! out as a `traceparent` and parsed back on every hop (profiled: 3.5% of the request threads'
//! samples in SQLite admission at 64 connections); nothing from the network carries extensions.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tracing::Instrument as _;

use crate::{inject_current_context, set_parent_from_headers};

/// The caller's trace context on a call to a server in this process.
#[derive(Clone)]
struct InProcessContext(opentelemetry::Context);

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// `/orca.push.auth.v1.AuthService/IssueChallenge` -> (`orca.push.auth.v1.AuthService`, `IssueChallenge`).
fn rpc_names(path: &str) -> (&str, &str) {
    path.trim_start_matches('/')
        .split_once('/')
        .unwrap_or(("unknown", "unknown"))
}

/// The labels of a served call: its service and method when `path` is one the server routes
/// (`known`), else `unknown` for both. The layer runs before the token check, so an unauthenticated
/// caller picks the path: labelled raw, every made-up path would be a new metric series for good.
pub fn routed_names(path: &str, known: impl Fn(&str) -> bool) -> (&str, &str) {
    if known(path) {
        rpc_names(path)
    } else {
        ("unknown", "unknown")
    }
}

/// The gRPC status a response carries in its headers (trailers-only answers: errors), else OK.
fn status_code<B>(response: &http::Response<B>) -> i64 {
    response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Server side: continue the caller's trace and open a `server` span per call. Spans and metrics
/// name the method only when `known` says the server routes it.
#[derive(Debug, Clone)]
pub struct GrpcServerLayer {
    known: fn(&str) -> bool,
    metrics: Arc<ServedMetrics>,
}

impl GrpcServerLayer {
    /// Metric handles are taken from the recorder current at each method's first call.
    pub fn new(known: fn(&str) -> bool) -> Self {
        Self {
            known,
            metrics: Arc::default(),
        }
    }
}

impl<S> tower::Layer<S> for GrpcServerLayer {
    type Service = GrpcServerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcServerService {
            inner,
            known: self.known,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct GrpcServerService<S> {
    inner: S,
    known: fn(&str) -> bool,
    metrics: Arc<ServedMetrics>,
}

/// The metric handles of every method a server's layer has served, made at each method's first
/// call. Looking a series up by its labels on every call (its key built and hashed, the label
/// strings allocated and cloned) was 2.3% of the gateway's samples at 1,000 end-to-end flows.
#[derive(Debug, Default)]
struct ServedMetrics {
    /// By the method's path; every unrouted path shares the entry of `""`.
    by_path: std::sync::RwLock<std::collections::HashMap<String, Arc<MethodMetrics>>>,
}

impl ServedMetrics {
    fn method(&self, path: &str, service: &str, method: &str) -> Arc<MethodMetrics> {
        let read = self.by_path.read().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = read.get(path) {
            return found.clone();
        }
        drop(read);
        let mut write = self.by_path.write().unwrap_or_else(|e| e.into_inner());
        write
            .entry(path.to_owned())
            .or_insert_with(|| Arc::new(MethodMetrics::new(service, method)))
            .clone()
    }
}

/// gRPC's status codes run from 0 (OK) to 16 (UNAUTHENTICATED).
const STATUS_CODES: usize = 17;

/// One method's series: its duration, and its calls by status code, each made at its first use.
#[derive(Debug)]
struct MethodMetrics {
    service: String,
    method: String,
    duration: metrics::Histogram,
    calls: [std::sync::OnceLock<metrics::Counter>; STATUS_CODES],
}

impl MethodMetrics {
    fn new(service: &str, method: &str) -> Self {
        Self {
            service: service.to_owned(),
            method: method.to_owned(),
            duration: metrics::histogram!(
                "orca_push_grpc_server_duration_seconds",
                "service" => service.to_owned(),
                "method" => method.to_owned()
            ),
            calls: Default::default(),
        }
    }

    fn calls(&self, code: i64) -> metrics::Counter {
        metrics::counter!(
            "orca_push_grpc_server_calls_total",
            "service" => self.service.clone(),
            "method" => self.method.clone(),
            "code" => code.to_string()
        )
    }

    fn count(&self, code: i64) {
        match usize::try_from(code).ok().and_then(|i| self.calls.get(i)) {
            Some(cell) => cell.get_or_init(|| self.calls(code)).increment(1),
            // Not a status gRPC defines: counted, never kept.
            None => self.calls(code).increment(1),
        }
    }
}

impl<S, B, R> tower::Service<http::Request<B>> for GrpcServerService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let caller = request.extensions_mut().remove::<InProcessContext>();
        let path = request.uri().path();
        let routed = (self.known)(path);
        let (service, method) = routed_names(path, |_| routed);
        let metrics = self
            .metrics
            .method(if routed { path } else { "" }, service, method);
        let span = tracing::info_span!(
            "grpc.server",
            otel.name = if routed {
                path.trim_start_matches('/')
            } else {
                "unknown/unknown"
            },
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
            rpc.grpc.status_code = tracing::field::Empty,
            // The caller its internal token names (orca-push-internal-auth), never the token.
            enduser.id = tracing::field::Empty,
        );
        match caller {
            Some(InProcessContext(caller)) => {
                use tracing_opentelemetry::OpenTelemetrySpanExt as _;
                let _ = span.set_parent(caller);
            }
            None => set_parent_from_headers(&span, request.headers()),
        }
        let mut record = CallRecord {
            metrics,
            started: std::time::Instant::now(),
            recorded: false,
        };
        let future = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        Box::pin(
            async move {
                let result = future.await;
                let code = match &result {
                    Ok(response) => status_code(response),
                    Err(_) => 2, // UNKNOWN: the transport failed
                };
                record.record(code);
                result
            }
            .instrument(span),
        )
    }
}

/// gRPC's CANCELLED: the caller went away before the answer.
const CANCELLED: i64 = 1;

/// A served call's metrics and status code, recorded once: when its answer is ready, or, should
/// the caller go away first (the call's future dropped, as an in-process call ending with its
/// caller is), as `CANCELLED`, so that no call served goes uncounted.
struct CallRecord {
    metrics: Arc<MethodMetrics>,
    started: std::time::Instant,
    recorded: bool,
}

impl CallRecord {
    fn record(&mut self, code: i64) {
        if std::mem::replace(&mut self.recorded, true) {
            return;
        }
        // Inside the call's span: `Instrumented` enters it to drop the future too.
        tracing::Span::current().record("rpc.grpc.status_code", code);
        self.metrics.count(code);
        self.metrics
            .duration
            .record(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        self.record(CANCELLED);
    }
}

/// Client side: open a `client` span per call and inject its context into the metadata.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcClientLayer;

impl<S> tower::Layer<S> for GrpcClientLayer {
    type Service = GrpcClientService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        traced(inner)
    }
}

#[derive(Debug, Clone)]
pub struct GrpcClientService<S> {
    inner: S,
    /// The server is in this process: the context goes in the request's extensions.
    in_process: bool,
}

/// `transport` (a tonic channel) with every call traced and carrying the caller's trace context
/// as `traceparent` metadata.
pub fn traced<S>(transport: S) -> GrpcClientService<S> {
    GrpcClientService {
        inner: transport,
        in_process: false,
    }
}

/// `transport` (a server in this process) with every call traced and carrying the caller's trace
/// context in the request's extensions.
pub fn traced_in_process<S>(transport: S) -> GrpcClientService<S> {
    GrpcClientService {
        inner: transport,
        in_process: true,
    }
}

impl<S, B, R> tower::Service<http::Request<B>> for GrpcClientService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let (service, method) = rpc_names(request.uri().path());
        let span = tracing::info_span!(
            "grpc.client",
            // `{service}/{method}`, as the path has it.
            otel.name = request.uri().path().trim_start_matches('/'),
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let future = {
            let _entered = span.enter();
            if self.in_process {
                use tracing_opentelemetry::OpenTelemetrySpanExt as _;
                request
                    .extensions_mut()
                    .insert(InProcessContext(span.context()));
            } else {
                inject_current_context(request.headers_mut());
            }
            self.inner.call(request)
        };
        Box::pin(
            async move {
                let result = future.await;
                if let Ok(response) = &result {
                    tracing::Span::current().record("rpc.grpc.status_code", status_code(response));
                }
                result
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tower::{Layer as _, Service as _};

    use super::*;

    /// A served call's `traceparent` metadata, as it arrived.
    #[derive(Clone, Default)]
    struct Arrived(Arc<Mutex<Vec<Option<String>>>>);

    impl tower::Service<http::Request<()>> for Arrived {
        type Response = http::Response<()>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<http::Response<()>, std::convert::Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<()>) -> Self::Future {
            let traceparent = request
                .headers()
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            self.0.lock().unwrap().push(traceparent);
            std::future::ready(Ok(http::Response::new(())))
        }
    }

    /// Held by the tests that open the layers' spans. tracing caches each callsite's interest
    /// globally: a test without a subscriber reaching a callsite first, while another test's
    /// thread-local subscriber is being set, can leave that callsite disabled for the other test.
    static CALLSITES: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn callsites() -> std::sync::MutexGuard<'static, ()> {
        CALLSITES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Both transports continue the caller's trace; only the network one writes and parses a
    /// `traceparent` to do it.
    #[tokio::test]
    #[allow(clippy::await_holding_lock)] // one thread; the lock only orders whole tests
    async fn calls_in_process_carry_the_context_without_writing_it_out() {
        let _callsites = callsites();
        crate::install_propagator();
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = crate::init::subscriber(&provider, crate::LogFormat::Text, std::io::sink);
        let _default = tracing::subscriber::set_default(subscriber);
        for in_process in [true, false] {
            exporter.reset();
            let arrived = Arrived::default();
            let server = GrpcServerLayer::new(|_| true).layer(arrived.clone());
            let mut client = if in_process {
                traced_in_process(server)
            } else {
                traced(server)
            };
            let request = http::Request::builder()
                .uri("/orca.push.queue.v1.QueueService/Enqueue")
                .body(())
                .unwrap();
            client.call(request).await.unwrap();
            provider.force_flush().unwrap();
            let spans = exporter.get_finished_spans().unwrap();
            let span = |kind: opentelemetry::trace::SpanKind| {
                spans.iter().find(|s| s.span_kind == kind).unwrap()
            };
            let caller = span(opentelemetry::trace::SpanKind::Client);
            let served = span(opentelemetry::trace::SpanKind::Server);
            assert_eq!(served.parent_span_id, caller.span_context.span_id());
            assert_eq!(
                served.span_context.trace_id(),
                caller.span_context.trace_id()
            );
            let traceparent = arrived.0.lock().unwrap()[0].clone();
            assert_eq!(
                traceparent.is_some(),
                !in_process,
                "in process: {in_process}"
            );
        }
    }

    /// A caller's unsampled `traceparent` makes its span unsampled; a sampled one or none (the
    /// SDK's default sampler, parent-based, always on) does not.
    #[test]
    fn a_span_under_an_unsampled_parent_is_not_sampled() {
        let _callsites = callsites();
        crate::install_propagator();
        let provider = SdkTracerProvider::builder().build();
        let subscriber = crate::init::subscriber(&provider, crate::LogFormat::Text, std::io::sink);
        let _default = tracing::subscriber::set_default(subscriber);
        let under = |traceparent: Option<&str>| {
            let span = tracing::info_span!("request");
            if let Some(traceparent) = traceparent {
                let mut headers = http::HeaderMap::new();
                headers.insert("traceparent", traceparent.parse().unwrap());
                crate::set_parent_from_headers(&span, &headers);
            }
            crate::is_sampled(&span)
        };
        assert!(!under(Some(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        )));
        assert!(under(Some(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        )));
        assert!(under(None));
    }

    fn known(path: &str) -> bool {
        path == "/orca.push.auth.v1.AuthService/Authenticate"
    }

    /// A served call that never answers, as one waiting on a round or a claim does.
    #[derive(Clone, Copy)]
    struct Never;

    impl tower::Service<http::Request<()>> for Never {
        type Response = http::Response<()>;
        type Error = std::convert::Infallible;
        type Future = std::future::Pending<Result<http::Response<()>, std::convert::Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            std::future::pending()
        }
    }

    fn authenticate() -> http::Request<()> {
        http::Request::builder()
            .uri("/orca.push.auth.v1.AuthService/Authenticate")
            .body(())
            .unwrap()
    }

    #[tokio::test]
    #[allow(clippy::await_holding_lock)] // one thread; the lock only orders whole tests
    async fn a_call_whose_caller_leaves_is_counted_as_cancelled() {
        let _callsites = callsites();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let _local = metrics::set_default_local_recorder(&recorder);
        let calls = |code: &str| {
            let series = format!(
                "orca_push_grpc_server_calls_total{{service=\"orca.push.auth.v1.AuthService\",method=\"Authenticate\",code=\"{code}\"}} "
            );
            recorder
                .handle()
                .render()
                .lines()
                .find_map(|l| l.strip_prefix(&series)?.parse::<f64>().ok())
        };
        // Polled once, then dropped: the caller went away mid-call.
        let mut left = GrpcServerLayer::new(known)
            .layer(Never)
            .call(authenticate());
        assert!(futures_poll_once(&mut left).await.is_pending());
        drop(left);
        assert_eq!(calls("1"), Some(1.0));
        // Dropped before it was ever polled: counted too.
        drop(
            GrpcServerLayer::new(known)
                .layer(Never)
                .call(authenticate()),
        );
        assert_eq!(calls("1"), Some(2.0));
        // Answered: counted once, with its own code, and not again when dropped.
        let answered = GrpcServerLayer::new(known)
            .layer(Arrived::default())
            .call(authenticate())
            .await;
        assert!(answered.is_ok());
        assert_eq!(calls("0"), Some(1.0));
        assert_eq!(calls("1"), Some(2.0));
    }

    /// Counts the series a recorder is asked for; every handle it gives is a no-op.
    #[derive(Default)]
    struct Registrations(std::sync::atomic::AtomicUsize);

    impl Registrations {
        fn made(&self) -> usize {
            self.0.load(std::sync::atomic::Ordering::Relaxed)
        }

        fn one(&self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    impl metrics::Recorder for Registrations {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }

        fn register_counter(
            &self,
            _: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Counter {
            self.one();
            metrics::Counter::noop()
        }

        fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
            self.one();
            metrics::Gauge::noop()
        }

        fn register_histogram(
            &self,
            _: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Histogram {
            self.one();
            metrics::Histogram::noop()
        }
    }

    /// A method's series are looked up at its first call and at a status code's first use, not on
    /// every call; unrouted paths share one entry.
    #[tokio::test]
    #[allow(clippy::await_holding_lock)] // one thread; the lock only orders whole tests
    async fn a_methods_series_are_looked_up_once() {
        let _callsites = callsites();
        let recorder = Registrations::default();
        let _local = metrics::set_default_local_recorder(&recorder);
        let layer = GrpcServerLayer::new(known);
        for _ in 0..3 {
            let answered = layer.layer(Arrived::default()).call(authenticate()).await;
            assert!(answered.is_ok());
        }
        assert_eq!(recorder.made(), 2, "the duration and the calls answered OK");
        for path in ["/made.up.Service/One", "/made.up.Service/Two"] {
            let request = http::Request::builder().uri(path).body(()).unwrap();
            let answered = layer.layer(Arrived::default()).call(request).await;
            assert!(answered.is_ok());
        }
        assert_eq!(recorder.made(), 4, "one entry for every unrouted path");
    }

    async fn futures_poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
    }

    #[test]
    fn only_routed_methods_are_named() {
        assert_eq!(
            routed_names("/orca.push.auth.v1.AuthService/Authenticate", known),
            ("orca.push.auth.v1.AuthService", "Authenticate")
        );
        for path in [
            "/orca.push.auth.v1.AuthService/Other",
            "/made.up.Service/Method123",
            "/no-slash",
            "",
        ] {
            assert_eq!(routed_names(path, known), ("unknown", "unknown"), "{path}");
        }
    }
}
