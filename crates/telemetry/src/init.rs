//! Process-wide subscriber and tracer provider.

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

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

/// Where spans go: always created and propagated; exported by OTLP/gRPC to `otlp_endpoint` when
/// one is configured (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`). The
/// exporter also honours the standard `OTEL_EXPORTER_OTLP_HEADERS`/`_TIMEOUT`/`_COMPRESSION`.
/// Call inside the Tokio runtime: the exporter's gRPC client needs it.
pub fn tracer_provider(
    resource: Resource,
    otlp_endpoint: Option<&str>,
) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    use opentelemetry_otlp::WithExportConfig as _;
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(endpoint) = otlp_endpoint {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()?;
        builder = builder.with_batch_exporter(exporter);
    }
    Ok(builder.build())
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
/// spans to `provider`. Fails if a subscriber is already installed.
pub fn init(
    provider: SdkTracerProvider,
    format: LogFormat,
) -> Result<TelemetryGuard, tracing_subscriber::util::TryInitError> {
    init_with_log_writer(provider, format, std::io::stderr)
}

/// [`init`], with logs going to `writer` (tests read them back).
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

/// The subscriber [`init`] installs, for a caller (a test) that scopes it instead.
pub fn subscriber<W>(
    provider: &SdkTracerProvider,
    format: LogFormat,
    writer: W,
) -> impl tracing::Subscriber + Send + Sync + 'static
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    let tracer = provider.tracer("orca-push");
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (text, json) = match format {
        LogFormat::Text => (
            Some(
                tracing_subscriber::fmt::layer()
                    .with_writer(writer)
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
            ),
            None,
        ),
        LogFormat::Json => (
            None,
            Some(
                tracing_subscriber::fmt::layer()
                    .with_writer(writer)
                    .event_format(crate::json_log::JsonLines),
            ),
        ),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .with(text)
        .with(json)
}
