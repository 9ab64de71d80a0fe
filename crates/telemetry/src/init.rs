//! Process-wide subscriber and tracer provider.

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::span_detail::{Detailed, SpanDetail};

/// Flushes and shuts the tracer provider down when dropped, so no span is lost at exit.
#[must_use = "dropping the guard flushes and stops tracing"]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
}

impl TelemetryGuard {
    pub fn provider(&self) -> &SdkTracerProvider {
        &self.provider
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Err(error) = self.provider.force_flush() {
            eprintln!("telemetry: flush at shutdown failed: {error}");
        }
        let _ = self.provider.shutdown();
    }
}

/// W3C trace context (`traceparent`, `tracestate`) is the one propagation format.
pub fn install_propagator() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
}

/// A resource naming the service and this instance.
pub fn resource(service_name: &str, instance_id: &str) -> Resource {
    Resource::builder()
        .with_service_name(service_name.to_owned())
        .with_attribute(KeyValue::new("service.instance.id", instance_id.to_owned()))
        .build()
}

/// How spans leave the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (`grpc`).
    Grpc,
    /// OTLP over HTTP with protobuf bodies (`http/protobuf`).
    HttpProtobuf,
}

/// Where and how spans are exported.
#[derive(Debug, Clone)]
pub struct OtlpExport {
    /// The collector: for gRPC its address, for HTTP the full URL of its traces endpoint.
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    /// PEM roots trusted besides the system's for an `https://` endpoint (`ORCA_PUSH_CA_FILE`).
    pub extra_roots_pem: Option<Vec<u8>>,
}

/// Why an exporter could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("the extra CA roots are not PEM certificates: {0}")]
    Roots(String),
}

/// Where spans go: always created and propagated; exported by OTLP to `export` when one is
/// configured. The exporters also honour the standard `OTEL_EXPORTER_OTLP_HEADERS`, `_TIMEOUT` and
/// `_COMPRESSION`. An `https://` endpoint is reached over TLS, trusting the system's roots and any
/// extra ones. Call inside the Tokio runtime: the gRPC exporter's client needs it.
pub fn tracer_provider(
    resource: Resource,
    export: Option<&OtlpExport>,
) -> Result<SdkTracerProvider, ExportError> {
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(export) = export {
        builder = builder.with_batch_exporter(span_exporter(export)?);
    }
    Ok(builder.build())
}

/// The gRPC or HTTP exporter of one signal, over TLS for an `https://` endpoint. A macro because
/// the span and metric exporter builders share their methods but no trait.
macro_rules! otlp_exporter {
    ($exporter:ty, $export:expr) => {{
        use opentelemetry_otlp::{
            WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _,
        };
        let export: &OtlpExport = $export;
        let tls = export.endpoint.starts_with("https://");
        match export.protocol {
            OtlpProtocol::Grpc => {
                let mut builder = <$exporter>::builder()
                    .with_tonic()
                    .with_endpoint(&export.endpoint);
                if tls {
                    builder = builder.with_tls_config(grpc_tls(export));
                }
                Ok::<_, ExportError>(builder.build()?)
            }
            OtlpProtocol::HttpProtobuf => {
                let mut builder = <$exporter>::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(&export.endpoint);
                if let Some(pem) = export.extra_roots_pem.clone().filter(|_| tls) {
                    builder = builder.with_http_client(blocking_client_trusting(pem)?);
                }
                Ok(builder.build()?)
            }
        }
    }};
}

fn span_exporter(export: &OtlpExport) -> Result<opentelemetry_otlp::SpanExporter, ExportError> {
    otlp_exporter!(opentelemetry_otlp::SpanExporter, export)
}

