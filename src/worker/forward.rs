//! Messages the worker publishes again before it acks them: a failed one
//! to the wait queue of its delay, a dead one to the dead-letter exchange,
//! a due one from its wait queue back to the work queue.
//! Each copy goes with a publisher confirm and `mandatory`, and its
//! delivery is acked only once that copy is confirmed. A crash between the
//! two leaves both (a duplicate, which the consume record or the
//! dead-letter index absorbs), never neither.
//!
//! idem makes the dead-letter hop itself rather than leave it to the
//! broker's `reject`: a quorum queue's at-least-once dead-lettering on
//! RabbitMQ 3.10 can hold its letters for its 180 s confirm timeout, once
//! or twice, after a node is lost; a publish of idem's own is confirmed, or
//! refused, as soon as the queue has a leader again.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::Connection;
use lapin::message::Delivery;
use lapin::types::DeliveryTag;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::process::{DEAD_LETTER_REASON, Waiting};
use super::settle::{Disposition, Settlement};
use crate::broker::death::{dead_letter_properties, wait_headers};
use crate::broker::{ConfirmChannel, Nacks, Outgoing, Refusal, Topology, settle};

/// How long copies the broker keeps nacking are sent again (on a fresh
/// channel each time) before their deliveries are given back or rejected:
/// a queue whose leader was lost has a new one within seconds.
const NACK_PATIENCE: Duration = Duration::from_secs(30);

/// The session's confirm channel for copies, shared by its batches, and
/// replaced after a nack: on RabbitMQ 3.10 a channel that first publishes
/// to a quorum queue as its leader dies can be nacked for as long as it
/// lives, while a new channel on the same connection is not.
#[derive(Debug)]
pub(crate) struct Forwarder {
    connection: Arc<Connection>,
    channel: Mutex<ConfirmChannel>,
    /// Copies the broker nacked and that went again (the worker's metric).
    nacked: Counter,
}

impl Forwarder {
    /// Opens the first confirm channel on `connection`; copies nacked and
    /// sent again are counted in `nacked`.
    pub(crate) async fn open(connection: Arc<Connection>, nacked: Counter) -> lapin::Result<Self> {
        let channel = ConfirmChannel::open(&connection).await?;
        Ok(Self {
            connection,
            channel: Mutex::new(channel),
            nacked,
        })
    }

    /// The channel to send on now.
    pub(crate) async fn channel(&self) -> ConfirmChannel {
        self.channel.lock().await.clone()
    }

    /// A fresh channel in place of `nacked`, unless another batch replaced
    /// it already. The old one stays open: other batches may still wait
    /// for confirms on it, and closing it would fail them; it goes with the
    /// connection.
    async fn replace(&self, nacked: &ConfirmChannel) -> lapin::Result<ConfirmChannel> {
        let mut current = self.channel.lock().await;
        if current.channel().id() == nacked.channel().id() {
            *current = ConfirmChannel::open(&self.connection).await?;
        }
        Ok(current.clone())
    }
}

/// A delivery's copy to publish, and where it goes.
pub(crate) struct Copy {
    tag: DeliveryTag,
    message: Outgoing,
    to: Destination,
}

/// Where a copy goes, which says what becomes of its delivery when the
/// copy cannot be sent.
#[derive(Debug, Clone, Copy)]
enum Destination {
    /// A wait queue: the delivery is given back for an attempt now, as with
    /// a delay of zero (its failure was counted already).
    Wait,
    /// The dead-letter exchange: the delivery is rejected without requeue,
    /// and the broker makes the hop.
    DeadLetters,
    /// The work queue, from a wait queue: the delivery goes back to its
    /// wait queue, and the broker makes the hop once its TTL is spent.
    Work,
}

impl Destination {
    fn otherwise(self) -> (Disposition, &'static str) {
        match self {
            Self::Wait => (Disposition::Retry, "returning it for an attempt now"),
            Self::DeadLetters => (
                Disposition::DeadLetter,
                "rejecting it for the broker to dead-letter",
            ),
            Self::Work => (
                Disposition::Retry,
                "returning it to its wait queue for the broker to send on",
            ),
        }
    }
}

