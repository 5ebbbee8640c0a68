//! Telling the broker what became of each delivery: acks coalesced with
//! `multiple` where every lower tag is settled, rejections sent one by one.
//!
//! One task per channel owns this, so the delivery loop never waits on an ack
//! and frames go out in the order the decisions were made.

use std::collections::VecDeque;
use std::sync::Arc;

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicRejectOptions};
use lapin::types::DeliveryTag;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Duration, Instant};
use tracing::debug;

use super::stats::Stats;

/// What the broker is told about one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Done (applied, or a duplicate): remove it from the queue.
    Ack,
    /// This message failed: give it back, counting toward the delivery limit
    /// (`basic.reject` with requeue; `nack` would not count on RabbitMQ 4.3+).
    Retry,
    /// Invalid, or out of attempts, and idem could not publish it to the
    /// dead-letter exchange itself: reject without requeue, so the broker
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
    pub(crate) fn spawn(channel: Channel, stats: Arc<Stats>) -> (Self, JoinHandle<()>) {
        let (notes, inbox) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(channel, inbox, stats));
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

/// What was decided for a tracked delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    InFlight,
    /// To be acked.
    Acked,
    /// Rejected already: settled at the broker.
    Rejected,
}

/// The tracked deliveries not yet acked at the broker, oldest first. Tags
/// on a channel are consecutive, so a tag's place is found by subtraction.
#[derive(Debug, Default)]
struct Outstanding {
    entries: VecDeque<(DeliveryTag, State)>,
}

impl Outstanding {
    fn track(&mut self, tags: impl IntoIterator<Item = DeliveryTag>) {
        self.entries
            .extend(tags.into_iter().map(|tag| (tag, State::InFlight)));
    }

    fn decide(&mut self, tag: DeliveryTag, state: State) {
        let Some(&(oldest, _)) = self.entries.front() else {
            return;
        };
        let index = usize::try_from(tag.wrapping_sub(oldest)).unwrap_or(usize::MAX);
        let entry = match self.entries.get_mut(index) {
            Some(entry) if entry.0 == tag => Some(entry),
            // Not where consecutive tags would put it: look for it.
            _ => self.entries.iter_mut().find(|(t, _)| *t == tag),
        };
        if let Some(entry) = entry {
            entry.1 = state;
        }
    }

    /// How many deliveries the next ack would cover now.
    fn ackable(&self) -> usize {
        self.entries
            .iter()
            .take_while(|(_, state)| *state != State::InFlight)
            .filter(|(_, state)| *state == State::Acked)
            .count()
    }

    /// Drops the settled deliveries at the front; returns the highest tag
    /// among them to ack, and whether that ack covers more than one.
    fn next_ack(&mut self) -> Option<(DeliveryTag, bool)> {
        let mut highest = None;
        let mut acks = 0usize;
        while let Some(&(tag, state)) = self.entries.front() {
            match state {
                State::InFlight => break,
                State::Acked => {
                    highest = Some(tag);
                    acks += 1;
                }
                State::Rejected => {}
            }
            self.entries.pop_front();
        }
        highest.map(|tag| (tag, acks > 1))
    }
}

/// Below this many deliveries, an ack waits up to [`LINGER`] for more
/// decisions: on a quorum queue every ack is a replicated command, so one ack
/// for many deliveries saves the broker real work (per-message mode, above
/// all, where decisions arrive one at a time).
const COALESCE: usize = 32;
const LINGER: Duration = Duration::from_millis(1);

async fn run(channel: Channel, mut inbox: mpsc::UnboundedReceiver<Note>, stats: Arc<Stats>) {
    let mut outstanding = Outstanding::default();
    while let Some(note) = inbox.recv().await {
        let settled = settle_for_a_moment(&channel, &mut outstanding, note, &mut inbox).await;
        stats.unacked(outstanding.entries.len());
        if let Err(error) = settled {
            debug!(%error, "channel closed before deliveries were settled; the broker redelivers them");
            break;
        }
    }
    // What this channel held is settled, or back with the broker.
    stats.unacked(0);
}

