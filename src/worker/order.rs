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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::message::Delivery;
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::process::{Decided, Item, Processor};
use super::settle::Disposition;
use super::stats::ParkedBound;
use crate::handler::{FailureKind, Handler, Invalid, ORDERING_KEY_HEADER, check_ordering_key};
use crate::retry::{GiveUp, Next};
use crate::store::{Failure, Parking};

/// The ordering key a delivery was routed by: its
/// [`ORDERING_KEY_HEADER`], when that is a string.
fn routed_key(delivery: &Delivery) -> Result<String, Invalid> {
    let routed = delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get(ORDERING_KEY_HEADER).cloned());
    match routed {
        Some(lapin::types::AMQPValue::LongString(value)) => Ok(value.to_string()),
        Some(lapin::types::AMQPValue::ShortString(value)) => Ok(value.to_string()),
        Some(_) => Err(Invalid::new(format!(
            "its {ORDERING_KEY_HEADER} header is not a string"
        ))),
        None => Err(Invalid::new(format!(
            "it has no {ORDERING_KEY_HEADER} header, which routes an event of an ordered queue to its key's slot"
        ))),
    }
}

/// What the consumer of one slot knows of its keys, shared by its batches
/// in flight: the keys each batch holds (a later batch with one of them
/// waits for it, so that a key is never in two transactions at once), and
/// which keys are parked.
///
/// Only the slot's consumer parks a key, so the parked keys are read once,
/// when the slot first delivers (a consumer before it has settled and
/// closed by then), and followed from there: a key this consumer parks is
/// added, one found no longer parked when an event is parked behind it is
/// removed. A key unparked meanwhile (its head applied, an operator's
/// release) is still taken for parked until then, which costs a park that
/// finds it free, never an event applied past its head.
#[derive(Debug, Default)]
pub(super) struct SlotKeys {
    busy: Mutex<HashSet<String>>,
    freed: Notify,
    parked: tokio::sync::Mutex<Option<HashSet<String>>>,
}

/// The keys of a batch in flight, held until it drops.
#[derive(Debug)]
pub(super) struct HeldKeys {
    slot: Arc<SlotKeys>,
    keys: Vec<String>,
}

impl SlotKeys {
    /// Waits until no batch in flight holds a key of `batch` (by the
    /// header it was routed by), then holds them until the guard drops.
    pub(super) async fn hold(self: &Arc<Self>, batch: &[Delivery]) -> HeldKeys {
        let mut keys: Vec<String> = batch.iter().filter_map(|d| routed_key(d).ok()).collect();
        keys.sort_unstable();
        keys.dedup();
        loop {
            // Registered before looking, so that a release between the
            // look and the wait is not missed.
            let freed = self.freed.notified();
            {
                let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
                if keys.iter().all(|key| !busy.contains(key)) {
                    busy.extend(keys.iter().cloned());
                    return HeldKeys {
                        slot: Arc::clone(self),
                        keys,
                    };
                }
            }
            freed.await;
        }
    }

    /// The keys among `keys` that are parked, and all the slot knows to be.
    async fn parked(
        &self,
        store: &crate::store::Store,
        keys: &[&str],
    ) -> Result<HashSet<String>, crate::store::StoreError> {
        let mut known = self.parked.lock().await;
        let known = match &mut *known {
            Some(known) => known,
            None => known.insert(store.parked_key_names().await?),
        };
        Ok(keys
            .iter()
            .filter(|key| known.contains(**key))
            .map(|key| (*key).to_owned())
            .collect())
    }

    /// What a batch of `keys` ended with: of them, `parked` are parked.
    async fn learn(&self, keys: &[&str], parked: &HashSet<String>) {
        if let Some(known) = &mut *self.parked.lock().await {
            for key in keys {
                known.remove(*key);
            }
            known.extend(parked.iter().cloned());
        }
    }
}

impl HeldKeys {
    /// The slot the keys are held in.
    pub(super) fn slot(&self) -> &SlotKeys {
        &self.slot
    }
}

impl Drop for HeldKeys {
    fn drop(&mut self) {
        let mut busy = self.slot.busy.lock().unwrap_or_else(|e| e.into_inner());
        for key in &self.keys {
            busy.remove(key);
        }
        drop(busy);
        self.slot.freed.notify_waiters();
    }
}

