//! `idem publish`: send events to the exchange with confirms, from flags, a
//! file of JSON lines, or a generated load.

use std::fmt;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio_util::sync::CancellationToken;

use crate::generate::{self, LoadSpec};
use crate::points::PaymentSucceeded;
use idem::broker::{AmqpConfig, Outgoing, PublishOptions, PublishReport, publish_showing};
use idem::progress::Progress;
use idem::telemetry::trace;
use tracing::{Instrument, Span, info_span};

/// Where the events come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// One event.
    One(PaymentSucceeded),
    /// One body per line of a file, or of standard input for `-`; blank
    /// lines are skipped.
    Lines {
        /// The file, or `-`.
        path: PathBuf,
        /// Publish lines that are not valid events as they are (to exercise
        /// the dead-letter path) instead of refusing the whole file.
        allow_invalid: bool,
    },
    /// A generated load.
    Generated(LoadSpec),
}

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

/// What `idem publish` did.
#[derive(Debug)]
pub struct Summary {
    /// Messages read from the source.
    pub messages: usize,
    /// Distinct events among them (a producer's retry repeats one).
    pub events: usize,
    /// Bodies that are not events (sent with `--allow-invalid`).
    pub invalid: usize,
    /// The broker's answers.
    pub report: PublishReport,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let report = &self.report;
        let messages = if self.messages == 1 {
            "message"
        } else {
            "messages"
        };
        let events = if self.events == 1 { "event" } else { "events" };
        write!(
            f,
            "published {} {messages} ({} distinct {events}",
            self.messages, self.events
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

impl PublishConfig {
    /// Sensible options for a command-line publish.
    pub fn options(window: usize, patience: Duration) -> PublishOptions {
        PublishOptions { window, patience }
    }
}

/// Reads the source, publishes every message and reports. Fails before
/// publishing anything when the source cannot be read or holds an invalid
/// line (unless invalid lines are allowed).
pub async fn run(
    config: &PublishConfig,
    source: Source,
    shutdown: &CancellationToken,
) -> anyhow::Result<Summary> {
    let bodies = bodies(source)?;
    let parsed: Vec<_> = bodies
        .iter()
        .filter_map(|body| PaymentSucceeded::parse(body).ok().map(|e| e.event_id))
        .collect();
    let invalid = bodies.len() - parsed.len();
    let events = parsed
        .into_iter()
        .collect::<std::collections::HashSet<_>>()
        .len();
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
            .map(|body| Outgoing::json(&config.exchange, &config.routing_key, body))
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
        events,
        invalid,
        report: report?,
    })
}

fn bodies(source: Source) -> anyhow::Result<Vec<Vec<u8>>> {
    match source {
        Source::One(event) => Ok(vec![event.to_body()]),
        Source::Generated(spec) => Ok(generate::events(&spec)
            .iter()
            .map(PaymentSucceeded::to_body)
            .collect()),
        Source::Lines {
            path,
            allow_invalid,
        } => {
            let name = path.display().to_string();
            let reader: Box<dyn BufRead> = if name == "-" {
                Box::new(std::io::stdin().lock())
            } else {
                let file =
                    std::fs::File::open(&path).with_context(|| format!("cannot open {name}"))?;
                Box::new(std::io::BufReader::new(file))
            };
            read_lines(reader, &name, allow_invalid)
        }
    }
}

fn read_lines(
    reader: impl BufRead,
    name: &str,
    allow_invalid: bool,
) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut bodies = Vec::new();
    for (index, line) in reader.split(b'\n').enumerate() {
        let line = line.with_context(|| format!("cannot read {name}"))?;
        let line = line.strip_suffix(b"\r").unwrap_or(&line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if let (false, Err(invalid)) = (allow_invalid, PaymentSucceeded::parse(line)) {
            bail!(
                "{name}:{}: {invalid} (nothing was published; --allow-invalid sends such lines as they are)",
                index + 1
            );
        }
        bodies.push(line.to_vec());
    }
    Ok(bodies)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blank_lines_are_skipped_and_bodies_kept_verbatim() -> anyhow::Result<()> {
        let input = b"{\"eventId\":\"a\",\"orderId\":\"o\",\"points\":1}\r\n\n  \n{\"eventId\":\"b\",\"orderId\":\"o\",\"points\":2}";
        let bodies = read_lines(&input[..], "input", false)?;
        assert_eq!(bodies.len(), 2);
        assert_eq!(bodies[0], br#"{"eventId":"a","orderId":"o","points":1}"#);
        Ok(())
    }

    #[test]
    fn an_invalid_line_is_refused_with_its_number_unless_allowed() -> anyhow::Result<()> {
        let input = b"{\"eventId\":\"a\",\"orderId\":\"o\",\"points\":1}\nnot json\n";
        let error = read_lines(&input[..], "events.jsonl", false)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.starts_with("events.jsonl:2: body is not a payment event"),
            "{error}"
        );
        assert_eq!(read_lines(&input[..], "events.jsonl", true)?.len(), 2);
        Ok(())
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
