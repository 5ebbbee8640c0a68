//! `idem requeue`: replay dead-lettered messages to the queue each died in.
//!
//! A dead-letter copy is acked only after its replay is confirmed, so an
//! interruption at any moment loses nothing: at worst a message is both
//! replayed and still in the dead-letter queue, and the consumer's
//! deduplication absorbs the second copy.

use std::fmt;
use std::time::Duration;

use anyhow::Context;
use lapin::Channel;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::types::DeliveryTag;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::broker::death::{Death, replay_headers, replays};
use crate::broker::{
    AmqpConfig, ConfirmChannel, Outgoing, Reconnects, close, close_channel, connect_with_retry,
    settle,
};
use crate::handler::Handler;
use crate::store::{DatabaseConfig, LedgerEntry, Store, StoreError};

/// What to replay.
#[derive(Debug, Clone)]
pub struct RequeueConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The database holding the failure ledger.
    pub database: DatabaseConfig,
    /// Whose failure ledger: the consumer group of the work queue.
    pub consumer_group: String,
    /// The dead-letter queue to empty.
    pub dead_letter_queue: String,
    /// Replay at most this many messages.
    pub limit: Option<usize>,
    /// List what would be replayed; move nothing.
    pub dry_run: bool,
    /// How long to keep trying to (re)connect.
    pub patience: Duration,
}

/// One dead-lettered message, as an operator needs to see it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The event id, or why the body has none.
    pub event_id: String,
    /// Its latest death, if the broker recorded one.
    pub death: Option<Death>,
    /// How many times it was replayed before.
    pub replays: i64,
    /// What the failure ledger knows of it (dry runs only).
    pub failures: Option<LedgerEntry>,
}

/// What `idem requeue` did.
#[derive(Debug, Default)]
pub struct Report {
    /// The queue.
    pub queue: String,
    /// True for `--dry-run`: `listed` is filled, nothing moved.
    pub dry_run: bool,
    /// Messages seen in a dry run.
    pub listed: Vec<Entry>,
    /// Messages replayed and removed from the dead-letter queue.
    pub replayed: Vec<Entry>,
    /// Messages that could not be replayed, and why; they stay.
    pub failed: Vec<(Entry, String)>,
    /// Why the failure ledger could not be read, if it could not.
    pub ledger_unavailable: Option<String>,
    /// Connections lost and reopened on the way.
    pub reconnects: usize,
}

impl Report {
    /// True when everything that was attempted was replayed.
    pub fn succeeded(&self) -> bool {
        self.failed.is_empty()
    }
}

/// Replays (or, in a dry run, lists) the messages that are in the
/// dead-letter queue when it starts, up to the limit. `handler` reads each
/// body's event id: whose failures to forget, whose to show.
pub async fn run<H: Handler>(
    config: &RequeueConfig,
    handler: &H,
    shutdown: &CancellationToken,
) -> anyhow::Result<Report> {
    let mut report = Report {
        queue: config.dead_letter_queue.clone(),
        dry_run: config.dry_run,
        ..Report::default()
    };
    let store = Store::new(config.database.pool()?, config.consumer_group.clone());
    // What was taken and not acked goes back to the dead-letter queue.
    let mut reconnects = Reconnects::new(config.patience, "replaying dead letters");
    loop {
        let done = report.replayed.len() + report.failed.len() + report.listed.len();
        let connection =
            connect_with_retry(&config.amqp, "idem requeue", config.patience, shutdown).await?;
        let pass = Pass {
            config,
            handler,
            store: &store,
            remaining: None,
            report: &mut report,
            held: Vec::new(),
        };
        let result = pass.run(&connection, shutdown).await;
        close(&connection).await;
        match result {
            Ok(()) => {
                if config.dry_run {
                    look_up_failures(&store, &mut report).await;
                }
                return Ok(report);
            }
            Err(PassError::Ledger(error)) => {
                return Err(anyhow::Error::new(error).context(
                    "cannot reset the failure ledger before a replay (what was not replayed \
                     is still in the dead-letter queue)",
                ));
            }
            Err(PassError::Broker(error)) if shutdown.is_cancelled() => {
                warn!(%error, "interrupted");
                return Ok(report);
            }
            Err(PassError::Broker(error)) => {
                let progressed =
                    report.replayed.len() + report.failed.len() + report.listed.len() > done;
                reconnects
                    .after(&error, progressed, shutdown)
                    .await
                    .context(
                        "cannot replay from the dead-letter queue (what was not replayed is \
                         still there)",
                    )?;
                report.reconnects += 1;
            }
        }
    }
}

