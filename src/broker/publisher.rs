//! Publishing with publisher confirms and `mandatory`: a message counts as
//! published only when the broker confirmed it and did not return it.

use std::collections::VecDeque;
use std::time::Duration;

use backon::BackoffBuilder;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use tokio_util::sync::CancellationToken;
use tracing::warn;

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
    /// measures its end-to-end latency; and, when spans are traced, the
    /// current span's `traceparent`.
    pub fn json(exchange: &str, routing_key: &str, body: Vec<u8>) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut headers = FieldTable::default();
        headers.insert(
            "timestamp_in_ms".into(),
            AMQPValue::LongLongInt(i64::try_from(now.as_millis()).unwrap_or(i64::MAX)),
        );
        for (name, value) in crate::telemetry::trace::current() {
            headers.insert(name.into(), AMQPValue::LongString(value.into()));
        }
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

    /// The same message with its ordering key in the
    /// [`ORDERING_KEY_HEADER`](crate::handler::ORDERING_KEY_HEADER) header:
    /// what an ordered queue's consistent-hash exchange routes by, and what
    /// its worker checks against the key the handler reads from the body.
    pub fn with_ordering_key(mut self, key: &str) -> Self {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(
            crate::handler::ORDERING_KEY_HEADER.into(),
            AMQPValue::LongString(key.into()),
        );
        self.properties = self.properties.with_headers(headers);
        self
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

    /// Sends `messages` in their order, as [`send`](Self::send) does each,
    /// but hands them all to the connection before waiting for any to be
    /// written: they go out in a few large writes instead of one per
    /// message, which costs both ends a good deal less (the broker reads
    /// them a buffer at a time). One result per message, in order; a send
    /// fails only when the channel is gone.
    pub async fn send_all<'m>(
        &self,
        messages: impl IntoIterator<Item = &'m Outgoing>,
    ) -> Vec<lapin::Result<PublisherConfirm>> {
        let mut sends: Vec<_> = messages
            .into_iter()
            .map(|message| Box::pin(self.send(message)))
            .collect();
        // A send queues its frames (and takes its delivery tag) the first
        // time it is polled, then waits for them to be written: polling
        // each once, in order, before awaiting any keeps the messages in
        // order on the wire.
        let mut written: Vec<Option<lapin::Result<PublisherConfirm>>> =
            std::future::poll_fn(|cx| {
                std::task::Poll::Ready(
                    sends
                        .iter_mut()
                        .map(|send| match send.as_mut().poll(cx) {
                            std::task::Poll::Ready(result) => Some(result),
                            std::task::Poll::Pending => None,
                        })
                        .collect(),
                )
            })
            .await;
        for (slot, send) in written.iter_mut().zip(sends) {
            if slot.is_none() {
                *slot = Some(send.await);
            }
        }
        written.into_iter().flatten().collect()
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
    /// Messages sent again after a connection loss (their first confirm
    /// never came) or a nack.
    pub resent: usize,
    /// Nacks that were answered by sending the message again on a fresh
    /// channel (see [`Nacks`]).
    pub nacks_retried: usize,
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
    /// How long to keep trying to (re)connect, or to get nacked messages
    /// confirmed, before giving up.
    pub patience: Duration,
}

impl PublishOptions {
    /// Confirms outstanding at once, unless said otherwise.
    pub const DEFAULT_WINDOW: usize = 256;
}

/// Pacing for the messages a broker nacks.
///
/// A nack says the broker could not store the message. It can pass: when a
/// quorum queue's leader dies, a channel that published to it may see every
/// later message nacked while a fresh channel on the same connection is
/// confirmed. So nacked messages go again, on a fresh channel, after a wait
/// that grows; once `patience` passes without a confirm they count as
/// refused.
#[derive(Debug)]
pub struct Nacks {
    patience: Duration,
    waits: crate::backoff::Deadline,
}

impl Nacks {
    /// Gives up after `patience` without a confirm.
    pub fn new(patience: Duration) -> Self {
        Self {
            patience,
            waits: crate::backoff::until(patience).build(),
        }
    }

    /// After a channel had `count` messages nacked: waits, and says whether
    /// to send them again on a fresh channel (false once the patience is
    /// spent or `shutdown` fired). `progressed` says some message was
    /// confirmed since the last call, which restarts the patience.
    pub async fn again(
        &mut self,
        count: usize,
        progressed: bool,
        shutdown: &CancellationToken,
    ) -> bool {
        if progressed {
            self.waits = crate::backoff::until(self.patience).build();
        }
        let Some(wait) = self.waits.next().filter(|_| !shutdown.is_cancelled()) else {
            warn!(
                count,
                "RabbitMQ kept nacking messages for {:.0}s; giving up on them",
                self.patience.as_secs_f64()
            );
            return false;
        };
        warn!(
            count,
            "RabbitMQ nacked messages; sending them again on a fresh channel in {:.1}s",
            wait.as_secs_f64()
        );
        tokio::select! {
            () = tokio::time::sleep(wait) => true,
            () = shutdown.cancelled() => false,
        }
    }
}