/// A meter provider exporting every metric by OTLP to `export`, on the SDK's periodic reader
/// (`OTEL_METRIC_EXPORT_INTERVAL`, 60 s by default). Histograms whose name ends in `_seconds` get
/// `seconds_buckets`, as Prometheus gives them (the SDK's default buckets are for milliseconds).
/// Call inside the Tokio runtime.
pub fn meter_provider(
    resource: Resource,
    export: &OtlpExport,
    seconds_buckets: &[f64],
) -> Result<opentelemetry_sdk::metrics::SdkMeterProvider, ExportError> {
    use opentelemetry_sdk::metrics::{Aggregation, InstrumentKind, Stream};
    // (Stream::with_aggregation is behind the SDK's spec_unstable_metrics_views feature.)
    let exporter = otlp_exporter!(opentelemetry_otlp::MetricExporter, export)?;
    let reader = opentelemetry_sdk::metrics::PeriodicReader::builder(exporter).build();
    let boundaries = seconds_buckets.to_vec();
    let seconds = move |instrument: &opentelemetry_sdk::metrics::Instrument| {
        if instrument.kind() != InstrumentKind::Histogram
            || !instrument.name().ends_with("_seconds")
        {
            return None;
        }
        Stream::builder()
            .with_aggregation(Aggregation::ExplicitBucketHistogram {
                boundaries: boundaries.clone(),
                record_min_max: true,
            })
            .build()
            .ok()
    };
    Ok(opentelemetry_sdk::metrics::SdkMeterProvider::builder()
        .with_resource(resource)
        .with_reader(reader)
        .with_view(seconds)
        .build())
}

/// TLS to a gRPC collector: the system's roots and any extra ones.
fn grpc_tls(export: &OtlpExport) -> tonic::transport::ClientTlsConfig {
    let mut config = tonic::transport::ClientTlsConfig::new().with_native_roots();
    if let Some(pem) = &export.extra_roots_pem {
        config = config.ca_certificate(tonic::transport::Certificate::from_pem(pem));
    }
    config
}

/// A blocking reqwest client that also trusts the PEM roots in `pem`. Built on a thread of its
/// own: a blocking client must not be made (or dropped) on a runtime thread.
fn blocking_client_trusting(pem: Vec<u8>) -> Result<reqwest::blocking::Client, ExportError> {
    std::thread::spawn(move || {
        let mut builder =
            reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(10));
        for certificate in reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| ExportError::Roots(e.to_string()))?
        {
            builder = builder.add_root_certificate(certificate);
        }
        builder
            .build()
            .map_err(|e| ExportError::Roots(e.to_string()))
    })
    .join()
    .map_err(|_| ExportError::Roots("the client thread panicked".into()))?
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines, colored on a terminal.
    #[default]
    Text,
    /// One JSON object per line with `trace_id` and `span_id` inside a span (Cloud Logging, Loki).
    Json,
}

/// Installs the process's subscriber: logs to stderr (filtered by `RUST_LOG`, default `info`) and
/// spans to `provider`, with what `detail` says they are made for (`SpanDetail::exporting`: is
/// there a collector; a provider that exports gets field-less spans all named `span` if told
/// `ContextOnly`). Fails if a subscriber is already installed.
pub fn init(
    provider: SdkTracerProvider,
    format: LogFormat,
    detail: SpanDetail,
) -> Result<TelemetryGuard, tracing_subscriber::util::TryInitError> {
    install_propagator();
    opentelemetry::global::set_tracer_provider(provider.clone());
    subscriber_logging(&provider, format, std::io::stderr, log_filter(), detail).try_init()?;
    Ok(TelemetryGuard { provider })
}

/// [`init`] for spans that are exported, with logs going to `writer` (tests read them back).
pub fn init_with_log_writer<W>(
    provider: SdkTracerProvider,
    format: LogFormat,
    writer: W,
) -> Result<TelemetryGuard, tracing_subscriber::util::TryInitError>
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    install_propagator();
    opentelemetry::global::set_tracer_provider(provider.clone());
    subscriber(&provider, format, writer).try_init()?;
    Ok(TelemetryGuard { provider })
}

