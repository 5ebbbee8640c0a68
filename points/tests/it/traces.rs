//! Traces across the broker: a batch's span follows the `traceparent` of
//! each delivery, and what its handler sends carries the context of the
//! transaction inside it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt;

use idem::telemetry::trace::TRACEPARENT;
use idem::worker::Mode;
use idem_points::points::{PaymentSucceeded, Points, PointsCredited};

use crate::outbox::credited_queue;
use crate::support::{
    RunningWorker, TestEnv, WorkerProcess, amqp_url, database_url, idem_command, load,
    publish_messages, wait_for, worker_exits_at_once_with,
};

/// A sender's context, as a producer of its own would write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Sender {
    trace: TraceId,
    span: SpanId,
}

impl Sender {
    fn random() -> Self {
        Self {
            trace: TraceId::from(fastrand::u128(1..)),
            span: SpanId::from(fastrand::u64(1..)),
        }
    }

    fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace, self.span)
    }

    /// The sender a `traceparent` names.
    fn parse(traceparent: &str) -> anyhow::Result<Self> {
        let parts: Vec<&str> = traceparent.split('-').collect();
        let [_, trace, span, _] = parts[..] else {
            anyhow::bail!("not a traceparent: {traceparent}");
        };
        Ok(Self {
            trace: TraceId::from_hex(trace)?,
            span: SpanId::from_hex(span)?,
        })
    }

    fn of(span: &SpanData) -> Self {
        Self {
            trace: span.span_context.trace_id(),
            span: span.span_context.span_id(),
        }
    }
}

/// An exporter in this process, which receives the spans of this thread
/// for as long as the guard lives. The tests that use it run on a
/// current-thread runtime, so that the worker's tasks run on this thread.
fn received_here() -> (InMemorySpanExporter, tracing::subscriber::DefaultGuard) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber =
        tracing_subscriber::registry().with(idem::telemetry::trace::layer(provider.tracer("test")));
    (exporter, tracing::subscriber::set_default(subscriber))
}

#[tokio::test]
async fn a_batch_span_follows_each_sender_and_what_it_sends_carries_it() -> anyhow::Result<()> {
    let (exporter, _subscriber) = received_here();
    for mode in Mode::ALL {
        let env = TestEnv::new().await?;
        let queue = credited_queue(&env).await?;
        let events = load(&env, 40, 0.0, 10);
        let senders: BTreeMap<String, Sender> = events
            .iter()
            .map(|event| (event.event_id.clone(), Sender::random()))
            .collect();
        let messages: Vec<_> = events
            .iter()
            .map(|event| {
                let mut message = env.topology.event(event.to_body());
                let mut headers = message.properties.headers().clone().unwrap_or_default();
                headers.insert(
                    TRACEPARENT.into(),
                    AMQPValue::LongString(senders[&event.event_id].traceparent().into()),
                );
                message.properties = message.properties.with_headers(headers);
                message
            })
            .collect();
        // Published before the worker starts: batch mode takes several at once.
        publish_messages(&env.amqp, &messages).await?;
        let handler = Points.announcing(env.topology.exchange.as_str());
        let worker = RunningWorker::start_with(env.worker_config(mode), handler);
        wait_for(
            "every credit announced",
            Duration::from_secs(60),
            || async { Ok(env.ready(&queue).await? as usize >= events.len()) },
        )
        .await?;
        worker.stop().await?;

        let name = format!("process {}", env.topology.queue);
        let spans = exporter.get_finished_spans()?;
        let processed: Vec<&SpanData> = spans.iter().filter(|span| span.name == name).collect();
        let mut linked = HashSet::new();
        for span in &processed {
            assert_eq!(span.span_kind, SpanKind::Consumer, "{mode:?}");
            let links: Vec<Sender> = span
                .links
                .links
                .iter()
                .map(|link| Sender {
                    trace: link.span_context.trace_id(),
                    span: link.span_context.span_id(),
                })
                .collect();
            if let [sender] = links[..] {
                // One message: its processing is part of its sender's trace.
                assert_eq!(span.span_context.trace_id(), sender.trace, "{mode:?}");
                assert_eq!(span.parent_span_id, sender.span, "{mode:?}");
            }
            for sender in links {
                assert!(linked.insert(sender), "{sender:?} linked twice ({mode:?})");
            }
            // The handler's statements, inside it.
            let transaction = spans
                .iter()
                .find(|child| {
                    child.name == "idem transaction"
                        && child.parent_span_id == span.span_context.span_id()
                })
                .map(|child| child.span_context.trace_id());
            assert_eq!(transaction, Some(span.span_context.trace_id()), "{mode:?}");
        }
        let sent: HashSet<Sender> = senders.values().copied().collect();
        assert_eq!(linked, sent, "{mode:?}");
        if mode == Mode::Batch {
            assert!(processed.len() < events.len(), "one span per batch");
        }

        // Every credit carries the context of the transaction that applied
        // its event, inside the span that links to that event's sender.
        let processes: HashMap<SpanId, &SpanData> = processed
            .iter()
            .map(|span| (span.span_context.span_id(), *span))
            .collect();
        let by_id: HashMap<Sender, &SpanData> = spans
            .iter()
            .filter(|span| span.name == "idem transaction")
            .filter_map(|span| Some((Sender::of(span), *processes.get(&span.parent_span_id)?)))
            .collect();
        let credits = env.peek(&queue).await?;
        assert_eq!(credits.len(), events.len(), "{mode:?}");
        for credit in credits {
            let body: PointsCredited = serde_json::from_slice(&credit.body)?;
            let traceparent = text(credit.properties.headers().as_ref(), TRACEPARENT)
                .unwrap_or_else(|| panic!("no traceparent on {body:?} ({mode:?})"));
            let span = by_id.get(&Sender::parse(&traceparent)?).unwrap_or_else(|| {
                panic!("{traceparent} names no transaction of a process span ({mode:?})")
            });
            let sender = senders[&body.source_event_id];
            assert!(
                span.links.links.iter().any(|link| {
                    link.span_context.span_id() == sender.span
                        && link.span_context.trace_id() == sender.trace
                }),
                "{traceparent} does not follow {sender:?} ({mode:?})"
            );
        }
    }
    Ok(())
}

