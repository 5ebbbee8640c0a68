//! Failed messages that wait for their next attempt: each is published to
//! the wait queue of its delay, with a publisher confirm and `mandatory`,
//! and its delivery is acked only once that copy is confirmed. A crash
//! between the two leaves both (a duplicate, which the consume record
//! absorbs), never neither.

use lapin::types::DeliveryTag;
use tracing::{debug, warn};

use super::process::Waiting;
use super::settle::{Disposition, Settlement};
use crate::broker::death::wait_headers;
use crate::broker::{ConfirmChannel, Outgoing, Topology, settle};

/// Publishes each of `waiting` to its wait queue on `publisher`, and
/// returns what becomes of its delivery: acked once its copy is confirmed;
/// given back at once (as with a delay of zero) when the broker refuses the
/// copy or the channel fails first. The attempt was counted either way.
pub(crate) async fn send(
    publisher: &ConfirmChannel,
    topology: &Topology,
    waiting: Vec<Waiting>,
) -> Vec<Settlement> {
    let mut sent = Vec::with_capacity(waiting.len());
    for waiting in waiting {
        let queue = topology.wait_queue(waiting.delay);
        let delivery = waiting.delivery;
        let properties = delivery
            .properties
            .clone()
            .with_headers(wait_headers(
                delivery.properties.headers().as_ref(),
                delivery.exchange.as_str(),
                delivery.routing_key.as_str(),
            ))
            .with_delivery_mode(2);
        let copy = Outgoing {
            // The default exchange routes by queue name.
            exchange: String::new(),
            routing_key: queue,
            body: delivery.data,
            properties,
        };
        let confirm = publisher.send(&copy).await;
        sent.push((delivery.delivery_tag, copy.routing_key, confirm));
    }
    let mut settlements = Vec::with_capacity(sent.len());
    for (tag, queue, confirm) in sent {
        let outcome = match confirm {
            Ok(confirm) => settle(confirm).await.map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        };
        settlements.push(settlement(tag, &queue, outcome));
    }
    settlements
}

fn settlement(
    tag: DeliveryTag,
    queue: &str,
    outcome: Result<Result<(), crate::broker::Refusal>, String>,
) -> Settlement {
    let disposition = match outcome {
        Ok(Ok(())) => {
            debug!(delivery.tag = tag, queue, "waiting for its next attempt");
            Disposition::Ack
        }
        Ok(Err(refusal)) => {
            warn!(delivery.tag = tag, queue, %refusal, "the wait queue refused the message: returning it for an attempt now");
            Disposition::Retry
        }
        Err(error) => {
            warn!(delivery.tag = tag, queue, %error, "could not send the message to wait: returning it for an attempt now");
            Disposition::Retry
        }
    };
    Settlement { tag, disposition }
}