/// The log filter: `RUST_LOG`, else `info`.
fn log_filter() -> tracing_subscriber::EnvFilter {
    log_filter_of(std::env::var("RUST_LOG").ok().as_deref())
}

/// [`log_filter`] of a `RUST_LOG` value: a directive it cannot read is left out, with a line on
/// stderr naming it (tracing-subscriber's), and the rest kept; none at all is `info`. (Refusing the
/// whole value for one typo would drop the operator's levels without a word.)
fn log_filter_of(value: Option<&str>) -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing::level_filters::LevelFilter::INFO.into())
        .parse_lossy(value.unwrap_or_default())
}

/// The subscriber [`init`] installs for exported spans, for a caller (a test) that scopes it
/// instead.
pub fn subscriber<W>(
    provider: &SdkTracerProvider,
    format: LogFormat,
    writer: W,
) -> impl tracing::Subscriber + Send + Sync + 'static
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    subscriber_logging(provider, format, writer, log_filter(), SpanDetail::Exported)
}

/// [`subscriber`], with `logs` instead of `RUST_LOG` and spans made for `detail`.
fn subscriber_logging<W>(
    provider: &SdkTracerProvider,
    format: LogFormat,
    writer: W,
    logs: tracing_subscriber::EnvFilter,
    detail: SpanDetail,
) -> impl tracing::Subscriber + Send + Sync + 'static
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    let tracer = provider.tracer("orca-push");
    // JSON lines print the ids of the span they are logged in, which the OpenTelemetry layer
    // assigns as it starts the span: on its first entry with activation, else only once a child
    // or a propagation asks for its context.
    let activation = format == LogFormat::Json;
    let colored = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (text, plain, json) = match format {
        LogFormat::Text if colored => (
            Some(
                tracing_subscriber::fmt::layer()
                    .with_writer(writer)
                    .with_ansi(true),
            ),
            None,
            None,
        ),
        // Not a terminal (a service's log): the same lines, with cheaper span fields.
        LogFormat::Text => (
            None,
            Some(
                tracing_subscriber::fmt::layer()
                    .with_writer(writer)
                    .with_ansi(false)
                    .fmt_fields(crate::text_log::TextFields),
            ),
            None,
        ),
        LogFormat::Json => (None, None, Some(json_layer(writer))),
    };
    tracing_subscriber::registry()
        .with(LogsAndTracedSpans::new(logs))
        .with(Detailed::new(
            span_layer(tracer, activation),
            detail,
            activation,
        ))
        .with(text)
        .with(plain)
        .with(json)
}

/// The subscriber's one filter: what `logs` enables (the log lines written, and the events the
/// trace carries), and every span at `INFO` or above whatever `logs` says, because traces and
/// their propagation are made of spans: a quieter log (`RUST_LOG=warn`) must not stop the trace
/// of every request, nor the `traceparent` a call carries to the next process.
///
/// A global filter, as `EnvFilter` alone was: tracing-subscriber combines filters (`or`) only
/// per layer, and a per-layer filter looks the span up in the registry on every enter, exit and
/// record; measured at 4-19% fewer sends per second in the admission benchmark (round 15 in
/// docs/benchmarks.md). Each callsite's answer is cached as before.
///
/// `EnvFilter` follows the spans a request is in only for directives that name a span (`a[b]=x`):
/// without one, it still takes a lock and looks the span up as each span opens, is entered,
/// exited and closed, to find nothing. The filter is then not told of spans at all.
struct LogsAndTracedSpans {
    logs: tracing_subscriber::EnvFilter,
    names_spans: bool,
}

impl LogsAndTracedSpans {
    fn new(logs: tracing_subscriber::EnvFilter) -> Self {
        // A span directive is written with its span in brackets; targets are module paths.
        let names_spans = logs.to_string().contains('[');
        Self { logs, names_spans }
    }