/// Records `first` and whatever follows it closely, then sends one ack.
async fn settle_for_a_moment(
    channel: &Channel,
    outstanding: &mut Outstanding,
    first: Note,
    inbox: &mut mpsc::UnboundedReceiver<Note>,
) -> lapin::Result<()> {
    record(channel, outstanding, first).await?;
    let until = Instant::now() + LINGER;
    loop {
        let note = match inbox.try_recv() {
            Ok(note) => note,
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) => {
                if outstanding.ackable() >= COALESCE {
                    break;
                }
                match tokio::time::timeout_at(until, inbox.recv()).await {
                    Ok(Some(note)) => note,
                    Ok(None) | Err(_) => break,
                }
            }
        };
        record(channel, outstanding, note).await?;
    }
    if let Some((tag, multiple)) = outstanding.next_ack() {
        channel.basic_ack(tag, BasicAckOptions { multiple }).await?;
    }
    Ok(())
}

/// Takes note of tracked tags or decisions; rejections go out at once, so
/// before any ack with `multiple` that covers them.
async fn record(channel: &Channel, outstanding: &mut Outstanding, note: Note) -> lapin::Result<()> {
    match note {
        Note::Track(tags) => outstanding.track(tags),
        Note::Settle(settlements) => {
            for Settlement { tag, disposition } in settlements {
                if disposition == Disposition::Ack {
                    outstanding.decide(tag, State::Acked);
                    continue;
                }
                let requeue = disposition == Disposition::Retry;
                channel
                    .basic_reject(tag, BasicRejectOptions { requeue })
                    .await?;
                outstanding.decide(tag, State::Rejected);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_wait_for_lower_tags_still_in_flight() {
        let mut outstanding = Outstanding::default();
        outstanding.track([1, 2, 3, 4]);
        outstanding.decide(2, State::Acked);
        outstanding.decide(3, State::Acked);
        assert_eq!(outstanding.next_ack(), None, "tag 1 is still in flight");
        outstanding.decide(1, State::Acked);
        assert_eq!(outstanding.next_ack(), Some((3, true)));
        assert_eq!(outstanding.next_ack(), None, "nothing left to ack");
        outstanding.decide(4, State::Acked);
        assert_eq!(outstanding.next_ack(), Some((4, false)));
    }

    #[test]
    fn a_lone_ack_is_not_multiple() {
        let mut outstanding = Outstanding::default();
        outstanding.track([7, 8]);
        outstanding.decide(7, State::Acked);
        assert_eq!(outstanding.next_ack(), Some((7, false)));
    }

    #[test]
    fn rejected_tags_between_acks_do_not_block_them() {
        let mut outstanding = Outstanding::default();
        outstanding.track([1, 2, 3]);
        outstanding.decide(1, State::Acked);
        outstanding.decide(2, State::Rejected);
        outstanding.decide(3, State::Acked);
        assert_eq!(outstanding.next_ack(), Some((3, true)));
    }

    #[test]
    fn a_settled_run_of_rejections_needs_no_ack() {
        let mut outstanding = Outstanding::default();
        outstanding.track([5, 6, 7]);
        outstanding.decide(5, State::Rejected);
        outstanding.decide(6, State::Rejected);
        assert_eq!(outstanding.next_ack(), None);
        outstanding.decide(7, State::Acked);
        assert_eq!(outstanding.next_ack(), Some((7, false)));
    }

    #[test]
    fn tags_that_are_not_consecutive_are_still_found() {
        let mut outstanding = Outstanding::default();
        outstanding.track([10, 12, 13]);
        outstanding.decide(12, State::Acked);
        outstanding.decide(10, State::Acked);
        assert_eq!(outstanding.next_ack(), Some((12, true)));
    }
}