/// Publishes each copy and returns what becomes of its delivery: acked
/// once the copy is confirmed; otherwise given back at once (to wait, or
/// to its wait queue) or rejected without requeue (to die). Copies the
/// broker nacks go again on a fresh channel, for [`NACK_PATIENCE`] without
/// a confirm.
pub(crate) async fn send(forwarder: &Forwarder, mut copies: Vec<Copy>) -> Vec<Settlement> {
    let mut settlements = Vec::with_capacity(copies.len());
    let mut nacks = Nacks::new(NACK_PATIENCE);
    let mut channel = forwarder.channel().await;
    // The deadline of the nacks is the session's: a shutdown cuts it short.
    let never = CancellationToken::new();
    loop {
        let confirms = channel
            .send_all(copies.iter().map(|copy| &copy.message))
            .await;
        let sent: Vec<_> = copies.into_iter().zip(confirms).collect();
        let (mut nacked, mut progressed) = (Vec::new(), false);
        for (copy, confirm) in sent {
            let outcome = match confirm {
                Ok(confirm) => settle(confirm).await.map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            };
            match outcome {
                Ok(Err(Refusal::Nacked)) => nacked.push(copy),
                outcome => {
                    progressed |= matches!(outcome, Ok(Ok(())));
                    settlements.push(settlement(&copy, outcome));
                }
            }
        }
        if nacked.is_empty() {
            return settlements;
        }
        if !nacks.again(nacked.len(), progressed, &never).await {
            let refused = nacked
                .iter()
                .map(|copy| settlement(copy, Ok(Err(Refusal::Nacked))));
            settlements.extend(refused);
            return settlements;
        }
        forwarder.nacked.inc_by(nacked.len() as u64);
        match forwarder.replace(&channel).await {
            Ok(fresh) => channel = fresh,
            Err(error) => {
                let failed = nacked
                    .iter()
                    .map(|copy| settlement(copy, Err(error.to_string())));
                settlements.extend(failed);
                return settlements;
            }
        }
        copies = nacked;
    }
}

impl Copy {
    /// A copy of `waiting` for the wait queue of its delay, through the
    /// default exchange, recording the route it was first published with
    /// and when it is due.
    pub(crate) fn to_wait(topology: &Topology, waiting: Waiting) -> Self {
        let delivery = waiting.delivery;
        let due = now().saturating_add(waiting.delay);
        let properties = delivery
            .properties
            .clone()
            .with_headers(wait_headers(
                delivery.properties.headers().as_ref(),
                delivery.exchange.as_str(),
                delivery.routing_key.as_str(),
                due,
            ))
            .with_delivery_mode(2);
        Self {
            tag: delivery.delivery_tag,
            message: Outgoing {
                exchange: String::new(),
                routing_key: topology.wait_queue(waiting.delay),
                body: delivery.data,
                properties,
            },
            to: Destination::Wait,
        }
    }

    /// A copy of `delivery` for the dead-letter exchange, with the routing
    /// key the work queue's `x-dead-letter-routing-key` names, and idem's
    /// record of its death where the broker would write `x-death`.
    /// `queue` is the one it died in (a slot queue of an ordered queue):
    /// where a replay sends it. `detail` is the handler's of the failure.
    pub(crate) fn to_die(
        topology: &Topology,
        queue: &str,
        (delivery, detail): (Delivery, Option<String>),
    ) -> Self {
        let properties = dead_letter_properties(
            &delivery.properties,
            delivery.exchange.as_str(),
            delivery.routing_key.as_str(),
            queue,
            DEAD_LETTER_REASON,
            now().as_secs(),
            detail.as_deref(),
        );
        Self {
            tag: delivery.delivery_tag,
            message: Outgoing {
                exchange: topology.dead_letter_exchange.clone(),
                routing_key: topology.queue.clone(),
                body: delivery.data,
                properties,
            },
            to: Destination::DeadLetters,
        }
    }

    /// A copy of `delivery`, due in its wait queue, for the work queue
    /// `queue`, as it was sent to wait.
    pub(crate) fn to_work(queue: &str, delivery: Delivery) -> Self {
        Self {
            tag: delivery.delivery_tag,
            message: Outgoing {
                exchange: String::new(),
                routing_key: queue.to_owned(),
                body: delivery.data,
                properties: delivery.properties,
            },
            to: Destination::Work,
        }
    }
}

/// The time since the Unix epoch.
pub(super) fn now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
}

fn settlement(copy: &Copy, outcome: Result<Result<(), Refusal>, String>) -> Settlement {
    let (tag, to) = (copy.tag, copy.message.routing_key.as_str());
    let (otherwise, instead) = copy.to.otherwise();
    let disposition = match outcome {
        Ok(Ok(())) => {
            match copy.to {
                Destination::Wait => debug!(
                    delivery.tag = tag,
                    queue = to,
                    "waiting for its next attempt"
                ),
                Destination::DeadLetters => debug!(delivery.tag = tag, "dead-lettered"),
                Destination::Work => debug!(delivery.tag = tag, "due: back in the work queue"),
            }
            Disposition::Ack
        }
        Ok(Err(refusal)) => {
            warn!(delivery.tag = tag, exchange = %copy.message.exchange, routing_key = to, %refusal, "the broker refused the message's copy: {instead}");
            otherwise
        }
        Err(error) => {
            warn!(delivery.tag = tag, exchange = %copy.message.exchange, routing_key = to, %error, "could not send the message's copy: {instead}");
            otherwise
        }
    };
    Settlement { tag, disposition }
}