    fn traced(meta: &tracing::Metadata<'_>) -> bool {
        meta.is_span() && *meta.level() <= tracing::Level::INFO
    }

    /// Lines below `INFO` from a library that writes secrets into them, whatever `RUST_LOG` says:
    /// yup-oauth2 logs, at `DEBUG` through the `log` crate (which the subscriber takes in), the
    /// signed assertion it sends the token endpoint and the access tokens it gets back. Neither
    /// may reach a log line or an exported span event.
    fn withheld(meta: &tracing::Metadata<'_>) -> bool {
        const WRITES_SECRETS: [&str; 1] = ["yup_oauth2"];
        *meta.level() > tracing::Level::INFO
            && WRITES_SECRETS.iter().any(|crate_name| {
                meta.target()
                    .strip_prefix(crate_name)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
            })
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LogsAndTracedSpans {
    fn register_callsite(
        &self,
        meta: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        // Always asked first: it learns here which spans its span directives name.
        let logs = tracing_subscriber::Layer::<S>::register_callsite(&self.logs, meta);
        if Self::withheld(meta) {
            tracing::subscriber::Interest::never()
        } else if Self::traced(meta) {
            tracing::subscriber::Interest::always()
        } else {
            logs
        }
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        let logs = tracing_subscriber::Layer::<S>::max_level_hint(&self.logs)?;
        Some(logs.max(tracing::level_filters::LevelFilter::INFO))
    }

    fn enabled(
        &self,
        meta: &tracing::Metadata<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        !Self::withheld(meta) && (Self::traced(meta) || self.logs.enabled(meta, ctx))
    }

    // EnvFilter follows the spans a request is in, for directives that name span fields.
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if self.names_spans {
            self.logs.on_new_span(attrs, id, ctx);
        }
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if self.names_spans {
            self.logs.on_record(id, values, ctx);
        }
    }

    fn on_enter(&self, id: &tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        if self.names_spans {
            self.logs.on_enter(id, ctx);
        }
    }

    fn on_exit(&self, id: &tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        if self.names_spans {
            self.logs.on_exit(id, ctx);
        }
    }

    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        if self.names_spans {
            self.logs.on_close(id, ctx);
        }
    }
}

/// The layer that turns tracing spans into OpenTelemetry spans, carrying only what a trace needs:
/// the span's own fields, its parent and links, its times and status. The crate's defaults also
/// time every poll (`busy_ns`/`idle_ns`), attach the span's context to the thread on every poll
/// (kept for JSON logs: `activation`), and add the source file, line, module, target and thread (name
/// allocated) to every span: work on every span of every request for attributes nothing here
/// reads (the layer was a tenth of the request threads' samples in a profile of SQLite admission
/// at 64 connections). Context is propagated from the tracing span
/// (`OpenTelemetrySpanExt::context`), never from OpenTelemetry's thread-local current context.
fn span_layer<S>(
    tracer: opentelemetry_sdk::trace::SdkTracer,
    activation: bool,
) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_context_activation(activation)
}

