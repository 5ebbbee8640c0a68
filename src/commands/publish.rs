//! `publish`: a service's events to its exchange, with publisher confirms
//! and `mandatory`, read from a file of JSON lines (or standard input) as
//! `check --events` reads them, or made by the service itself. Each body
//! is decoded by the handler first, as the worker will: a file with a body
//! the worker would dead-letter is refused whole, unless invalid bodies
//! are asked for; an event with an ordering key carries it in its header.

use std::collections::HashSet;
use std::fmt;
use std::io::BufRead;
use std::path::Path;

use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, info_span};

use crate::broker::{
    AmqpConfig, Outgoing, PublishOptions, PublishReport, SessionError, publish_showing,
};
use crate::handler::Handler;
use crate::progress::Progress;
use crate::telemetry::trace;
use crate::worker::WorkerConfig;

/// Where to publish and how.
#[derive(Debug, Clone)]
pub struct PublishConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// Window of outstanding confirms, and reconnect patience.
    pub options: PublishOptions,
}

/// What `publish` did.
#[derive(Debug)]
pub struct Summary {
    /// Messages published.
    pub messages: usize,
    /// Distinct events among them (a producer's retry repeats one).
    pub events: usize,
    /// Bodies the handler does not decode (sent when asked to).
    pub invalid: usize,
    /// The broker's answers.
    pub report: PublishReport,
}

/// Why the events could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ReadError(String);

/// The bodies of `path` (`-`: standard input), one a line, blank lines
/// skipped; a line of a `dlq discard --to` file gives its letter's body.
/// Unless `allow_invalid`, a body `handler` does not decode fails the
/// whole file, naming its line.
pub fn read<H: Handler>(
    path: &Path,
    handler: &H,
    allow_invalid: bool,
) -> Result<Vec<Vec<u8>>, ReadError> {
    let name = path.display().to_string();
    let reader: Box<dyn BufRead> = if name == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(path)
            .map_err(|error| ReadError(format!("cannot open {name}: {error}")))?;
        Box::new(std::io::BufReader::new(file))
    };
    read_lines(reader, &name, handler, allow_invalid)
}

