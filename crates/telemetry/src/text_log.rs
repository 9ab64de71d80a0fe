//! How uncolored text lines format fields. The fmt layer formats every span's fields into text as
//! the span opens (and appends each field recorded later), whether or not a line is ever written
//! inside it: a handful of spans per request. Its default styles each name and `=` for a terminal
//! even when no color is on, and a gRPC span's fields begin with `otel.name`, `otel.kind` and
//! `otel.status_code`, which only tell the OpenTelemetry layer what to call the span: the span's
//! own name and its `rpc.*` or `http.*` fields say the same on the line. Profiled at 100
//! end-to-end flows (SQLite), the default's field formatting was about 4% of the request threads'
//! samples.

use std::cell::RefCell;
use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};

/// `name=value` pairs as the default writes them without color (values as `Debug`, a raw
/// identifier's `r#` dropped, `log.*` fields skipped), leaving out `otel.*` fields. A set with a
/// `message` or an error (an event's, as a rule) goes to the default, which escapes them and
/// lists an error's sources.
#[derive(Debug, Default, Clone, Copy)]
pub struct TextFields;

thread_local! {
    /// Each thread's line of fields, kept between calls so that formatting allocates nothing once
    /// it has grown.
    static LINE: RefCell<String> = const { RefCell::new(String::new()) };
}

impl<'writer> FormatFields<'writer> for TextFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        match plain(&fields, |line| writer.write_str(line)) {
            Some(written) => written,
            None => DefaultFields::new().format_fields(writer, fields),
        }
    }

    /// A field recorded later: after a space, unless it is one left out.
    fn add_fields(
        &self,
        current: &'writer mut tracing_subscriber::fmt::FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let added = plain(fields, |line| {
            if !line.is_empty() && !current.fields.is_empty() {
                current.fields.push(' ');
            }
            current.fields.push_str(line);
            Ok(())
        });
        match added {
            Some(added) => added,
            None => {
                if !current.fields.is_empty() {
                    current.fields.push(' ');
                }
                DefaultFields::new().format_fields(current.as_writer(), fields)
            }
        }
    }
}

/// `fields` as plain text, handed to `write`; None if the default must format them.
fn plain<R: RecordFields>(
    fields: &R,
    write: impl FnOnce(&str) -> fmt::Result,
) -> Option<fmt::Result> {
    // `try_with`: a thread's destructors may still trace after its buffer is gone.
    LINE.try_with(|line| {
        // Taken, not borrowed: a field's `Debug` could log, and so format fields again.
        let mut plain = Plain {
            line: std::mem::take(&mut *line.borrow_mut()),
            defer: false,
            result: Ok(()),
        };
        plain.line.clear();
        fields.record(&mut plain);
        let written = match (plain.defer, plain.result) {
            (false, Ok(())) => Some(write(&plain.line)),
            _ => None,
        };
        *line.borrow_mut() = plain.line;
        written
    })
    .ok()
    .flatten()
}

struct Plain {
    line: String,
    /// A message or an error: the default formats this set.
    defer: bool,
    result: fmt::Result,
}

impl Visit for Plain {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &value);
    }

    fn record_error(&mut self, _field: &Field, _value: &(dyn std::error::Error + 'static)) {
        self.defer = true;
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let name = field.name();
        if self.defer || self.result.is_err() || name.starts_with("otel.") {
            return;
        }
        if name == "message" {
            self.defer = true;
            return;
        }
        if name.starts_with("log.") {
            return;
        }
        let name = name.strip_prefix("r#").unwrap_or(name);
        if !self.line.is_empty() {
            self.line.push(' ');
        }
        self.result = write!(self.line, "{name}={value:?}");
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;
    use crate::json_log::tests::Buffer;

    /// The line `emit` logs through a fmt layer with `fields`.
    fn line_with<N>(fields: N, emit: impl FnOnce()) -> String
    where
        N: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        let captured = Buffer::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .without_time()
                .with_target(false)
                .fmt_fields(fields)
                .with_writer(move || writer.clone()),
        );
        tracing::subscriber::with_default(subscriber, emit);
        String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
    }

    fn emit() {
        let span = tracing::info_span!(
            "grpc.server",
            otel.name = "orca.push.queue.v1.QueueService/Enqueue",
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            rpc.service = "orca.push.queue.v1.QueueService",
            rpc.method = "Enqueue",
            r#type = "alert",
            rpc.grpc.status_code = tracing::field::Empty,
            count = 3_u64,
        );
        span.record("rpc.grpc.status_code", 0_i64);
        span.record("otel.status_code", "ERROR");
        let _entered = span.enter();
        let error = std::io::Error::other("disk \u{1b}[31mfull");
        tracing::warn!(
            attempt = 2,
            error = &error as &dyn std::error::Error,
            "gave \u{1b}up"
        );
    }

    #[test]
    fn span_fields_read_as_the_default_writes_them_but_for_opentelemetry_s_own() {
        let ours = line_with(TextFields, emit);
        let default = line_with(DefaultFields::new(), emit);
        let (span, event) = ours.split_once("}: ").unwrap();
        assert_eq!(
            span,
            " WARN grpc.server{rpc.service=\"orca.push.queue.v1.QueueService\" \
             rpc.method=\"Enqueue\" type=\"alert\" count=3 rpc.grpc.status_code=0"
        );
        let (default_span, default_event) = default.split_once("}: ").unwrap();
        assert_eq!(
            default_span,
            " WARN grpc.server{otel.name=\"orca.push.queue.v1.QueueService/Enqueue\" \
             otel.kind=\"server\" rpc.service=\"orca.push.queue.v1.QueueService\" \
             rpc.method=\"Enqueue\" type=\"alert\" count=3 rpc.grpc.status_code=0 \
             otel.status_code=\"ERROR\""
        );
        // The event's fields (a message and an error) are the default's, escapes included.
        assert_eq!(event, default_event);
        assert!(event.starts_with("gave \\x1bup"), "{event}");
    }

    #[test]
    fn a_set_with_a_message_or_an_error_is_the_default_s() {
        let fields = |emit: fn()| {
            (
                line_with(TextFields, emit),
                line_with(DefaultFields::new(), emit),
            )
        };
        let (ours, default) = fields(|| tracing::info!(n = 1, "a \u{1b}message"));
        assert_eq!(ours, default);
        let (ours, default) = fields(|| {
            let error = std::io::Error::other("gone");
            tracing::info!(error = &error as &dyn std::error::Error);
        });
        assert_eq!(ours, default);
    }
}