/// The fmt layer writing JSON lines (`LogFormat::Json`) to `writer`.
pub(crate) fn json_layer<S, W>(
    writer: W,
) -> tracing_subscriber::fmt::Layer<S, crate::json_log::NoSpanFields, crate::json_log::JsonLines, W>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + 'static,
{
    tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .fmt_fields(crate::json_log::NoSpanFields)
        .event_format(crate::json_log::JsonLines)
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TraceContextExt as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    use super::*;

    #[test]
    fn a_log_filter_with_one_unreadable_directive_keeps_the_others() {
        assert_eq!(
            log_filter_of(Some("warn,orca_push=debg")).to_string(),
            "warn"
        );
        assert_eq!(log_filter_of(None).to_string(), "info");
        assert_eq!(log_filter_of(Some("debug")).to_string(), "debug");
    }

    /// A provider exporting every span as it ends to the exporter it comes with.
    fn exporting() -> (InMemorySpanExporter, SdkTracerProvider) {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        (exporter, provider)
    }

    /// A span carries its own fields and its parent, and none of the per-span extras the
    /// OpenTelemetry layer adds by default (each costing work on every span of every request).
    #[test]
    fn spans_carry_their_fields_and_parent_and_no_per_span_extras() {
        let (exporter, provider) = exporting();
        let subscriber = subscriber(&provider, LogFormat::Text, std::io::sink);
        let (parent_id, seen_inside) = tracing::subscriber::with_default(subscriber, || {
            let parent = tracing::info_span!("http.server", http.route = "/v1/send");
            let parent_id = parent.context().span().span_context().span_id();
            let seen_inside = parent.in_scope(|| {
                let child = tracing::info_span!("grpc.client", rpc.method = "Enqueue");
                // Propagation reads the tracing span's context, not a thread-local one.
                let _entered = child.enter();
                tracing::Span::current()
                    .context()
                    .span()
                    .span_context()
                    .trace_id()
            });
            (parent_id, seen_inside)
        });
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans.len(), 2);
        let child = spans.iter().find(|s| s.name == "grpc.client").unwrap();
        let parent = spans.iter().find(|s| s.name == "http.server").unwrap();
        assert_eq!(child.parent_span_id, parent_id);
        assert_eq!(
            child.span_context.trace_id(),
            parent.span_context.trace_id()
        );
        assert_eq!(seen_inside, parent.span_context.trace_id());
        let keys: Vec<&str> = child.attributes.iter().map(|kv| kv.key.as_str()).collect();
        assert_eq!(keys, ["rpc.method"], "only the span's own fields");
    }

    /// What `f` logs as JSON lines under the log filter `logs`, its spans going to `provider`.
    fn json_logged<R>(
        provider: &SdkTracerProvider,
        logs: &str,
        f: impl FnOnce() -> R,
    ) -> (R, Vec<serde_json::Value>) {
        json_logged_for(provider, logs, SpanDetail::Exported, f)
    }

    /// [`json_logged`], with spans made for `detail`.
    fn json_logged_for<R>(
        provider: &SdkTracerProvider,
        logs: &str,
        detail: SpanDetail,
        f: impl FnOnce() -> R,
    ) -> (R, Vec<serde_json::Value>) {
        let buffer = crate::json_log::tests::Buffer::default();
        let writer = buffer.clone();
        let subscriber = subscriber_logging(
            provider,
            LogFormat::Json,
            move || writer.clone(),
            tracing_subscriber::EnvFilter::new(logs),
            detail,
        );
        let result = tracing::subscriber::with_default(subscriber, f);
        (result, buffer.lines())
    }

    /// A `RUST_LOG` directive that names a span still opens the log inside it, on a span the
    /// filter keeps for the trace whatever `RUST_LOG` says.
    #[test]
    fn a_log_filter_naming_a_span_still_applies_inside_it() {
        let provider = SdkTracerProvider::builder().build();
        let ((), lines) = json_logged(&provider, "warn,[grpc.client]=debug", || {
            tracing::debug!("outside: not logged");
            tracing::info_span!("http.server").in_scope(|| tracing::debug!("not logged either"));
            tracing::info_span!("grpc.client").in_scope(|| tracing::debug!("logged"));
        });
        let messages: Vec<&serde_json::Value> = lines.iter().map(|l| &l["message"]).collect();
        assert_eq!(messages, ["logged"], "{lines:?}");
    }

    /// yup-oauth2's debug lines (a signed assertion, access tokens) are never logged, even with
    /// every target at `DEBUG` or that crate named; its warnings still are, and so is everything
    /// else the filter asks for.
    #[test]
    fn a_library_that_logs_secrets_is_held_to_info() {
        let provider = SdkTracerProvider::builder().build();
        for filter in ["debug", "trace", "info,yup_oauth2=trace"] {
            let ((), lines) = json_logged(&provider, filter, || {
                tracing::debug!(target: "yup_oauth2::service_account", "assertion=SECRET");
                tracing::debug!(target: "yup_oauth2", "access_token=SECRET");
                tracing::warn!(target: "yup_oauth2::authenticator", "token endpoint refused");
                tracing::debug!(target: "yup_oauth2_lookalike", "logged");
                tracing::info!("logged too");
            });
            let messages: Vec<&serde_json::Value> = lines.iter().map(|l| &l["message"]).collect();
            assert_eq!(
                messages,
                ["token endpoint refused", "logged", "logged too"],
                "{filter}: {lines:?}"
            );
        }
    }

    /// Only a filter with a span directive follows spans; one without is not told of them.
    #[test]
    fn only_a_filter_naming_a_span_follows_spans() {
        let names_spans = |filter: &str| {
            LogsAndTracedSpans::new(tracing_subscriber::EnvFilter::new(filter)).names_spans
        };
        assert!(!names_spans("info"));
        assert!(!names_spans("warn,orca_push_queue=debug,sqlx::query=debug"));
        assert!(names_spans("warn,[grpc.client]=debug"));
        assert!(names_spans(
            "info,orca_push[http.server{http.route=/v1/send}]=trace"
        ));
    }

    /// `RUST_LOG` quiets the log, not the trace: with only warnings logged, every span is still
    /// made, parented and exported, and the one warning written carries the trace's ids.
    #[test]
    fn a_quiet_log_filter_keeps_every_span_a_trace_needs() {
        let (exporter, provider) = exporting();
        let (trace_id, lines) = json_logged(&provider, "warn", || {
            let parent = tracing::info_span!("http.server", http.route = "/v1/send");
            parent.in_scope(|| {
                let child = tracing::info_span!("grpc.client", rpc.method = "Enqueue");
                let _entered = child.enter();
                tracing::info!("not logged at warn");
                tracing::warn!("logged");
            });
            parent.context().span().span_context().trace_id()
        });
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
        assert_eq!(names, ["grpc.client", "http.server"]);
        assert!(spans.iter().all(|s| s.span_context.trace_id() == trace_id));
        assert_eq!(spans[0].parent_span_id, spans[1].span_context.span_id());
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0]["message"], "logged");
        assert_eq!(lines[0]["trace_id"], trace_id.to_string());
        assert_eq!(
            lines[0]["spans"],
            serde_json::json!(["http.server", "grpc.client"])
        );
    }

    /// The ids a trace needs, read inside spans made without a collector: the parent's trace id
    /// (seen from a child), a remote caller's (continued by `set_parent`), and whether the child's
    /// context names the parent's trace.
    fn trace_read_inside(
        parent: &tracing::Span,
        remote: &opentelemetry::Context,
    ) -> [opentelemetry::trace::TraceId; 3] {
        let from_parent = parent.in_scope(|| {
            let child = tracing::info_span!("grpc.client", rpc.method = "Enqueue");
            child.record("rpc.method", "Claim");
            child.follows_from(parent);
            child.context().span().span_context().trace_id()
        });
        let continued = tracing::info_span!("grpc.server", rpc.method = "Enqueue");
        continued.set_parent(remote.clone()).unwrap();
        let continued = continued.context().span().span_context().trace_id();
        [
            parent.context().span().span_context().trace_id(),
            from_parent,
            continued,
        ]
    }

    /// A remote caller's context, as a `traceparent` header gives it.
    fn remote_caller() -> (opentelemetry::Context, opentelemetry::trace::TraceId) {
        use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
        let trace_id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        let remote = SpanContext::new(
            trace_id,
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        (
            opentelemetry::Context::new().with_remote_span_context(remote),
            trace_id,
        )
    }

    /// Without a collector, spans still carry the trace from parent to child and from a remote
    /// caller on, and nothing is built for export: a provider that could export gets no span.
    #[test]
    fn spans_without_a_collector_carry_the_trace_and_build_nothing_else() {
        let (exporter, provider) = exporting();
        let (remote, remote_trace) = remote_caller();
        let subscriber = subscriber_logging(
            &provider,
            LogFormat::Text,
            std::io::sink,
            tracing_subscriber::EnvFilter::new("info"),
            SpanDetail::ContextOnly,
        );
        let [parent, child, continued] = tracing::subscriber::with_default(subscriber, || {
            tracing::info_span!("unasked", n = 1).in_scope(|| {});
            let parent = tracing::info_span!("http.server", http.route = "/v1/send");
            trace_read_inside(&parent, &remote)
        });
        assert_ne!(parent, opentelemetry::trace::TraceId::INVALID);
        assert_eq!(child, parent);
        assert_eq!(continued, remote_trace);
        provider.force_flush().unwrap();
        // A span whose context was asked for (the three read) is an SDK span, ended as it drops
        // (the process's provider has nowhere to send it), with no field. The one never asked
        // is never built.
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans.len(), 3, "{spans:?}");
        assert!(spans.iter().all(|s| s.attributes.is_empty()), "{spans:?}");
    }

    /// With a collector the same spans are exported whole: every field recorded, parents, links,
    /// the remote caller's trace, and the end each span was left at.
    #[test]
    fn spans_for_a_collector_are_exported_whole() {
        let (exporter, provider) = exporting();
        let (remote, remote_trace) = remote_caller();
        let subscriber = subscriber(&provider, LogFormat::Text, std::io::sink);
        let ([parent, child, continued], left) =
            tracing::subscriber::with_default(subscriber, || {
                // Entered once, then kept a while before it closes: it ends as it was left.
                let unasked = tracing::info_span!("unasked", n = 1);
                unasked.in_scope(|| {});
                let left = std::time::SystemTime::now();
                std::thread::sleep(std::time::Duration::from_millis(5));
                drop(unasked);
                let parent = tracing::info_span!("http.server", http.route = "/v1/send");
                (trace_read_inside(&parent, &remote), left)
            });
        assert_eq!(child, parent);
        assert_eq!(continued, remote_trace);
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans.len(), 4);
        let unasked = spans.iter().find(|s| s.name == "unasked").unwrap();
        assert!(
            unasked.end_time <= left,
            "ended at its last exit, not its close"
        );
        assert_eq!(unasked.attributes.len(), 1);
        let client = spans.iter().find(|s| s.name == "grpc.client").unwrap();
        let method: Vec<String> = client
            .attributes
            .iter()
            .map(|kv| format!("{}={}", kv.key, kv.value))
            .collect();
        // A field recorded again is appended to the span's attributes, not replaced.
        assert_eq!(method, ["rpc.method=Enqueue", "rpc.method=Claim"]);
        assert_eq!(client.links.len(), 1, "follows_from makes a link");
    }

    /// JSON lines still carry the trace's ids without a collector.
    #[test]
    fn json_lines_carry_the_trace_without_a_collector() {
        let (exporter, provider) = exporting();
        let (trace_id, lines) = json_logged_for(&provider, "info", SpanDetail::ContextOnly, || {
            let parent = tracing::info_span!("http.server", http.route = "/v1/send");
            parent.in_scope(|| {
                tracing::info_span!("grpc.client").in_scope(|| tracing::info!("inside"));
            });
            parent.context().span().span_context().trace_id()
        });
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0]["trace_id"], trace_id.to_string());
        provider.force_flush().unwrap();
        // The parent, started as it was entered, ends as it drops: with no field.
        let spans = exporter.get_finished_spans().unwrap();
        assert!(!spans.is_empty());
        assert!(spans.iter().all(|s| s.attributes.is_empty()), "{spans:?}");
    }
}