/// A message without a trace context starts a trace, which what its
/// handler sends carries on.
#[tokio::test]
async fn a_message_without_a_sender_starts_a_trace() -> anyhow::Result<()> {
    let (exporter, _subscriber) = received_here();
    let env = TestEnv::new().await?;
    let queue = credited_queue(&env).await?;
    let event = PaymentSucceeded {
        event_id: format!("{}-alone", env.name),
        order_id: "1".into(),
        points: 5,
    };
    let handler = Points.announcing(env.topology.exchange.as_str());
    let worker = RunningWorker::start_with(env.worker_config(Mode::PerMessage), handler);
    env.publish_events(std::slice::from_ref(&event)).await?;
    wait_for("the credit announced", Duration::from_secs(60), || async {
        Ok(env.ready(&queue).await? == 1)
    })
    .await?;
    worker.stop().await?;
    let name = format!("process {}", env.topology.queue);
    let spans = exporter.get_finished_spans()?;
    let [span] = spans
        .iter()
        .filter(|span| span.name == name)
        .collect::<Vec<_>>()[..]
    else {
        panic!("not one process span: {spans:?}");
    };
    assert!(span.links.links.is_empty());
    assert_eq!(span.parent_span_id, SpanId::INVALID);
    let transaction = spans
        .iter()
        .find(|child| child.parent_span_id == span.span_context.span_id())
        .map(Sender::of);
    let credits = env.peek(&queue).await?;
    let traceparent = text(credits[0].properties.headers().as_ref(), TRACEPARENT);
    assert_eq!(
        traceparent.map(|t| Sender::parse(&t)).transpose()?,
        transaction
    );
    assert_eq!(
        transaction.map(|t| t.trace),
        Some(span.span_context.trace_id())
    );
    assert_eq!(env.points("1").await?, 5);
    Ok(())
}

fn text(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into()),
        _ => None,
    }
}

/// The binary exports over OTLP/HTTP when the SDK's variable says where:
/// the collector here is a listener that takes one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_exports_its_spans_to_the_endpoint_the_sdk_variables_name() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let collector = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", collector.local_addr()?);
    let mut command = idem_command(&env, &amqp_url(), &database_url());
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("OTEL_SERVICE_NAME", &env.name);
    let worker = WorkerProcess::start({
        command.args(["worker", "--mode", Mode::PerMessage.as_flag()]);
        command
    })?;
    env.publish_events(&load(&env, 1, 0.0, 1)).await?;
    let (head, body) = tokio::time::timeout(Duration::from_secs(60), received(&collector))
        .await
        .map_err(|_| anyhow::anyhow!("no export within 60 s: {}", worker.log()))??;
    // What it exports later, up to its last spans as it stops, is answered
    // too.
    let answering = tokio::spawn(async move { while received(&collector).await.is_ok() {} });
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("post /v1/traces "), "{head}");
    assert!(
        head.contains("content-type: application/x-protobuf"),
        "{head}"
    );
    // Protobuf keeps strings as they are: the service's and the span's names.
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains(&env.name), "no service name in the export");
    assert!(
        body.contains(&format!("process {}", env.topology.queue)),
        "no process span in the export"
    );
    let log = worker.stop().await?;
    answering.abort();
    assert!(!log.contains("WARN"), "{log}");
    Ok(())
}

/// The head and body of the first request to `collector`, answered 200.
async fn received(collector: &tokio::net::TcpListener) -> anyhow::Result<(String, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut stream, _) = collector.accept().await?;
    let mut read = Vec::new();
    let mut buffer = [0u8; 8192];
    let end = loop {
        let n = stream.read(&mut buffer).await?;
        anyhow::ensure!(n > 0, "the exporter hung up");
        read.extend_from_slice(&buffer[..n]);
        if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
    };
    let head = String::from_utf8_lossy(&read[..end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = read[end + 4..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut buffer).await?;
        anyhow::ensure!(n > 0, "the exporter hung up mid-body");
        body.extend_from_slice(&buffer[..n]);
    }
    stream
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        .await?;
    Ok((head, body))
}

/// A protocol the exporter does not speak is a usage error, said in one
/// line, before anything starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_protocol_is_refused_in_one_line() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut command = idem_command(&env, &amqp_url(), &database_url());
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc");
    let line = worker_exits_at_once_with(command, 2).await?;
    assert!(line.contains("OTEL_EXPORTER_OTLP_PROTOCOL"), "{line}");
    assert!(line.contains("http/protobuf"), "{line}");
    Ok(())
}