fn read_lines<H: Handler>(
    reader: impl BufRead,
    name: &str,
    handler: &H,
    allow_invalid: bool,
) -> Result<Vec<Vec<u8>>, ReadError> {
    let mut bodies = Vec::new();
    for (index, line) in reader.split(b'\n').enumerate() {
        let line = line.map_err(|error| ReadError(format!("cannot read {name}: {error}")))?;
        let line = line.strip_suffix(b"\r").unwrap_or(&line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let at = |reason: &dyn fmt::Display| ReadError(format!("{name}:{}: {reason}", index + 1));
        let body = crate::check::discarded_body(line)
            .map_err(|reason| at(&reason))?
            .unwrap_or_else(|| line.to_vec());
        let decoded = crate::worker::decode(handler, &body, WorkerConfig::DEFAULT_MAX_BODY_BYTES);
        if let (false, Err(invalid)) = (allow_invalid, decoded) {
            return Err(at(&format_args!(
                "{invalid} (nothing was published; --allow-invalid sends such lines as they are)"
            )));
        }
        bodies.push(body);
    }
    Ok(bodies)
}

/// Publishes `bodies`, each with the ordering key `handler` names for its
/// event, if any, and reports.
pub async fn run<H: Handler>(
    config: &PublishConfig,
    handler: &H,
    bodies: Vec<Vec<u8>>,
    shutdown: &CancellationToken,
) -> Result<Summary, SessionError> {
    let (mut events, mut invalid) = (HashSet::new(), 0);
    let keys: Vec<Option<String>> = bodies
        .iter()
        .map(|body| {
            match crate::worker::decode(handler, body, WorkerConfig::DEFAULT_MAX_BODY_BYTES) {
                Ok(event) => {
                    events.insert(handler.event_id(&event).to_owned());
                    handler.ordering_key(&event).map(str::to_owned)
                }
                Err(_) => {
                    invalid += 1;
                    None
                }
            }
        })
        .collect();
    // Traced, every message carries the context of this one span.
    let span = if trace::on() {
        info_span!(
            "publish",
            otel.name = format!("send {}", config.exchange),
            otel.kind = "producer",
            messages = bodies.len()
        )
    } else {
        Span::none()
    };
    let messages: Vec<Outgoing> = span.in_scope(|| {
        bodies
            .into_iter()
            .zip(keys)
            .map(|(body, key)| {
                let message = Outgoing::json(&config.exchange, &config.routing_key, body);
                match key {
                    Some(key) => message.with_ordering_key(&key),
                    None => message,
                }
            })
            .collect()
    });
    let progress = Progress::new("publishing", messages.len() as u64);
    let report = publish_showing(
        &config.amqp,
        &messages,
        &config.options,
        &progress,
        shutdown,
    )
    .instrument(span)
    .await;
    progress.finish(&report);
    Ok(Summary {
        messages: messages.len(),
        events: events.len(),
        invalid,
        report: report?,
    })
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let report = &self.report;
        let plural =
            |n: usize, one: &'static str, many: &'static str| if n == 1 { one } else { many };
        write!(
            f,
            "published {} {} ({} distinct {}",
            self.messages,
            plural(self.messages, "message", "messages"),
            self.events,
            plural(self.events, "event", "events"),
        )?;
        if self.invalid > 0 {
            write!(f, ", {} invalid", self.invalid)?;
        }
        write!(f, "): {} confirmed", report.confirmed)?;
        if !report.refused.is_empty() {
            write!(f, ", {} refused", report.refused.len())?;
        }
        if report.unsent > 0 {
            write!(f, ", {} not sent (interrupted)", report.unsent)?;
        }
        if report.reconnects > 0 {
            write!(
                f,
                " ({} reconnects, {} sent again)",
                report.reconnects, report.resent
            )?;
        }
        if report.nacks_retried > 0 {
            write!(
                f,
                " ({} nacked by the broker and sent again)",
                report.nacks_retried
            )?;
        }
        for (index, refusal) in report.refused.iter().take(10) {
            write!(f, "\n  message {}: {refusal}", index + 1)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::{HandlerError, Invalid, Outbox, Transaction};

    /// Events `{"eventId": …}`.
    struct Ids;

    impl Handler for Ids {
        type Event = String;
        const NAME: &'static str = "ids";

        fn decode(&self, body: &[u8]) -> Result<String, Invalid> {
            let value: serde_json::Value = serde_json::from_slice(body)?;
            match value.get("eventId").and_then(serde_json::Value::as_str) {
                Some(id) => Ok(id.to_owned()),
                None => Err(Invalid::new("no eventId")),
            }
        }

        fn event_id<'e>(&self, event: &'e String) -> &'e str {
            event
        }

        async fn apply(
            &self,
            _: &Transaction<'_>,
            _: &[&String],
            _: &mut Outbox<'_>,
        ) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    #[test]
    fn blank_lines_are_skipped_bodies_kept_verbatim_and_letters_give_theirs()
    -> Result<(), ReadError> {
        let input = concat!(
            "{\"eventId\":\"a\"}\r\n",
            "\n  \n",
            "{\"discarded_at\":\"x\",\"dead_letter_queue\":\"q.dlq\",\"body\":\"{\\\"eventId\\\":\\\"b\\\"}\"}\n",
            "{\"eventId\": \"c\"}",
        );
        let bodies = read_lines(input.as_bytes(), "input", &Ids, false)?;
        assert_eq!(
            bodies,
            [
                br#"{"eventId":"a"}"#.to_vec(),
                br#"{"eventId":"b"}"#.to_vec(),
                br#"{"eventId": "c"}"#.to_vec()
            ]
        );
        Ok(())
    }

    #[test]
    fn a_body_the_handler_refuses_fails_the_file_by_its_line_unless_allowed() {
        let input = b"{\"eventId\":\"a\"}\n\n{\"id\":\"b\"}\n";
        let error = read_lines(&input[..], "events.jsonl", &Ids, false)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            error,
            "events.jsonl:3: no eventId (nothing was published; --allow-invalid sends such lines as they are)"
        );
        let allowed = read_lines(&input[..], "events.jsonl", &Ids, true).map(|b| b.len());
        assert_eq!(allowed.ok(), Some(2));
    }

    #[test]
    fn the_summary_says_message_and_event_in_the_singular_for_one() {
        let summary = |messages, events| {
            let report = PublishReport {
                confirmed: messages,
                ..PublishReport::default()
            };
            Summary {
                messages,
                events,
                invalid: 0,
                report,
            }
            .to_string()
        };
        assert_eq!(
            summary(1, 1),
            "published 1 message (1 distinct event): 1 confirmed"
        );
        assert_eq!(
            summary(3, 2),
            "published 3 messages (2 distinct events): 3 confirmed"
        );
    }
}
