//! The OpenTelemetry layer, less what no one reads.
//!
//! The tracing-opentelemetry layer copies every span's fields into an OpenTelemetry builder as the
//! span opens and as each field is recorded, stamps the time on every exit (every poll of an
//! instrumented future), and builds and ends an OpenTelemetry span as the tracing span closes.
//! Without a collector all of that is dropped unread; what the process still needs is each span's
//! trace and span ids, its parent and its links, which the layer makes as a span opens (and starts
//! only once a child, a log line or a `traceparent` asks for them). Profiled at 1,000 end-to-end
//! APNs flows on SQLite, field copying, exits and closes were about 5% of the gateway's samples
//! (round 23 in docs/benchmarks.md). With a collector the layer is told everything, as before.

use std::any::TypeId;

use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Dispatch, Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// What the layer is told a span is when nothing is exported.
static BARE: Metadata<'static> = Metadata::new(
    "span",
    "orca_push_telemetry",
    tracing::Level::INFO,
    None,
    None,
    None,
    tracing::field::FieldSet::new(&[], tracing::callsite::Identifier(&BARE_CALLSITE)),
    tracing::metadata::Kind::SPAN,
);
static BARE_CALLSITE: tracing::callsite::DefaultCallsite =
    tracing::callsite::DefaultCallsite::new(&BARE);

/// What the process's spans are made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanDetail {
    /// A collector receives them: each span carries its fields, events, status and times.
    Exported,
    /// Nothing is exported: spans carry the trace (ids, parents, links, `traceparent` and the ids
    /// in JSON log lines) and nothing else.
    ContextOnly,
}

impl SpanDetail {
    /// `Exported` when spans have somewhere to go.
    pub fn exporting(export: bool) -> Self {
        if export {
            Self::Exported
        } else {
            Self::ContextOnly
        }
    }
}

/// `inner` (the OpenTelemetry layer) told only what `detail` needs. Without a collector its exits
/// are passed on only when it attaches each span's context to the thread while the span is
/// entered (`activates_context`, which must be what the layer was built with: JSON logs read the
/// context there, and each enter's guard is dropped at the exit); otherwise an exit only stamps an
/// end time no one reads. Exported, a span keeps the end the layer gives it: its last exit, which
/// for a span that children outlive comes well before its close.
pub(crate) struct Detailed<L> {
    inner: L,
    detail: SpanDetail,
    exits: bool,
}

impl<L> Detailed<L> {
    pub(crate) fn new(inner: L, detail: SpanDetail, activates_context: bool) -> Self {
        Self {
            inner,
            detail,
            exits: activates_context || detail == SpanDetail::Exported,
        }
    }

    fn exported(&self) -> bool {
        self.detail == SpanDetail::Exported
    }
}

impl<S, L> Layer<S> for Detailed<L>
where
    S: Subscriber,
    L: Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &Dispatch) {
        self.inner.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.inner.on_layer(subscriber);
    }

    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        self.inner.register_callsite(metadata)
    }

    fn enabled(&self, metadata: &Metadata<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.enabled(metadata, ctx)
    }

    fn event_enabled(&self, event: &Event<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.event_enabled(event, ctx)
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if self.exported() {
            return self.inner.on_new_span(attrs, id, ctx);
        }
        // The same span and parent, as a span of no field and one name: the layer makes room
        // for each field its metadata declares, and a name no one exports.
        let none: [(&tracing::field::Field, Option<&dyn tracing::Value>); 0] = [];
        let values = BARE.fields().value_set(&none);
        let bare = if attrs.is_contextual() {
            Attributes::new(&BARE, &values)
        } else if let Some(parent) = attrs.parent() {
            Attributes::child_of(parent.clone(), &BARE, &values)
        } else {
            Attributes::new_root(&BARE, &values)
        };
        self.inner.on_new_span(&bare, id, ctx);
    }

    fn on_record(&self, span: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if self.exported() {
            self.inner.on_record(span, values, ctx);
        }
    }

    fn on_follows_from(&self, span: &Id, follows: &Id, ctx: Context<'_, S>) {
        self.inner.on_follows_from(span, follows, ctx);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        if self.exported() {
            self.inner.on_event(event, ctx);
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        self.inner.on_enter(id, ctx);
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        if self.exits {
            self.inner.on_exit(id, ctx);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        // Not exported, the span's data goes with the registry's record of it.
        if self.exported() {
            self.inner.on_close(id, ctx);
        }
    }

    fn on_id_change(&self, old: &Id, new: &Id, ctx: Context<'_, S>) {
        self.inner.on_id_change(old, new, ctx);
    }

    // The trait's method is `unsafe` to implement: what it returns is read as the type asked for.
    // SAFETY: a pointer to `self` for its own type, else whatever the inner layer answers for its
    // types (the OpenTelemetry layer's `WithContext`, through which spans give their context),
    // each valid for as long as `self` is.
    #[allow(unsafe_code)]
    unsafe fn downcast_raw(&self, id: TypeId) -> Option<*const ()> {
        if id == TypeId::of::<Self>() {
            return Some(std::ptr::from_ref(self).cast());
        }
        // SAFETY: passed on as asked.
        unsafe { self.inner.downcast_raw(id) }
    }
}
