//! Tracing set-up and W3C trace-context propagation for every orca-push process.
//!
//! One subscriber per process: a fmt layer for logs and a tracing-opentelemetry layer for spans. The
//! gRPC server layer continues the caller's trace from request metadata; the gRPC client layer
//! injects the current span's context into every outgoing call. Nothing here records request or
//! response bodies: spans carry only method names, routes and status codes.

mod grpc;
mod init;
mod json_log;
mod span_detail;
mod text_log;

pub use grpc::{GrpcClientLayer, GrpcClientService, GrpcServerLayer, traced, traced_in_process};
pub use init::{
    ExportError, LogFormat, OtlpExport, OtlpProtocol, TelemetryGuard, init, init_with_log_writer,
    install_propagator, meter_provider, resource, subscriber, tracer_provider,
};
pub use span_detail::SpanDetail;

use opentelemetry::propagation::{Extractor, Injector};

/// Reads W3C headers out of an `http::HeaderMap` (HTTP requests and gRPC metadata alike).
pub struct HeaderExtractor<'a>(pub &'a http::HeaderMap);

/// The longest `tracestate` continued. W3C Trace Context allows 32 list members and asks
/// propagators to keep at least 512 characters; a caller's longer one (a header may hold some
/// 400 KB) would be copied into every span of its request, and is dropped whole instead.
pub const MAX_TRACESTATE: usize = 512;

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = self.0.get(key).and_then(|v| v.to_str().ok())?;
        if key == "tracestate" && value.len() > MAX_TRACESTATE {
            return None;
        }
        Some(value)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Writes W3C headers into an `http::HeaderMap`.
pub struct HeaderInjector<'a>(pub &'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// The OpenTelemetry context of the given span's parent, extracted from headers.
pub fn extract_context(headers: &http::HeaderMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// Injects the current span's context into headers.
pub fn inject_current_context(headers: &mut http::HeaderMap) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&context, &mut HeaderInjector(headers))
    });
}

/// Makes `span` a child of the trace context carried in `headers`, if any.
pub fn set_parent_from_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let _ = span.set_parent(extract_context(headers));
}

/// The W3C `traceparent` of `span` (from any task), if it is in a trace.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let context = span.context();
    let mut headers = http::HeaderMap::new();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&context, &mut HeaderInjector(&mut headers))
    });
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Makes `span` a child of the span a W3C `traceparent` names (one of several calls carried in one
/// request, each continuing its own trace). An invalid one leaves `span` as it was.
pub fn set_parent_from_traceparent(span: &tracing::Span, traceparent: &str) {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    if let Some(parent) = span_context_from_traceparent(traceparent) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
    }
}

/// The span context a W3C `traceparent` names, for linking a span to another trace.
pub fn span_context_from_traceparent(
    traceparent: &str,
) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::TraceContextExt as _;
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "traceparent",
        http::HeaderValue::from_str(traceparent).ok()?,
    );
    let context = extract_context(&headers);
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

/// Whether `span` is sampled (its spans exported): not under a parent that says it is not, such
/// as a caller's `traceparent` ending in `-00`.
pub fn is_sampled(span: &tracing::Span) -> bool {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    span.context().span().span_context().is_sampled()
}

/// Links `span` to each trace named by `traceparents` (a delivery to the admissions it carries).
pub fn link_traces<'a>(span: &tracing::Span, traceparents: impl IntoIterator<Item = &'a String>) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    for traceparent in traceparents {
        if let Some(context) = span_context_from_traceparent(traceparent) {
            span.add_link(context);
        }
    }
}

/// Links `span` to each of `spans` (a flush of outcomes to the deliveries it reports).
pub fn link_spans<'a>(span: &tracing::Span, spans: impl IntoIterator<Item = &'a tracing::Span>) {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    for linked in spans {
        let context = linked.context();
        let span_context = context.span().span_context().clone();
        if span_context.is_valid() {
            span.add_link(span_context);
        }
    }
}
