//! Taking a waiting message out of its wait queue once it is due: a copy
//! to the work queue with a publisher confirm, then an ack. Without it the
//! broker does the same when the message's TTL runs out, by at-least-once
//! dead-lettering, which RabbitMQ 3.10 can hold for its 180 s confirm
//! timeout, once or twice, after the node leading the wait queue is lost.
//! The TTL stays for what no worker holds (none runs, or more wait than
//! the prefetch): that expires, and the broker makes the hop, as before.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::Channel;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::forward::{self, Copy, Forwarder};
use super::settle::Disposition;
use crate::broker::Topology;
use crate::broker::death::DUE_HEADER;

/// Wait queues with a longer delay are left to the broker's TTL: a consumer
/// that held a message that long would meet RabbitMQ's `consumer_timeout`
/// (30 minutes by default), which closes its channel.
const LONGEST_HELD: Duration = Duration::from_secs(15 * 60);

/// Messages a wait queue hands one worker at a time.
pub(crate) const PREFETCH: u16 = 1000;

/// Consumes the wait queues of `topology` on `channel` (its prefetch set
/// to [`PREFETCH`]) and sends each message to the work queue when it is
/// due. Returns why it stopped when the channel or a consumer fails; after
/// `shutdown` it cancels its consumers, drops what it holds (the broker
/// gives it back when the channel closes) and waits to be dropped.
pub(crate) async fn run(
    channel: &Channel,
    forwarder: &Arc<Forwarder>,
    topology: &Topology,
    shutdown: &CancellationToken,
) -> String {
    let (mut consumers, mut tags) = (Vec::new(), Vec::new());
    for delay in topology.retry.waits() {
        if delay > LONGEST_HELD {
            continue;
        }
        let queue = topology.wait_queue(delay);
        match channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            Ok(consumer) => {
                tags.push(consumer.tag());
                // A consumer's end is a message of its own: the merged
                // stream would otherwise go on without it.
                let ended = futures::stream::iter([None]);
                consumers.push(
                    consumer
                        .map(Some)
                        .chain(ended)
                        .map(move |delivery| (delay, delivery)),
                );
            }
            Err(error) => return format!("cannot consume the wait queue '{queue}': {error}"),
        }
    }
    if consumers.is_empty() {
        return std::future::pending().await;
    }
    let mut deliveries = futures::stream::select_all(consumers);
    let mut held = JoinSet::new();
    loop {
        tokio::select! {
            next = deliveries.next() => match next {
                Some((delay, Some(Ok(delivery)))) => {
                    let (channel, forwarder) = (channel.clone(), Arc::clone(forwarder));
                    let queue = topology.queue.clone();
                    held.spawn(release(channel, forwarder, queue, delay, delivery));
                }
                Some((_, Some(Err(error)))) => {
                    return format!("a wait queue's consumer failed: {error}");
                }
                Some((delay, None)) => {
                    return format!(
                        "the broker cancelled the consumer of the wait queue '{}'",
                        topology.wait_queue(delay)
                    );
                }
                None => return "the broker cancelled the wait queues' consumers".into(),
            },
            Some(Ok(Err(error))) = held.join_next() => return error,
            () = shutdown.cancelled() => break,
        }
    }
    // The broker stops sending; what it sent and is held goes back to the
    // wait queues when the channel closes.
    held.shutdown().await;
    for tag in tags {
        let _ = channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await;
    }
    std::future::pending().await
}

/// Waits until `delivery` is due, sends it to the work queue `queue`, and
/// acks it once confirmed; one the broker refuses goes back to its wait
/// queue (where its TTL, spent, lets the broker make the hop).
async fn release(
    channel: Channel,
    forwarder: Arc<Forwarder>,
    queue: String,
    delay: Duration,
    delivery: Delivery,
) -> Result<(), String> {
    let tag = delivery.delivery_tag;
    tokio::time::sleep(until_due(&delivery, delay)).await;
    let copy = Copy::to_work(&queue, delivery);
    let settled = forward::send(&forwarder, vec![copy]).await;
    let done = match settled.first().map(|settlement| settlement.disposition) {
        Some(Disposition::Ack) => channel.basic_ack(tag, BasicAckOptions::default()).await,
        _ => {
            channel
                .basic_reject(tag, BasicRejectOptions { requeue: true })
                .await
        }
    };
    done.map_err(|error| format!("cannot settle a waiting message: {error}"))
}

/// How long until `delivery` is due: its due time, which idem wrote when it
/// sent it to wait, or the whole `delay` from now for a copy without one
/// (an older idem's), which never cuts a wait short.
fn until_due(delivery: &Delivery, delay: Duration) -> Duration {
    let due = delivery.properties.headers().as_ref().and_then(|headers| {
        match headers.inner().get(DUE_HEADER) {
            Some(AMQPValue::LongLongInt(millis)) => u64::try_from(*millis).ok(),
            _ => None,
        }
    });
    let Some(due) = due else {
        return delay;
    };
    Duration::from_millis(due)
        .saturating_sub(forward::now())
        .min(delay)
}