/// Publishes every message, keeping up to `window` confirms outstanding.
///
/// When the connection drops, it reconnects and sends again every message
/// whose confirm did not arrive; a message may therefore arrive twice, which
/// the consumer's deduplication absorbs. What the broker nacks goes again
/// on a fresh channel, within the patience (see [`Nacks`]). Stops early
/// when `shutdown` fires, after the outstanding confirms arrive. Fails when
/// the broker refuses the messages outright (no such exchange, no
/// permission): sending them again would not help.
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
    let mut batch = Batch {
        messages,
        todo: (0..messages.len()).collect(),
        sent: vec![false; messages.len()],
        nacked: Vec::new(),
        refuse_nacks: false,
        report: PublishReport::default(),
        progress,
    };
    let mut reconnects = Reconnects::new(options.patience, "publishing");
    let mut nacks = Nacks::new(options.patience);
    loop {
        let settled = batch.settled();
        let connection =
            connect_with_retry(amqp, "idem publish", options.patience, shutdown).await?;
        let _watch = ConnectionWatch::start(&connection, "publishing");
        let lost = batch
            .publish_over(&connection, options.window, &mut nacks, shutdown)
            .await;
        close(&connection).await;
        match lost {
            Some(error) if !shutdown.is_cancelled() => {
                let progressed = batch.settled() > settled;
                let report = &batch.report;
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
                batch.report.reconnects += 1;
            }
            _ => {
                batch.report.unsent = batch.todo.len();
                return Ok(batch.report);
            }
        }
    }
}

/// The state of [`publish_all`] that survives a reconnect.
struct Batch<'a> {
    messages: &'a [Outgoing],
    /// Indices still to send, in order.
    todo: VecDeque<usize>,
    /// Which indices were sent at least once, to count resends.
    sent: Vec<bool>,
    /// Indices nacked on the current channel, to send again on a fresh one.
    nacked: Vec<usize>,
    /// Whether a nack is final: the patience for nacks is spent.
    refuse_nacks: bool,
    report: PublishReport,
    progress: &'a Progress,
}

impl Batch<'_> {
    /// Messages confirmed or refused for good.
    fn settled(&self) -> usize {
        self.report.confirmed + self.report.refused.len()
    }

    /// Publishes from `todo` over `connection`, on a fresh channel after
    /// each round of nacks, until `todo` is empty or the connection fails;
    /// what was not confirmed goes back into `todo`.
    async fn publish_over(
        &mut self,
        connection: &Connection,
        window: usize,
        nacks: &mut Nacks,
        shutdown: &CancellationToken,
    ) -> Option<lapin::Error> {
        loop {
            let confirmed = self.report.confirmed;
            let lost = match ConfirmChannel::open(connection).await {
                Ok(channel) => {
                    let lost = self.publish_on(&channel, window, shutdown).await;
                    if lost.is_none() {
                        close_channel(channel.channel()).await;
                    }
                    lost
                }
                Err(error) => Some(error),
            };
            let mut nacked = std::mem::take(&mut self.nacked);
            nacked.sort_unstable();
            let count = nacked.len();
            let again = lost.is_some()
                || count == 0
                || nacks
                    .again(count, self.report.confirmed > confirmed, shutdown)
                    .await;
            if again {
                // Before the rest, in their order.
                for index in nacked.into_iter().rev() {
                    self.todo.push_front(index);
                }
                if lost.is_none() {
                    self.report.nacks_retried += count;
                }
            } else {
                self.progress.inc(count as u64);
                self.report
                    .refused
                    .extend(nacked.into_iter().map(|index| (index, Refusal::Nacked)));
                self.refuse_nacks = true;
            }
            if lost.is_some() || count == 0 || self.todo.is_empty() || shutdown.is_cancelled() {
                return lost;
            }
        }
    }

    /// Publishes from `todo` on one channel until it is empty, the channel
    /// fails, or the broker nacks a message (then it drains what is in
    /// flight); what was not confirmed goes back into `todo`, what was
    /// nacked into `nacked`.
    async fn publish_on(
        &mut self,
        channel: &ConfirmChannel,
        window: usize,
        shutdown: &CancellationToken,
    ) -> Option<lapin::Error> {
        let mut in_flight = FuturesUnordered::new();
        let mut lost = None;
        loop {
            if lost.is_none() && self.nacked.is_empty() && !shutdown.is_cancelled() {
                // The window's room filled at once, in a few writes.
                let room = window.max(1).saturating_sub(in_flight.len());
                let next: Vec<usize> = (0..room).map_while(|_| self.todo.pop_front()).collect();
                let messages = self.messages;
                let sends = channel
                    .send_all(next.iter().map(|&index| &messages[index]))
                    .await;
                let mut unsent = Vec::new();
                for (index, send) in next.into_iter().zip(sends) {
                    match send {
                        Ok(confirm) => {
                            in_flight.push(async move { (index, settle(confirm).await) });
                            self.report.resent += usize::from(self.sent[index]);
                            self.sent[index] = true;
                        }
                        Err(error) => {
                            unsent.push(index);
                            lost = first_refusal(lost, error);
                        }
                    }
                }
                // Back at the front, in their order.
                for index in unsent.into_iter().rev() {
                    self.todo.push_front(index);
                }
            }
            let Some(first) = in_flight.next().await else {
                return lost;
            };
            // With whatever else the broker answered meanwhile, so that the
            // room they leave is filled at once too.
            let mut answered = vec![first];
            while let Some(Some(next)) = in_flight.next().now_or_never() {
                answered.push(next);
            }
            for (index, outcome) in answered {
                match outcome {
                    Ok(Ok(())) => {
                        self.report.confirmed += 1;
                        self.progress.inc(1);
                    }
                    Ok(Err(Refusal::Nacked)) if !self.refuse_nacks => self.nacked.push(index),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ordering_key_joins_the_headers_already_there() {
        let keyed =
            Outgoing::json("events", "order.status", b"{}".to_vec()).with_ordering_key("o-7");
        let headers = keyed.properties.headers().clone().unwrap_or_default();
        let headers = headers.inner();
        assert_eq!(
            headers.get(crate::handler::ORDERING_KEY_HEADER),
            Some(&AMQPValue::LongString("o-7".into()))
        );
        assert!(headers.contains_key("timestamp_in_ms"), "{headers:?}");
    }
}
