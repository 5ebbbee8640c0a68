//! The slots of an ordered queue, shared by the workers that consume it.
//!
//! Single active consumer gives each slot one active consumer, but by
//! itself makes the first worker to subscribe active on every slot. So the
//! workers agree on who takes which: each says it is alive in PostgreSQL
//! every [`HEARTBEAT`], and takes slot `i` when it is the `(i mod n)`-th of
//! the `n` members seen within [`ALIVE`], in the order of their ids. A
//! worker gives a slot up by closing its channel once what it took is
//! settled (never by cancelling its consumer, see `Source::hand_over`),
//! and single active consumer keeps a slot to one worker while they
//! disagree for a heartbeat. A worker that dies (kill -9) loses its
//! channels at once; the others take its slots once it is no longer seen.

use std::collections::{BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::BasicQosOptions;
use lapin::{Channel, Connection};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::forward::Forwarder;
use super::process::Processor;
use super::{SessionEnd, Source, WorkerConfig, consume as consume_queue};
use crate::broker::{ConnectionWatch, close_channel};
use crate::handler::Handler;

/// How often a worker says it is alive and looks at who else is.
pub(super) const HEARTBEAT: Duration = Duration::from_secs(2);

/// How long a worker not heard from still counts as a member.
pub(super) const ALIVE: Duration = Duration::from_secs(10);

/// The slots of `slots` that the member at `rank` of `members` takes.
fn share(slots: u16, rank: usize, members: usize) -> BTreeSet<usize> {
    (0..usize::from(slots))
        .filter(|slot| slot % members.max(1) == rank)
        .collect()
}

/// One slot consumed: its channel and what hands it over.
struct Held {
    channel: Channel,
    hand_over: CancellationToken,
}

type Consuming<'a> =
    FuturesUnordered<Pin<Box<dyn Future<Output = (usize, SessionEnd)> + Send + 'a>>>;

/// Consumes this worker's share of the slots, each on a channel of its own,
/// their batches sharing the transactions in flight (a batch that holds a
/// key of another in flight waits for it: `SlotKeys`), following the share
/// as workers come and go, until a channel fails or shutdown drains them
/// all.
pub(super) async fn consume<H: Handler>(
    config: &WorkerConfig,
    connection: &Arc<Connection>,
    forwarder: &Arc<Forwarder>,
    processor: &Arc<Processor<H>>,
    watch: &ConnectionWatch,
    shutdown: &CancellationToken,
) -> SessionEnd {
    let topology = &config.topology;
    let names = topology.slot_queues();
    let store = processor.applier.store();
    let member = processor.member;
    let mut held: HashMap<usize, Held> = HashMap::new();
    let mut consuming: Consuming<'_> = FuturesUnordered::new();
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    // Shared by the slots: a batch of each may be in flight, and more of
    // one while the others are quiet.
    let permits = Arc::new(Semaphore::new(
        config.max_in_flight.max(usize::from(topology.slots)),
    ));
    processor.stats.sessions(1);
    let end = 'session: loop {
        tokio::select! {
            _ = heartbeat.tick(), if !shutdown.is_cancelled() => {
                let mine = match store.slot_members(&topology.queue, member, ALIVE).await {
                    Ok(members) => {
                        let rank = members.iter().position(|m| *m == member).unwrap_or(0);
                        share(topology.slots, rank, members.len())
                    }
                    // Keep what it holds; with none, take every slot:
                    // single active consumer keeps each to one worker.
                    Err(error) if held.is_empty() => {
                        warn!(%error, "cannot read the workers sharing the slots: subscribing to every slot");
                        (0..names.len()).collect()
                    }
                    Err(_) => continue,
                };
                for slot in held.keys().filter(|slot| !mine.contains(*slot)) {
                    info!(queue = %names[*slot], "handing the slot over to another worker");
                    held[slot].hand_over.cancel();
                }
                let new: Vec<usize> = mine.into_iter().filter(|slot| !held.contains_key(slot)).collect();
                for slot in new {
                    let channel = match open(connection, config.prefetch).await {
                        Ok(channel) => channel,
                        Err(error) => break 'session SessionEnd::Lost(error.to_string()),
                    };
                    let hand_over = shutdown.child_token();
                    let source = Source {
                        queue: &names[slot],
                        permits: Arc::clone(&permits),
                        hand_over: Some(hand_over.clone()),
                    };
                    let consumed = channel.clone();
                    let lost = watch.lost();
                    consuming.push(Box::pin(async move {
                        let end = consume_queue(config, source, &consumed, forwarder, processor, lost, shutdown).await;
                        (slot, end)
                    }));
                    held.insert(slot, Held { channel, hand_over });
                }
                processor.stats.slots(held.len());
                processor.stats.consuming(!held.is_empty());
            }
            Some((slot, end)) = consuming.next() => {
                let Some(gone) = held.remove(&slot) else { continue };
                if let SessionEnd::Lost(reason) = end {
                    break SessionEnd::Lost(reason);
                }
                // Handed over: what it took and did not start goes back.
                close_channel(&gone.channel).await;
                processor.stats.slots(held.len());
                processor.stats.consuming(!held.is_empty());
                if shutdown.is_cancelled() && held.is_empty() {
                    break SessionEnd::Drained;
                }
            }
            () = shutdown.cancelled(), if held.is_empty() => break SessionEnd::Drained,
        }
    };
    processor.stats.slots(0);
    processor.stats.consuming(false);
    if let SessionEnd::Drained = end
        && let Err(error) = store.leave_slots(&topology.queue, member).await
    {
        warn!(%error, "cannot say this worker left the slots: the others take them once it is no longer seen");
    }
    end
}

async fn open(connection: &Connection, prefetch: u16) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_members_share_the_slots_round_robin() {
        assert_eq!(share(8, 0, 1), (0..8).collect());
        assert_eq!(share(8, 1, 3), BTreeSet::from([1, 4, 7]));
        assert_eq!(share(2, 2, 4), BTreeSet::new());
        let all: usize = (0..3).map(|rank| share(8, rank, 3).len()).sum();
        assert_eq!(all, 8);
    }
}