/// Attaches to each listed message what the failure ledger knows of it.
async fn look_up_failures(store: &Store, report: &mut Report) {
    for entry in &mut report.listed {
        match store.ledger_entry(&entry.event_id).await {
            Ok(failures) => entry.failures = failures,
            Err(error) => {
                report.ledger_unavailable = Some(error.to_string());
                return;
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum PassError {
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    #[error(transparent)]
    Ledger(#[from] StoreError),
}

/// One connection's worth of work.
struct Pass<'a, H> {
    config: &'a RequeueConfig,
    handler: &'a H,
    store: &'a Store,
    /// How many more messages may be taken: at most what was in the queue
    /// when the pass started (those dead-lettered while it runs, a replay
    /// that fails again say, are left for the next run), and the limit.
    /// `None` until either is known.
    remaining: Option<usize>,
    report: &'a mut Report,
    /// Tags of messages taken but left in the queue (failed, or listed).
    held: Vec<DeliveryTag>,
}

/// Most messages taken from the dead-letter queue before their replays are
/// sent: one ledger statement and one wait for confirms per chunk, instead
/// of one of each per message.
const CHUNK: usize = 128;

/// A dead letter on its way back to the queue it died in.
struct Replay {
    entry: Entry,
    tag: DeliveryTag,
    message: Outgoing,
    /// Its event id if the body is a valid event: whose ledger to reset.
    valid_event_id: Option<String>,
}

impl<H: Handler> Pass<'_, H> {
    async fn run(
        mut self,
        connection: &lapin::Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
        let getter = connection.create_channel().await?;
        let publisher = ConfirmChannel::open(connection).await?;
        // Each pass counts the queue again: what an earlier pass could not
        // replay, or replayed without its ack reaching the broker, is back.
        self.remaining = self
            .config
            .limit
            .map(|limit| limit.saturating_sub(self.report.replayed.len()));
        self.report.failed.clear();
        self.report.listed.clear();
        let mut drained = false;
        while !drained && self.remaining != Some(0) && !shutdown.is_cancelled() {
            let mut chunk = Vec::new();
            while chunk.len() < CHUNK && self.remaining != Some(0) {
                let Some(message) = getter
                    .basic_get(
                        self.config.dead_letter_queue.as_str().into(),
                        BasicGetOptions { no_ack: false },
                    )
                    .await?
                else {
                    drained = true;
                    break;
                };
                let in_queue = message.message_count as usize + 1;
                let remaining = self.remaining.get_or_insert(in_queue);
                *remaining = (*remaining).min(in_queue) - 1;
                if let Some(replay) = self.sort(message.delivery) {
                    chunk.push(replay);
                }
            }
            self.replay(&getter, &publisher, chunk).await?;
        }
        if let Some(&last) = self.held.iter().max() {
            // Give back, in their places, what was listed or could not be replayed.
            getter
                .basic_nack(
                    last,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await?;
        }
        close_channel(&getter).await;
        close_channel(publisher.channel()).await;
        Ok(())
    }

    /// What to do with a dead letter: the replay to send, or nothing when
    /// it is only listed (a dry run) or cannot be replayed (it is held).
    fn sort(&mut self, delivery: Delivery) -> Option<Replay> {
        let valid_event_id = event_id(self.handler, &delivery.data);
        let entry = Entry::of(
            &delivery,
            valid_event_id.clone().unwrap_or_else(|described| described),
        );
        let tag = delivery.delivery_tag;
        if self.config.dry_run {
            self.report.listed.push(entry);
            self.held.push(tag);
            return None;
        }
        let Some(death) = &entry.death else {
            self.report.failed.push((
                entry,
                "no x-death header: cannot tell which queue it died in".into(),
            ));
            self.held.push(tag);
            return None;
        };
        let properties = delivery
            .properties
            .clone()
            .with_headers(replay_headers(delivery.properties.headers().as_ref()));
        let message = Outgoing {
            // The default exchange routes by queue name: the replay goes to
            // the queue it died in, not to every queue bound for the event.
            exchange: String::new(),
            routing_key: death.queue.clone(),
            body: delivery.data,
            properties,
        };
        Some(Replay {
            entry,
            tag,
            message,
            valid_event_id: valid_event_id.ok(),
        })
    }

    /// Resets the failure ledger of the chunk's events, sends their replays,
    /// and acks each dead-letter copy whose replay the broker confirmed.
    async fn replay(
        &mut self,
        getter: &Channel,
        publisher: &ConfirmChannel,
        chunk: Vec<Replay>,
    ) -> Result<(), PassError> {
        // A replay starts a fresh budget of attempts: the reset goes first.
        let event_ids: Vec<&str> = chunk
            .iter()
            .filter_map(|replay| replay.valid_event_id.as_deref())
            .collect();
        self.store.reset_ledger(&event_ids).await?;
        let mut sent = Vec::with_capacity(chunk.len());
        for replay in chunk {
            let confirm = publisher.send(&replay.message).await?;
            sent.push((replay, confirm));
        }
        for (replay, confirm) in sent {
            match settle(confirm).await? {
                Ok(()) => {
                    getter
                        .basic_ack(replay.tag, BasicAckOptions::default())
                        .await?;
                    self.report.replayed.push(replay.entry);
                }
                Err(refusal) => {
                    let why = format!("replay to queue '{}' {refusal}", replay.message.routing_key);
                    self.report.failed.push((replay.entry, why));
                    self.held.push(replay.tag);
                }
            }
        }
        Ok(())
    }
}

impl Entry {
    fn of(delivery: &Delivery, event_id: String) -> Self {
        let headers = delivery.properties.headers().as_ref();
        Self {
            event_id,
            death: Death::latest(headers),
            replays: replays(headers),
            failures: None,
        }
    }
}

/// Most characters of an invalid body shown in its place.
const BODY_SHOWN: usize = 80;

/// The event id of a valid body; for an invalid one, what is wrong with it
/// and how it starts.
fn event_id(handler: &impl Handler, body: &[u8]) -> Result<String, String> {
    handler
        .decode(body)
        .map(|event| handler.event_id(&event).to_owned())
        .map_err(|invalid| {
            let text = String::from_utf8_lossy(body);
            let mut start: String = text.chars().take(BODY_SHOWN).collect();
            if text.chars().nth(BODY_SHOWN).is_some() {
                start.push('…');
            }
            format!("(invalid: {invalid}) {start:?}")
        })
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.event_id)?;
        match &self.death {
            Some(death) => {
                write!(
                    f,
                    "  queue={} reason={} count={}",
                    death.queue, death.reason, death.count
                )?;
                if let Some(time) = death.time {
                    write!(f, " at={}", rfc3339(time))?;
                }
            }
            None => write!(f, "  (no x-death header)")?,
        }
        if self.replays > 0 {
            write!(f, " replays={}", self.replays)?;
        }
        if let Some(failures) = &self.failures {
            write!(
                f,
                "\n    failed {} time(s), last error: {}",
                failures.failures, failures.last_error
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dry_run {
            write!(
                f,
                "{} dead-lettered message(s) in {} (dry run: nothing moved)",
                self.listed.len(),
                self.queue
            )?;
            for entry in &self.listed {
                write!(f, "\n  {entry}")?;
            }
            if let Some(error) = &self.ledger_unavailable {
                write!(f, "\n  (the failure ledger could not be read: {error})")?;
            }
            return Ok(());
        }
        write!(
            f,
            "replayed {} message(s) from {}",
            self.replayed.len(),
            self.queue
        )?;
        if !self.failed.is_empty() {
            write!(
                f,
                "; {} could not be replayed and stay there",
                self.failed.len()
            )?;
            for (entry, why) in &self.failed {
                write!(f, "\n  {entry}: {why}")?;
            }
        }
        Ok(())
    }
}

/// `1700000000` → `2023-11-14T22:13:20Z`.
fn rfc3339(seconds: u64) -> String {
    let days = (seconds / 86_400) as i64;
    let rest = seconds % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_print_as_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn an_invalid_body_is_shown_with_why_and_how_it_starts() {
        let handler = crate::points::Points;
        assert_eq!(
            event_id(&handler, br#"{"eventId":"e-1","orderId":"o","points":2}"#),
            Ok("e-1".to_owned())
        );
        assert_eq!(
            event_id(&handler, br#"{"eventId":"e-2","orderId":"o","points":-1}"#),
            Err(r#"(invalid: field `points` must be a positive integer that fits 64 bits, got -1) "{\"eventId\":\"e-2\",\"orderId\":\"o\",\"points\":-1}""#.to_owned())
        );
        let long = event_id(&handler, "x".repeat(100).as_bytes());
        assert!(
            long.is_err_and(|described| described.ends_with(&format!("{}…\"", "x".repeat(79))))
        );
    }
}
