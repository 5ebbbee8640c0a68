//! A batch of an ordered queue (one slot): a key's events apply one at a
//! time, in the order the slot delivered them, and a key whose head failed
//! is parked in PostgreSQL with its later events instead of being
//! overtaken. The slot keeps flowing for every other key.
//!
//! - a batch applies in rounds: each round holds at most one event of a
//!   key, the first not yet decided, in one transaction (one by one when
//!   it fails, as any batch);
//! - an event whose transaction failed parks its key: it waits in
//!   PostgreSQL for its next attempt (or lies in the dead letters), and is
//!   acked; `drain` tries it again when it is due;
//! - an event of a parked key is parked behind the head, and acked.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use lapin::message::Delivery;
use tracing::{debug, warn};

use super::process::{Decided, Item, Processor};
use super::settle::Disposition;
use crate::handler::{FailureKind, Handler, Invalid, ORDERING_KEY_HEADER, check_ordering_key};
use crate::retry::{GiveUp, Next};
use crate::store::{Failure, Parking};

impl<H: Handler> Processor<H> {
    /// On an ordered queue, `event` must name a usable ordering key, the
    /// one its delivery was routed by: else its slot is not its key's.
    pub(super) fn check_ordering(
        &self,
        delivery: &Delivery,
        event: &H::Event,
    ) -> Result<(), Invalid> {
        if !self.topology.is_ordered() {
            return Ok(());
        }
        let key = crate::caught::call(|| self.handler().ordering_key(event).map(str::to_owned))
            .map_err(|panic| Invalid::new(format!("reading its ordering key {panic}")))?
            .ok_or_else(|| {
                Invalid::new(format!(
                    "the event has no ordering key, and the queue is ordered; the handler {} names none for it",
                    H::NAME
                ))
            })?;
        check_ordering_key(&key)?;
        let routed = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get(ORDERING_KEY_HEADER).cloned());
        let routed = match routed {
            Some(lapin::types::AMQPValue::LongString(value)) => value.to_string(),
            Some(lapin::types::AMQPValue::ShortString(value)) => value.to_string(),
            Some(_) => {
                return Err(Invalid::new(format!(
                    "its {ORDERING_KEY_HEADER} header is not a string"
                )));
            }
            None => {
                return Err(Invalid::new(format!(
                    "it has no {ORDERING_KEY_HEADER} header, which routes an event of an ordered queue to its key's slot"
                )));
            }
        };
        if routed != key {
            return Err(Invalid::new(format!(
                "its {ORDERING_KEY_HEADER} header does not name the event's ordering key: \
                 the producer must set it to the key"
            )));
        }
        Ok(())
    }

    /// The ordering key of a checked event.
    fn key<'e>(&self, item: &'e Item<H::Event>) -> &'e str {
        self.handler().ordering_key(&item.event).unwrap_or_default()
    }

    /// Applies `items` of one slot in their order per key: round by round,
    /// each round the first undecided event of each key that is not parked;
    /// the events of parked keys are parked behind their heads.
    pub(super) async fn apply_in_order(&self, items: Vec<Item<H::Event>>, decided: &mut Decided) {
        let keys: Vec<&str> = items.iter().map(|item| self.key(item)).collect();
        let parked = self
            .until_database_answers(
                || self.store().parked_among(&keys),
                |error| error.kind() == FailureKind::Infrastructure,
            )
            .await;
        let mut parked = match parked {
            Ok(parked) => parked,
            Err(error) => {
                // Applying without knowing could overtake a head.
                warn!(%error, "cannot read the parked keys: returning the batch to its slot");
                for item in items {
                    decided.settle(item.tag(), Disposition::Retry);
                }
                return;
            }
        };
        let mut pending: VecDeque<Item<H::Event>> = items.into();
        while !pending.is_empty() {
            let mut round = Vec::new();
            let mut to_park = Vec::new();
            let mut later = VecDeque::new();
            let mut in_round = HashSet::new();
            for item in pending.drain(..) {
                let key = self.key(&item).to_owned();
                if parked.contains(&key) {
                    to_park.push(item);
                } else if in_round.contains(&key) {
                    later.push_back(item);
                } else {
                    in_round.insert(key);
                    round.push(item);
                }
            }
            // Keys that are parked no longer (their last event applied
            // meanwhile) go before their later events.
            for item in self.park(to_park, decided).await.into_iter().rev() {
                parked.remove(self.key(&item));
                later.push_front(item);
            }
            if !round.is_empty() {
                self.apply(round, decided, None).await;
                parked.extend(decided.parked.drain(..));
            }
            pending = later;
        }
    }

    /// Parks `items` behind their keys' heads and acks them; returns those
    /// whose key is parked no longer, in their order.
    async fn park(&self, items: Vec<Item<H::Event>>, decided: &mut Decided) -> Vec<Item<H::Event>> {
        if items.is_empty() {
            return items;
        }
        let properties: Vec<serde_json::Value> = items
            .iter()
            .map(|item| crate::broker::json::properties_json(&item.delivery.properties))
            .collect();
        let parking: Vec<Parking<'_>> = items
            .iter()
            .zip(&properties)
            .map(|(item, properties)| Parking {
                key: self.key(item),
                event_id: self.event_id(item),
                queue: &decided.queue,
                body: &item.delivery.data,
                properties: properties.clone(),
            })
            .collect();
        let parked = self
            .until_database_answers(|| self.store().park(&parking), |_| true)
            .await;
        let Ok(unparked) = parked else {
            unreachable!("every error of a park is retried");
        };
        drop(parking);
        let mut back = Vec::new();
        for (place, item) in items.into_iter().enumerate() {
            if unparked.contains(&place) {
                back.push(item);
                continue;
            }
            debug!(
                delivery.tag = item.tag(),
                event.id = %self.event_id(&item),
                ordering.key = %self.key(&item),
                "parked behind its key's head"
            );
            self.stats.parked(1);
            decided.settle(item.tag(), Disposition::Ack);
        }
        back
    }

    /// An ordered event whose transaction failed: counted, then kept in
    /// PostgreSQL for its next attempt, or dead-lettered; either way its
    /// key is parked behind it.
    pub(super) async fn park_failed(
        &self,
        item: Item<H::Event>,
        failure: &Failure,
        decided: &mut Decided,
    ) {
        let event_id = self.event_id(&item).to_owned();
        let key = self.key(&item).to_owned();
        let (failures, next) = self.count_failure(&event_id, failure).await;
        let retry_in = match next {
            Next::Now => Some(Duration::ZERO),
            Next::Wait(delay) => Some(delay),
            Next::DeadLetter(_) | Next::Hold => None,
        };
        warn!(
            delivery.tag = item.tag(),
            event.id = %event_id,
            ordering.key = %key,
            attempt = failures,
            max_attempts = self.retry().attempts(),
            retry.delay_ms = retry_in.map(|delay| delay.as_millis() as u64),
            error = %failure,
            error.detail = failure.detail.as_deref(),
            "{}",
            match next {
                Next::DeadLetter(GiveUp::Permanent) =>
                    "the handler says the message can never apply: dead-lettering it; its key is parked until it is replayed or released",
                Next::DeadLetter(_) =>
                    "transaction failed and the message is out of attempts: dead-lettering it; its key is parked until it is replayed or released",
                _ => "transaction failed: the message waits for its next attempt, its key's later events parked behind it",
            }
        );
        let properties = crate::broker::json::properties_json(&item.delivery.properties);
        let head = Parking {
            key: &key,
            event_id: &event_id,
            queue: &decided.queue,
            body: &item.delivery.data,
            properties,
        };
        let parked = self
            .until_database_answers(
                || self.store().park_head(&head, retry_in, &failure.reason),
                |_| true,
            )
            .await;
        if parked.is_err() {
            unreachable!("every error of a park is retried");
        }
        decided.parked.push(key);
        match retry_in {
            Some(delay) => {
                self.stats.retried(1, delay);
                decided.settle(item.tag(), Disposition::Ack);
            }
            None => self.give_up_failed(decided, item, failure),
        }
    }
}
