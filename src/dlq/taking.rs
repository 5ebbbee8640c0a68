//! Taking the letters a pass looks at: a consumer without a prefetch
//! limit, waiting for what a lost connection held, and the pace of a
//! replay.

use std::time::Duration;

use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions};
use lapin::types::FieldTable;
use lapin::{Channel, PublisherConfirm};
use tokio::time::Instant;
use tracing::{info, warn};

use super::Action;
use crate::broker::{ConfirmChannel, Outgoing, queue_counts, ready_messages};

/// How long a pass waits for a letter before it asks whether the queue
/// still holds one for it.
pub(super) const QUIET: Duration = Duration::from_secs(1);

/// Takes the letters a dead-letter queue holds when a pass starts, through
/// a consumer without a prefetch limit: the broker sends them as fast as it
/// reads them, where a `basic.get` costs a round trip per letter (and on a
/// quorum queue an entry in its log). Every letter taken stays unacked, so
/// in the queue, until the pass acks it or gives it back; what the consumer
/// received beyond the count goes back when the channel closes.
pub(super) struct Taking {
    pub(super) consumer: Option<lapin::Consumer>,
    pub(super) queue: String,
    /// Letters still to take of those in the queue at the start.
    pub(super) left: usize,
}

impl Taking {
    /// Counts the queue (a passive declare) and, when it holds letters,
    /// starts consuming it on `channel`, with `consuming` set to the
    /// consumers it had before.
    pub(super) async fn start(
        channel: &Channel,
        queue: &str,
        consuming: &mut Option<u32>,
    ) -> lapin::Result<Self> {
        let (ready, consumers) = queue_counts(channel, queue).await?;
        let left = ready as usize;
        let consumer = if left == 0 {
            None
        } else {
            *consuming = Some(consumers);
            Some(
                channel
                    .basic_consume(
                        queue.into(),
                        "idem-dlq".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await?,
            )
        };
        Ok(Self {
            consumer,
            queue: queue.to_owned(),
            left,
        })
    }

    /// Up to `size` letters: it waits for the first, then takes what has
    /// arrived. Empty once every letter counted at the start is taken, or
    /// when none comes and the queue has none ready (another client took
    /// some meanwhile).
    pub(super) async fn next_chunk(
        &mut self,
        channel: &Channel,
        size: usize,
    ) -> lapin::Result<Vec<Delivery>> {
        let mut chunk = Vec::new();
        let Some(consumer) = &mut self.consumer else {
            return Ok(chunk);
        };
        while chunk.len() < size && self.left > 0 {
            let next = if chunk.is_empty() {
                match tokio::time::timeout(QUIET, consumer.next()).await {
                    Ok(next) => next,
                    Err(_) if ready_messages(channel, &self.queue).await? == 0 => {
                        self.left = 0;
                        break;
                    }
                    Err(_) => continue,
                }
            } else {
                match consumer.next().now_or_never() {
                    Some(next) => next,
                    None => break,
                }
            };
            let Some(delivery) = next else {
                return Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
                    lapin::ChannelState::Closed,
                    "the dead-letter consumer ended",
                )));
            };
            chunk.push(delivery?);
            self.left -= 1;
        }
        Ok(chunk)
    }

    /// Cancels the consumer; what it received and the pass did not take
    /// stays unacked until the pass gives it back or closes the channel.
    pub(super) async fn stop(self, channel: &Channel) -> lapin::Result<()> {
        if let Some(consumer) = self.consumer {
            channel
                .basic_cancel(consumer.tag(), BasicCancelOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// Waits, `patience` at most, until `queue` has no more than `others`
/// consumers: the broker has noticed that a lost connection's consumer is
/// gone, and given back every letter it held. (It notices when the socket
/// closes, or after a missed heartbeat when the network went.) A pass that
/// counted the queue before would end without them.
pub(super) async fn await_released(
    channel: &Channel,
    queue: &str,
    others: u32,
    patience: Duration,
) -> lapin::Result<()> {
    let deadline = Instant::now() + patience;
    let mut told = false;
    while queue_counts(channel, queue).await?.1 > others {
        if Instant::now() >= deadline {
            warn!(
                "RabbitMQ still holds the dead letters the lost connection had taken; \
                 they are back in {queue} once it notices the loss, for another run"
            );
            return Ok(());
        }
        if !told {
            info!(
                "waiting for RabbitMQ to give back the dead letters the lost connection had taken"
            );
            told = true;
        }
        tokio::time::sleep(RELEASE_POLL).await;
    }
    Ok(())
}

/// How often a pass looks whether the broker gave back a lost connection's
/// letters.
pub(super) const RELEASE_POLL: Duration = Duration::from_millis(50);

/// Paces replays to a rate.
pub(super) struct Pacer {
    pub(super) interval: Duration,
    pub(super) next: Instant,
}

impl Action {
    pub(super) fn pacer(&self) -> Option<Pacer> {
        match self {
            Action::Replay {
                rate: Some(rate), ..
            } if *rate > 0.0 => Some(Pacer {
                interval: Duration::from_secs_f64(1.0 / rate),
                next: Instant::now(),
            }),
            _ => None,
        }
    }
}

impl Pacer {
    pub(super) async fn wait(&mut self) {
        tokio::time::sleep_until(self.next).await;
        // Late (the broker was slow), it does not make up with a burst.
        self.next = self.next.max(Instant::now()) + self.interval;
    }
}

/// Sends each item's message on `publisher`, all at once, each with its
/// confirm still to come; the first send that fails (the channel is gone)
/// fails them all.
pub(super) async fn send_all<T>(
    publisher: &ConfirmChannel,
    items: Vec<(T, Outgoing)>,
) -> Result<Vec<(T, Outgoing, PublisherConfirm)>, lapin::Error> {
    let confirms = publisher
        .send_all(items.iter().map(|(_, message)| message))
        .await;
    items
        .into_iter()
        .zip(confirms)
        .map(|((item, message), confirm)| Ok((item, message, confirm?)))
        .collect()
}
