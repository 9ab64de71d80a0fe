//! One JSON object per log line, for Cloud Logging and Loki: `timestamp`, `severity` (Cloud
//! Logging's level names), `target`, `message` and the event's fields, the names of the spans it
//! was written in, and, inside a span, the span's OpenTelemetry `trace_id` and `span_id` (also as
//! Cloud Logging's `logging.googleapis.com/spanId`), so a log line leads to its trace.

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_opentelemetry::OtelData;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

pub struct JsonLines;

/// How the JSON lines format a span's fields: not at all, since a line names its spans and
/// carries their trace ids, never their fields (those go to the trace). With the fmt layer's
/// default, every span's fields were formatted into text as it opened, whether or not a line was
/// ever written inside it: 0.5-2.4% of the gateway's CPU under admission, depending on the
/// profile (text mode, which does print them, still formats them).
pub struct NoSpanFields;

impl<'writer> FormatFields<'writer> for NoSpanFields {
    fn format_fields<R: RecordFields>(&self, _writer: Writer<'writer>, _fields: R) -> fmt::Result {
        Ok(())
    }
}

struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), Value::String(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0
            .insert(field.name().to_owned(), Value::String(value.to_owned()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
}

/// Cloud Logging's severity names.
fn severity(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "ERROR",
        Level::WARN => "WARNING",
        Level::INFO => "INFO",
        Level::DEBUG | Level::TRACE => "DEBUG",
    }
}

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let metadata = event.metadata();
        let mut line = Map::new();
        line.insert("timestamp".into(), Value::String(timestamp()));
        line.insert("severity".into(), severity(metadata.level()).into());
        line.insert("target".into(), metadata.target().into());
        event.record(&mut Fields(&mut line));
        if let Some(scope) = ctx.event_scope() {
            let mut names = Vec::new();
            let mut ids = None;
            for span in scope {
                names.push(Value::String(span.name().to_owned()));
                if ids.is_none()
                    && let Some(data) = span.extensions().get::<OtelData>()
                    && let (Some(trace), Some(span)) = (data.trace_id(), data.span_id())
                {
                    ids = Some((trace.to_string(), span.to_string()));
                }
            }
            names.reverse();
            line.insert("spans".into(), Value::Array(names));
            if let Some((trace_id, span_id)) = ids {
                line.insert("trace_id".into(), trace_id.into());
                line.insert(
                    "logging.googleapis.com/spanId".into(),
                    span_id.clone().into(),
                );
                line.insert("span_id".into(), span_id.into());
            }
        }
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// RFC 3339 UTC, as tracing-subscriber's own formatter writes it.
fn timestamp() -> String {
    use tracing_subscriber::fmt::time::FormatTime as _;
    let mut text = String::new();
    let _ = tracing_subscriber::fmt::time::SystemTime.format_time(&mut Writer::new(&mut text));
    text
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    use crate::LogFormat;

    /// Log lines written in a test, to read back.
    #[derive(Clone, Default)]
    pub(crate) struct Buffer(pub(crate) Arc<Mutex<Vec<u8>>>);

    impl Buffer {
        /// Every line written so far, parsed.
        pub(crate) fn lines(&self) -> Vec<serde_json::Value> {
            let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
            text.lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                .collect()
        }
    }

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_inside_a_span_carry_its_trace_and_span_ids() {
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber =
            crate::init::subscriber(&provider, LogFormat::Json, move || writer.clone());
        let (trace_id, span_id) = tracing::subscriber::with_default(subscriber, || {
            tracing::info!(outside = true, "before any span");
            let span = tracing::info_span!("http.server", route = "/v1/send");
            let _entered = span.enter();
            tracing::warn!(count = 3_u64, "inside");
            let context = span.context();
            let span_context = context.span().span_context().clone();
            (
                span_context.trace_id().to_string(),
                span_context.span_id().to_string(),
            )
        });
        let lines = buffer.lines();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["message"], "before any span");
        assert_eq!(lines[0]["outside"], true);
        assert!(lines[0].get("trace_id").is_none());
        assert_eq!(lines[1]["severity"], "WARNING");
        assert_eq!(lines[1]["count"], 3);
        assert_eq!(lines[1]["spans"], serde_json::json!(["http.server"]));
        assert_eq!(lines[1]["trace_id"], trace_id.as_str());
        assert_eq!(lines[1]["span_id"], span_id.as_str());
        assert_eq!(trace_id.len(), 32);
        assert!(lines[1]["timestamp"].as_str().unwrap().ends_with('Z'));
    }

    /// Formats as nothing, counting how often it was asked to.
    struct Counted(Arc<std::sync::atomic::AtomicUsize>);

    impl std::fmt::Debug for Counted {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
    }

    #[test]
    fn json_lines_never_format_a_spans_fields() {
        use tracing_subscriber::layer::SubscriberExt as _;
        let formatted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber =
            tracing_subscriber::registry().with(crate::init::json_layer(move || writer.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "queue.group_commit",
                field = ?Counted(formatted.clone()),
                later = tracing::field::Empty
            );
            span.record("later", tracing::field::debug(Counted(formatted.clone())));
            let _entered = span.enter();
            tracing::info!("inside");
        });
        assert_eq!(
            formatted.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "a span's fields are formatted for no line"
        );
        let lines = buffer.lines();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0]["spans"], serde_json::json!(["queue.group_commit"]));
    }
}
