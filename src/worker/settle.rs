//! Telling the broker what became of each delivery: acks coalesced with
//! `multiple` where every lower tag is settled, rejections sent one by one.
//!
//! One task per channel owns this, so the delivery loop never waits on an ack
//! and frames go out in the order the decisions were made.

use std::collections::BTreeSet;

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicRejectOptions};
use lapin::types::DeliveryTag;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::debug;

/// What the broker is told about one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Done (applied, or a duplicate): remove it from the queue.
    Ack,
    /// This message failed: give it back, counting toward the delivery limit
    /// (`basic.reject` with requeue; `nack` would not count on RabbitMQ 4.3+).
    Retry,
    /// Invalid, or out of attempts: reject without requeue, so the broker
    /// dead-letters it now.
    DeadLetter,
}

/// The decision about one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settlement {
    pub(crate) tag: DeliveryTag,
    pub(crate) disposition: Disposition,
}

enum Note {
    /// These tags were handed out for processing and await a decision.
    Track(Vec<DeliveryTag>),
    /// Decisions.
    Settle(Vec<Settlement>),
}

/// Sends decisions to the settler task of one channel.
#[derive(Debug, Clone)]
pub(crate) struct Settler {
    notes: mpsc::UnboundedSender<Note>,
}

impl Settler {
    /// Starts the settler task for `channel`; it ends when every `Settler`
    /// is dropped and what they sent is flushed, or when the channel fails.
    pub(crate) fn spawn(channel: Channel) -> (Self, JoinHandle<()>) {
        let (notes, inbox) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(channel, inbox));
        (Self { notes }, task)
    }

    /// Must be called, in delivery order, before any of `tags` is settled:
    /// an ack with `multiple` never covers a tracked tag still in flight.
    pub(crate) fn track(&self, tags: Vec<DeliveryTag>) {
        // A closed inbox means the channel failed; the broker will redeliver.
        let _ = self.notes.send(Note::Track(tags));
    }

    pub(crate) fn settle(&self, settlements: Vec<Settlement>) {
        let _ = self.notes.send(Note::Settle(settlements));
    }
}

/// Tags awaiting a decision, and acks decided but not yet sent.
#[derive(Debug, Default)]
struct Outstanding {
    in_flight: BTreeSet<DeliveryTag>,
    acks: BTreeSet<DeliveryTag>,
}

impl Outstanding {
    /// The highest decided ack below every tag still in flight, and whether
    /// more than one ack is covered by it.
    fn next_ack(&mut self) -> Option<(DeliveryTag, bool)> {
        let floor = self.in_flight.first().copied().unwrap_or(DeliveryTag::MAX);
        let covered = self.acks.range(..floor).count();
        let highest = *self.acks.range(..floor).next_back()?;
        self.acks = self.acks.split_off(&(highest + 1));
        Some((highest, covered > 1))
    }
}

async fn run(channel: Channel, mut inbox: mpsc::UnboundedReceiver<Note>) {
    let mut outstanding = Outstanding::default();
    while let Some(note) = inbox.recv().await {
        let mut notes = vec![note];
        // Take whatever else is waiting, so one ack covers as much as it can.
        while let Ok(note) = inbox.try_recv() {
            notes.push(note);
        }
        if let Err(error) = apply(&channel, &mut outstanding, notes).await {
            debug!(%error, "channel closed before deliveries were settled; the broker redelivers them");
            return;
        }
    }
}

async fn apply(
    channel: &Channel,
    outstanding: &mut Outstanding,
    notes: Vec<Note>,
) -> lapin::Result<()> {
    for note in notes {
        match note {
            Note::Track(tags) => outstanding.in_flight.extend(tags),
            Note::Settle(settlements) => {
                for Settlement { tag, disposition } in settlements {
                    outstanding.in_flight.remove(&tag);
                    match disposition {
                        Disposition::Ack => {
                            outstanding.acks.insert(tag);
                        }
                        Disposition::Retry | Disposition::DeadLetter => {
                            let requeue = disposition == Disposition::Retry;
                            channel
                                .basic_reject(tag, BasicRejectOptions { requeue })
                                .await?;
                        }
                    }
                }
            }
        }
    }
    if let Some((tag, multiple)) = outstanding.next_ack() {
        channel.basic_ack(tag, BasicAckOptions { multiple }).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_wait_for_lower_tags_still_in_flight() {
        let mut outstanding = Outstanding::default();
        outstanding.in_flight.extend([1, 2, 3, 4]);
        for tag in [2, 3] {
            outstanding.in_flight.remove(&tag);
            outstanding.acks.insert(tag);
        }
        assert_eq!(outstanding.next_ack(), None, "tag 1 is still in flight");
        outstanding.in_flight.remove(&1);
        outstanding.acks.insert(1);
        assert_eq!(outstanding.next_ack(), Some((3, true)));
        assert_eq!(outstanding.next_ack(), None, "nothing left to ack");
    }

    #[test]
    fn a_lone_ack_is_not_multiple() {
        let mut outstanding = Outstanding::default();
        outstanding.in_flight.extend([7, 8]);
        outstanding.in_flight.remove(&7);
        outstanding.acks.insert(7);
        assert_eq!(outstanding.next_ack(), Some((7, false)));
    }

    #[test]
    fn rejected_tags_between_acks_do_not_block_them() {
        let mut outstanding = Outstanding::default();
        outstanding.in_flight.extend([1, 2, 3]);
        // 2 was rejected: removed from flight, never acked.
        for tag in [1, 2, 3] {
            outstanding.in_flight.remove(&tag);
        }
        outstanding.acks.extend([1, 3]);
        assert_eq!(outstanding.next_ack(), Some((3, true)));
    }
}
