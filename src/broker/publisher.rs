//! Publishing with publisher confirms and `mandatory`: a message counts as
//! published only when the broker confirmed it and did not return it.

use std::collections::VecDeque;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use tokio_util::sync::CancellationToken;

use crate::progress::Progress;

use super::connection::{
    AmqpConfig, ConnectionWatch, Reconnects, SessionError, close, close_channel,
    connect_with_retry, first_refusal,
};

/// A message to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Exchange; `""` is the default exchange, which routes by queue name.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Body.
    pub body: Vec<u8>,
    /// Properties and headers.
    pub properties: BasicProperties,
}

impl Outgoing {
    /// A JSON body for `exchange` and `routing_key`, persistent so that it
    /// survives a broker restart, stamped with the time it is made: the
    /// `timestamp` property (seconds) and a `timestamp_in_ms` header (as
    /// RabbitMQ's message-timestamp plugin writes it), from which a worker
    /// measures its end-to-end latency.
    pub fn json(exchange: &str, routing_key: &str, body: Vec<u8>) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut headers = FieldTable::default();
        headers.insert(
            "timestamp_in_ms".into(),
            AMQPValue::LongLongInt(i64::try_from(now.as_millis()).unwrap_or(i64::MAX)),
        );
        Self {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            body,
            properties: BasicProperties::default()
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_app_id("idem".into())
                .with_timestamp(now.as_secs())
                .with_headers(headers),
        }
    }
}

/// The broker took the message but did not accept it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Negatively confirmed: the broker could not store it (a full queue
    /// with `reject-publish`, an internal error).
    #[error("nacked by the broker")]
    Nacked,
    /// Returned: no queue is bound for it (`mandatory`).
    #[error("returned by the broker: {code} {text}")]
    Returned {
        /// AMQP reply code, 312 for NO_ROUTE.
        code: u16,
        /// The broker's text.
        text: String,
    },
}

/// A channel in confirm mode.
#[derive(Debug, Clone)]
pub struct ConfirmChannel {
    channel: Channel,
}

impl ConfirmChannel {
    /// Opens a channel on `connection` and turns on publisher confirms.
    pub async fn open(connection: &Connection) -> lapin::Result<Self> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self { channel })
    }

    /// Sends `message` with `mandatory` set; the returned future resolves
    /// when the broker confirms it (see [`settle`]).
    pub async fn send(&self, message: &Outgoing) -> lapin::Result<PublisherConfirm> {
        self.channel
            .basic_publish(
                message.exchange.as_str().into(),
                message.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.body,
                message.properties.clone(),
            )
            .await
    }

    /// Sends `message` and waits for its confirm.
    pub async fn publish(&self, message: &Outgoing) -> lapin::Result<Result<(), Refusal>> {
        settle(self.send(message).await?).await
    }

    /// The underlying channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }
}

/// Waits for a confirm. `Err` means the channel or connection failed first:
/// the message may or may not have arrived, and should be sent again.
pub async fn settle(confirm: PublisherConfirm) -> lapin::Result<Result<(), Refusal>> {
    Ok(match confirm.await? {
        // A returned message is acked too: the ack alone proves nothing.
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
            Err(Refusal::Returned {
                code: returned.reply_code,
                text: returned.reply_text.to_string(),
            })
        }
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Nack(None) => Err(Refusal::Nacked),
        // confirm_select was sent when the channel opened.
        Confirmation::NotRequested => Err(Refusal::Nacked),
    })
}

/// What became of a batch of publishes.
#[derive(Debug, Default)]
pub struct PublishReport {
    /// Confirmed and routed.
    pub confirmed: usize,
    /// Index in the input and reason, for each refused message.
    pub refused: Vec<(usize, Refusal)>,
    /// Messages sent again after a connection loss (their first confirm never came).
    pub resent: usize,
    /// Connections lost and reopened on the way.
    pub reconnects: usize,
    /// Not sent because `shutdown` fired first.
    pub unsent: usize,
}

impl PublishReport {
    /// True when every message was confirmed.
    pub fn all_confirmed(&self) -> bool {
        self.refused.is_empty() && self.unsent == 0
    }
}

/// How [`publish_all`] behaves.
#[derive(Debug, Clone)]
pub struct PublishOptions {
    /// Most messages awaiting their confirm at once.
    pub window: usize,
    /// How long to keep trying to (re)connect before giving up.
    pub patience: Duration,
}