/// How long an event past a bound waits before it tries again.
const BOUND_PAUSE: Duration = Duration::from_secs(1);

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
        if routed_key(delivery)? != key {
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

    /// For a handler whose effect is a tally (sums per key, the same in
    /// any order) and that sends no message: the events of `items` whose
    /// keys are not parked in one transaction rather than a round each, so
    /// that a batch of many events per key commits once. What is left (the
    /// events of parked keys; all of them when that transaction fails)
    /// comes back for the rounds, which find the failing head.
    async fn merged_rounds(
        &self,
        items: Vec<Item<H::Event>>,
        parked: &HashSet<String>,
        decided: &mut Decided,
    ) -> Vec<Item<H::Event>> {
        if H::SENDS_MESSAGES || self.handler().tally().is_none() {
            return items;
        }
        // A key with an event redelivered (which may be out of attempts)
        // goes by rounds whole, so that none of its events passes another.
        let by_rounds: HashSet<String> = items
            .iter()
            .filter(|item| item.delivery.redelivered)
            .map(|item| self.key(item).to_owned())
            .chain(parked.iter().cloned())
            .collect();
        let (free, held): (Vec<_>, Vec<_>) = items
            .into_iter()
            .partition(|item| !by_rounds.contains(self.key(item)));
        let keys: HashSet<&str> = free.iter().map(|item| self.key(item)).collect();
        // One event per key is one round anyway.
        if keys.len() == free.len() {
            drop(keys);
            return free.into_iter().chain(held).collect();
        }
        drop(keys);
        match self.apply_whole(free, decided).await {
            Ok(()) => held,
            Err(free) => free.into_iter().chain(held).collect(),
        }
    }

    /// Applies `items` of one slot in their order per key: round by round,
    /// each round the first undecided event of each key that is not parked;
    /// the events of parked keys are parked behind their heads.
    pub(super) async fn apply_in_order(
        &self,
        items: Vec<Item<H::Event>>,
        decided: &mut Decided,
        slot: &SlotKeys,
    ) {
        let owned: Vec<String> = items.iter().map(|item| self.key(item).to_owned()).collect();
        let keys: Vec<&str> = owned.iter().map(String::as_str).collect();
        let parked = self
            .until_database_answers(
                || slot.parked(self.store(), &keys),
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
        let items = self.merged_rounds(items, &parked, decided).await;
        let mut pending: VecDeque<Item<H::Event>> = items.into();
        // Events of keys past the bound of events per key, in their order:
        // they wait until the rest of the batch is done, then try again.
        let mut waiting: Vec<Item<H::Event>> = Vec::new();
        let mut waited = false;
        loop {
            while !pending.is_empty() {
                let mut round = Vec::new();
                let mut to_park = Vec::new();
                let mut later = VecDeque::new();
                let mut in_round = HashSet::new();
                let waiting_keys: HashSet<String> = waiting
                    .iter()
                    .map(|item| self.key(item).to_owned())
                    .collect();
                for item in pending.drain(..) {
                    let key = self.key(&item).to_owned();
                    if waiting_keys.contains(&key) {
                        waiting.push(item);
                    } else if parked.contains(&key) {
                        to_park.push(item);
                    } else if in_round.contains(&key) {
                        later.push_back(item);
                    } else {
                        in_round.insert(key);
                        round.push(item);
                    }
                }
                let (unparked, over_bound) = self.park(to_park, decided).await;
                waiting.extend(over_bound);
                // Keys that are parked no longer (their last event applied
                // meanwhile) go before their later events.
                for item in unparked.into_iter().rev() {
                    parked.remove(self.key(&item));
                    later.push_front(item);
                }
                if !round.is_empty() {
                    self.apply(round, decided, None).await;
                    parked.extend(decided.parked.drain(..));
                }
                pending = later;
            }
            if waiting.is_empty() {
                break;
            }
            self.wait_for_the_bound(&waiting, &mut waited).await;
            pending = std::mem::take(&mut waiting).into();
        }
        slot.learn(&keys, &parked).await;
    }

    /// Events past the bound of events per key wait a while; the first
    /// wait of a batch is logged.
    async fn wait_for_the_bound(&self, waiting: &[Item<H::Event>], waited: &mut bool) {
        if !*waited {
            *waited = true;
            warn!(
                events = waiting.len(),
                ordering.key = %self.key(&waiting[0]),
                bound = self.parked_bounds.events_per_key,
                "a parked key holds as many events as --max-parked-per-key allows: its next events wait in the worker, unacked, until its head applies or an operator releases or discards it"
            );
        }
        self.stats.parked_bound_wait(ParkedBound::EventsPerKey);
        tokio::time::sleep(BOUND_PAUSE).await;
    }

    /// Parks `items` behind their keys' heads and acks them; returns those
    /// whose key is parked no longer, and those past the bound of events
    /// per key, each in their order.
    async fn park(
        &self,
        items: Vec<Item<H::Event>>,
        decided: &mut Decided,
    ) -> (Vec<Item<H::Event>>, Vec<Item<H::Event>>) {
        if items.is_empty() {
            return (items, Vec::new());
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
        let per_key = self.parked_bounds.events_per_key;
        let parked = self
            .until_database_answers(|| self.store().park(&parking, per_key), |_| true)
            .await;
        let Ok(parked) = parked else {
            unreachable!("every error of a park is retried");
        };
        drop(parking);
        let (mut back, mut over) = (Vec::new(), Vec::new());
        for (place, item) in items.into_iter().enumerate() {
            if parked.unparked.contains(&place) {
                back.push(item);
                continue;
            }
            if parked.over_bound.contains(&place) {
                over.push(item);
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
        (back, over)
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
        let keys = self.parked_bounds.keys;
        let mut waited = false;
        loop {
            let parked = self
                .until_database_answers(
                    || {
                        self.store()
                            .park_head(&head, retry_in, &failure.reason, keys)
                    },
                    |_| true,
                )
                .await;
            match parked {
                Ok(true) => break,
                Ok(false) => {}
                Err(_) => unreachable!("every error of a park is retried"),
            }
            if !waited {
                waited = true;
                warn!(
                    event.id = %event_id,
                    ordering.key = %key,
                    bound = keys,
                    "as many keys are parked as --max-parked-keys allows: this failed head waits in the worker, unacked, with its batch, until a parked key applies or an operator releases or discards one"
                );
            }
            self.stats.parked_bound_wait(ParkedBound::Keys);
            tokio::time::sleep(BOUND_PAUSE).await;
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
