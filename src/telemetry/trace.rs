//! W3C trace context across the broker. A batch's span follows the
//! `traceparent` of each of its deliveries (its parent when it holds one
//! delivery, a link to each in any case); the handler's transaction is a
//! span inside it, and every message the handler sends through the outbox
//! carries that transaction's context, so that a trace crosses the broker
//! both ways.
//!
//! Off until a subscriber with [`layer`] is installed (the CLI installs
//! one when `OTEL_EXPORTER_OTLP_ENDPOINT` is set): until then, what this
//! costs a batch is one atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use lapin::types::{AMQPValue, FieldTable};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracer;
use tracing::{Level, Span, Subscriber};
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};
use tracing_subscriber::filter::{Filtered, Targets};
use tracing_subscriber::registry::LookupSpan;

/// The header of the W3C trace context that names the sending span.
pub const TRACEPARENT: &str = "traceparent";
/// The header of vendor-specific trace state that travels with it.
pub const TRACESTATE: &str = "tracestate";

/// Whether a [`layer`] was built in this process.
static ON: AtomicBool = AtomicBool::new(false);

/// The OpenTelemetry layer of idem's spans for `tracer`, for a subscriber
/// of your own (a service that already exports traces adds it beside its
/// other layers). Spans and events at INFO and above go to OpenTelemetry,
/// but for those of the crates that carry them (the broker's and the
/// database's clients, the exporter's HTTP stack), which would only add
/// noise, or loop.
pub fn layer<S>(tracer: SdkTracer) -> Filtered<OpenTelemetryLayer<S, SdkTracer>, Targets, S>
where
    S: Subscriber + for<'span> LookupSpan<'span>,
{
    ON.store(true, Ordering::Relaxed);
    let quiet = [
        "amq_protocol",
        "axum",
        "deadpool",
        "h2",
        "hyper",
        "hyper_util",
        "lapin",
        "opentelemetry",
        "opentelemetry_http",
        "opentelemetry_otlp",
        "opentelemetry_sdk",
        "reqwest",
        "rustls",
        "tokio_postgres",
        "tower",
        "tower_http",
    ];
    let filter = quiet.into_iter().fold(
        Targets::new().with_default(Level::INFO),
        |filter, target| filter.with_target(target, tracing::level_filters::LevelFilter::OFF),
    );
    tracing_subscriber::Layer::with_filter(
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_target(false),
        filter,
    )
}

/// Whether spans go to OpenTelemetry: a [`layer`] was built.
#[doc(hidden)]
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Makes `span`, a consumer's span over `deliveries` (their headers) from
/// `queue`, follow each one's sender. Call it before the span is first
/// entered.
pub(crate) fn follow<'d>(
    span: &Span,
    queue: &str,
    consumer_group: &str,
    deliveries: impl ExactSizeIterator<Item = Option<&'d FieldTable>>,
) {
    let count = deliveries.len();
    span.record("otel.name", format!("process {queue}"));
    span.record("otel.kind", "consumer");
    span.set_attribute("messaging.system", "rabbitmq");
    span.set_attribute("messaging.operation.type", "process");
    span.set_attribute("messaging.operation.name", "process");
    span.set_attribute("messaging.destination.name", queue.to_owned());
    span.set_attribute("messaging.consumer.group.name", consumer_group.to_owned());
    if count > 1 {
        span.set_attribute("messaging.batch.message_count", count as i64);
    }
    let propagator = TraceContextPropagator::new();
    for headers in deliveries.flatten() {
        let context = propagator.extract(&Headers(headers));
        let sender = context.span().span_context().clone();
        if !sender.is_valid() {
            continue;
        }
        if count == 1 {
            // A single message's processing is part of its sender's trace.
            let _ = span.set_parent(context);
        }
        span.add_link(sender);
    }
}

/// The current span's trace context as headers, to send with a message;
/// empty when spans do not go to OpenTelemetry.
pub(crate) fn current() -> BTreeMap<String, String> {
    let mut headers = BTreeMap::new();
    if on() {
        let context = Span::current().context();
        TraceContextPropagator::new().inject_context(&context, &mut Strings(&mut headers));
    }
    headers
}

/// A delivery's headers, as the propagator reads them.
struct Headers<'h>(&'h FieldTable);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match self.0.inner().get(key)? {
            AMQPValue::LongString(value) => std::str::from_utf8(value.as_bytes()).ok(),
            AMQPValue::ShortString(value) => Some(value.as_str()),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.0.inner().keys().map(|key| key.as_str()).collect()
    }
}

/// Headers of strings, as the propagator writes them.
struct Strings<'h>(&'h mut BTreeMap<String, String>);

impl Injector for Strings<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}