impl PublishOptions {
    /// Confirms outstanding at once, unless said otherwise.
    pub const DEFAULT_WINDOW: usize = 256;
}

/// Publishes every message, keeping up to `window` confirms outstanding.
///
/// When the connection drops, it reconnects and sends again every message
/// whose confirm did not arrive; a message may therefore arrive twice, which
/// the consumer's deduplication absorbs. Stops early when `shutdown` fires,
/// after the outstanding confirms arrive. Fails when the broker refuses the
/// messages outright (no such exchange, no permission): sending them again
/// would not help.
pub async fn publish_all(
    amqp: &AmqpConfig,
    messages: &[Outgoing],
    options: &PublishOptions,
    shutdown: &CancellationToken,
) -> Result<PublishReport, SessionError> {
    publish_showing(amqp, messages, options, &Progress::hidden(), shutdown).await
}

/// [`publish_all`], counting each message the broker answered for in
/// `progress`.
pub async fn publish_showing(
    amqp: &AmqpConfig,
    messages: &[Outgoing],
    options: &PublishOptions,
    progress: &Progress,
    shutdown: &CancellationToken,
) -> Result<PublishReport, SessionError> {
    let mut report = PublishReport::default();
    let mut todo: VecDeque<usize> = (0..messages.len()).collect();
    let mut sent = vec![false; messages.len()];
    let mut reconnects = Reconnects::new(options.patience, "publishing");
    loop {
        let settled = report.confirmed + report.refused.len();
        let connection =
            connect_with_retry(amqp, "idem publish", options.patience, shutdown).await?;
        let _watch = ConnectionWatch::start(&connection, "publishing");
        let lost = match ConfirmChannel::open(&connection).await {
            Ok(channel) => {
                let mut batch = Batch {
                    messages,
                    todo: &mut todo,
                    sent: &mut sent,
                    report: &mut report,
                    progress,
                };
                let lost = batch.publish_on(&channel, options.window, shutdown).await;
                if lost.is_none() {
                    close_channel(channel.channel()).await;
                }
                lost
            }
            Err(error) => Some(error),
        };
        close(&connection).await;
        match lost {
            Some(error) if !shutdown.is_cancelled() => {
                let progressed = report.confirmed + report.refused.len() > settled;
                reconnects
                    .after(&error, progressed, shutdown)
                    .await
                    .map_err(|error| match error {
                        SessionError::Refused(reason) => SessionError::Refused(format!(
                            "{reason} ({} of {} messages were confirmed before)",
                            report.confirmed,
                            messages.len()
                        )),
                        other => other,
                    })?;
                report.reconnects += 1;
            }
            _ => {
                report.unsent = todo.len();
                return Ok(report);
            }
        }
    }
}

/// The state of [`publish_all`] that survives a reconnect.
struct Batch<'a> {
    messages: &'a [Outgoing],
    /// Indices still to send, in order.
    todo: &'a mut VecDeque<usize>,
    /// Which indices were sent at least once, to count resends.
    sent: &'a mut [bool],
    report: &'a mut PublishReport,
    progress: &'a Progress,
}

impl Batch<'_> {
    /// Publishes from `todo` on one channel until it is empty or the channel
    /// fails; what was not confirmed goes back into `todo`.
    async fn publish_on(
        &mut self,
        channel: &ConfirmChannel,
        window: usize,
        shutdown: &CancellationToken,
    ) -> Option<lapin::Error> {
        let mut in_flight = FuturesUnordered::new();
        let mut lost = None;
        loop {
            while lost.is_none() && in_flight.len() < window.max(1) && !shutdown.is_cancelled() {
                let Some(index) = self.todo.pop_front() else {
                    break;
                };
                match channel.send(&self.messages[index]).await {
                    Ok(confirm) => {
                        in_flight.push(async move { (index, settle(confirm).await) });
                        self.report.resent += usize::from(self.sent[index]);
                        self.sent[index] = true;
                    }
                    Err(error) => {
                        self.todo.push_front(index);
                        lost = first_refusal(lost, error);
                    }
                }
            }
            let Some((index, outcome)) = in_flight.next().await else {
                return lost;
            };
            match outcome {
                Ok(Ok(())) => {
                    self.report.confirmed += 1;
                    self.progress.inc(1);
                }
                Ok(Err(refusal)) => {
                    self.report.refused.push((index, refusal));
                    self.progress.inc(1);
                }
                Err(error) => {
                    self.todo.push_back(index);
                    lost = first_refusal(lost, error);
                }
            }
        }
    }
}
