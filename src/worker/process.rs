//! Handling a batch of deliveries: decode, apply in one transaction, and
//! decide what the broker is told. All failure handling lives here.
//!
//! - invalid message: dead-letter at once;
//! - this message failed: count it in the failure ledger and send it to
//!   wait (or give it back at once), or dead-letter it once it has used up
//!   its attempts;
//! - infrastructure unavailable: hold the deliveries and retry with backoff,
//!   never spending a message's attempts on an outage.

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, DeliveryTag};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{Instrument, Span, debug, info, info_span, warn};

use super::health::{DatabaseHealth, Hold};
use super::order::SlotKeys;
use super::settle::{Disposition, Settlement};
use super::stats::Stats;
use crate::broker::Topology;
use crate::broker::death::{may_follow_an_attempt, replays};
use crate::caught;
use crate::handler::{FailureKind, GivenUp, Handler, Invalid, check_event_id};
use crate::probe::{self, Point};
use crate::retry::{GiveUp, Next, RetryPolicy};
use crate::store::dead_letters::{body_key, event_key};
use crate::store::{Applier, Claimed, DeadLetter, Failure, GivenUpMessages, Store};
use crate::telemetry::trace;

/// A delivery whose body is a valid event.
pub(super) struct Item<E> {
    /// Kept whole until it is decided: a failed one is published again, to
    /// wait.
    pub(super) delivery: Delivery,
    /// The quorum queue's count of earlier deliveries, when it set one.
    pub(super) delivery_count: Option<i64>,
    pub(super) event: E,
}

impl<E> Item<E> {
    pub(super) fn tag(&self) -> DeliveryTag {
        self.delivery.delivery_tag
    }
}

/// A failed delivery to publish to the wait queue of its delay; it is acked
/// only once that copy is confirmed.
#[derive(Debug)]
pub(crate) struct Waiting {
    pub(crate) delivery: Delivery,
    pub(crate) delay: Duration,
}

/// The reason idem records for a message it dead-letters: what the
/// broker's `x-death` says of a reject.
pub(crate) const DEAD_LETTER_REASON: &str = "rejected";

/// What became of a batch: decisions for the broker, and deliveries to send
/// to wait or to the dead-letter exchange first.
#[derive(Debug, Default)]
pub(crate) struct Decided {
    pub(crate) settlements: Vec<Settlement>,
    pub(crate) waiting: Vec<Waiting>,
    /// Invalid, or out of attempts: each goes to the dead-letter exchange,
    /// with the handler's detail of why when it gave one.
    pub(crate) dead: Vec<(Delivery, Option<String>)>,
    /// What the dead-letter index is told before the letters go out.
    dead_letters: Vec<DeadLetter>,
    /// What the handler sends for the letters, written with the index.
    given_up: Vec<GivenUpMessages>,
    /// The queue the batch came from: the work queue, or a slot queue.
    pub(crate) queue: String,
    /// On an ordered queue, the keys this batch parked behind a failed head.
    pub(super) parked: Vec<String>,
}

impl Decided {
    pub(super) fn settle(&mut self, tag: DeliveryTag, disposition: Disposition) {
        self.settlements.push(Settlement { tag, disposition });
    }

    /// Dead-letters `delivery` (`event_id` when it is a valid event; why it
    /// failed when the failure ledger does not say, and the handler's
    /// detail of it).
    fn dead_letter(
        &mut self,
        delivery: Delivery,
        event_id: Option<&str>,
        error: Option<String>,
        detail: Option<String>,
    ) {
        let properties = crate::broker::json::properties_json(&delivery.properties);
        self.dead_letters.push(DeadLetter {
            key: event_id.map_or_else(|| body_key(&delivery.data), event_key),
            event_id: event_id.map(str::to_owned),
            queue: self.queue.clone(),
            reason: DEAD_LETTER_REASON.to_owned(),
            invalid: event_id.is_none(),
            error,
            dead_at: None,
            body: Some(delivery.data.clone()),
            properties: Some(crate::broker::json::with_death_detail(
                properties,
                detail.as_deref(),
            )),
        });
        self.dead.push((delivery, detail));
    }
}

/// Applies batches of deliveries; shared by every in-flight batch.
#[derive(Debug)]
pub(crate) struct Processor<H: Handler> {
    pub(crate) applier: Applier<H>,
    /// Bodies above this are invalid and never decoded.
    pub(crate) max_body_bytes: usize,
    /// What an ordered queue's parked keys may hold.
    pub(crate) parked_bounds: super::ParkedBounds,
    pub(crate) health: DatabaseHealth,
    pub(crate) stats: Arc<Stats>,
    /// The work queue's objects, and in them the retry policy: what a
    /// failure leads to.
    pub(crate) topology: Topology,
    /// Asked after each commit, when a check armed one.
    pub(crate) probe: probe::Armed,
    /// This worker among those sharing an ordered queue's slots: the same
    /// across its sessions, so that a reconnect is not a new member.
    pub(crate) member: uuid::Uuid,
}

impl<H: Handler> Processor<H> {
    pub(super) fn handler(&self) -> &H {
        self.applier.handler()
    }

    pub(super) fn store(&self) -> &Store {
        self.applier.store()
    }

    pub(super) fn retry(&self) -> &RetryPolicy {
        &self.topology.retry
    }

    /// Whether the policy holds the delivery through `failure` rather than
    /// counting it.
    fn holds(&self, failure: &Failure) -> bool {
        self.retry().after(failure.kind, 0) == Next::Hold
    }

    pub(super) fn event_id<'e>(&self, item: &'e Item<H::Event>) -> &'e str {
        self.handler().event_id(&item.event)
    }

    /// Decides every delivery of `batch`. Returns only once each is decided,
    /// which may be long while the database is unavailable.
    /// `slot` is the batch's place among the transactions in flight,
    /// given up once its transaction committed and only its flush is left.
    pub(crate) async fn process(
        &self,
        batch: Vec<Delivery>,
        queue: &str,
        keys: Option<&SlotKeys>,
        slot: &mut Option<OwnedSemaphorePermit>,
    ) -> Decided {
        self.stats.received(batch.len() as u64);
        let mut decided = Decided {
            settlements: Vec::with_capacity(batch.len()),
            queue: queue.to_owned(),
            ..Decided::default()
        };
        let mut items = Vec::with_capacity(batch.len());
        for delivery in batch {
            let decoded = self.decode(&delivery.data).and_then(|event| {
                self.check_ordering(&delivery, &event)?;
                Ok(event)
            });
            match decoded {
                Ok(event) => items.push(Item {
                    delivery_count: delivery_count(&delivery),
                    delivery,
                    event,
                }),
                Err(invalid) => {
                    warn!(
                        delivery.tag = delivery.delivery_tag,
                        delivery.redelivered = delivery.redelivered,
                        message.id = delivery.properties.message_id().as_ref().map(|id| id.as_str()),
                        body.bytes = delivery.data.len(),
                        reason = %invalid,
                        "invalid message: dead-lettering it"
                    );
                    self.stats.invalid(1);
                    let reason = invalid.to_string();
                    self.give_up(
                        &mut decided,
                        delivery,
                        None,
                        Some(reason.clone()),
                        &reason,
                        None,
                    );
                }
            }
        }
        if let Some(keys) = keys {
            // A later batch of the slot with one of these keys waits for
            // this one whole.
            self.apply_in_order(items, &mut decided, keys).await;
        } else {
            self.apply(items, &mut decided, Some(slot)).await;
        }
        self.index(&decided.dead_letters, &decided.given_up).await;
        if self.probe.is_some() && !decided.dead_letters.is_empty() {
            let keys: Vec<&str> = decided
                .dead_letters
                .iter()
                .map(|l| l.key.as_str())
                .collect();
            probe::reach(&self.probe, Point::DeadLettered, &keys).await;
        }
        decided
    }

    /// Dead-letters `item`, whose transaction failed for good with `failure`.
    pub(super) fn give_up_failed(
        &self,
        decided: &mut Decided,
        item: Item<H::Event>,
        failure: &Failure,
    ) {
        self.stats.dead_lettered(1);
        let error = Some(failure.reason.clone());
        self.give_up(
            decided,
            item.delivery,
            Some(&item.event),
            error,
            &failure.reason,
            failure.detail.clone(),
        );
    }

    /// Dead-letters `delivery` (of `event`, when it is a valid one; `error`
    /// for the index when the failure ledger does not say), with the
    /// messages the handler sends when it gives up on it, for `why` (and
    /// the handler's detail of it).
    fn give_up(
        &self,
        decided: &mut Decided,
        delivery: Delivery,
        event: Option<&H::Event>,
        error: Option<String>,
        why: &str,
        detail: Option<String>,
    ) {
        let event_id = event.map(|event| self.handler().event_id(event).to_owned());
        decided.given_up.extend(self.given_up_messages(
            event,
            &delivery.data,
            delivery.properties.headers().as_ref(),
            why,
        ));
        decided.dead_letter(delivery, event_id.as_deref(), error, detail);
    }

    /// What the handler sends when idem gives up on a message (`body`,
    /// with `headers`; of `event`, when it is a valid one) for `why`, if
    /// anything.
    pub(super) fn given_up_messages(
        &self,
        event: Option<&H::Event>,
        body: &[u8],
        headers: Option<&lapin::types::FieldTable>,
        why: &str,
    ) -> Option<GivenUpMessages> {
        let given_up = match event {
            Some(event) => GivenUp::Event { event, error: why },
            None => GivenUp::Invalid { body, reason: why },
        };
        let messages =
            caught::call(|| self.handler().given_up(&given_up)).unwrap_or_else(|panic| {
                warn!(%panic, "the handler's given_up panicked: no message says this letter died");
                Vec::new()
            });
        (!messages.is_empty()).then(|| GivenUpMessages {
            key: event.map_or_else(
                || body_key(body),
                |event| event_key(self.handler().event_id(event)),
            ),
            replays: replays(headers),
            messages,
        })
    }

    /// Writes the batch's dead letters into the index, before they are
    /// rejected: the index never lacks a letter idem dead-lettered. While
    /// the database is unavailable the batch waits, as any; a write it
    /// refuses is logged, and the next `idem dlq sync` finds the letters.
    async fn index(&self, letters: &[DeadLetter], given_up: &[GivenUpMessages]) {
        if letters.is_empty() {
            return;
        }
        let written = self
            .until_database_answers(
                || self.store().dead_lettered(letters, given_up),
                |error| error.kind() == FailureKind::Infrastructure,
            )
            .await;
        if let Err(error) = written {
            warn!(
                %error,
                letters = letters.len(),
                "cannot write the dead-letter index; `{} dlq sync` will find these letters",
                crate::program::name()
            );
        }
    }

    fn decode(&self, body: &[u8]) -> Result<H::Event, Invalid> {
        decode(self.handler(), body, self.max_body_bytes)
    }

    /// Applies `items` in one transaction; when that fails for a message
    /// reason and there is more than one, applies them one by one so that a
    /// poison message cannot hold back the others.
    pub(super) async fn apply(
        &self,
        mut items: Vec<Item<H::Event>>,
        decided: &mut Decided,
        slot: Option<&mut Option<OwnedSemaphorePermit>>,
    ) {
        if items.iter().any(|item| item.delivery.redelivered) {
            items = self.dead_letter_exhausted(items, decided).await;
        }
        if items.is_empty() {
            return;
        }
        let events: Vec<&H::Event> = items.iter().map(|item| &item.event).collect();
        // Only a failed attempt writes the ledger: first deliveries have
        // nothing there to clear.
        let first_deliveries = !items.iter().any(|item| {
            may_follow_an_attempt(
                item.delivery.redelivered,
                item.delivery.properties.headers().as_ref(),
            )
        });
        let outcome = self.commit_on_disk(&events, first_deliveries, slot).await;
        if outcome.is_ok() && self.probe.is_some() {
            let ids: Vec<&str> = items.iter().map(|item| self.event_id(item)).collect();
            probe::reach(&self.probe, Point::AfterCommit, &ids).await;
        }
        let outcome = outcome.map(|mut claimed| {
            items
                .iter()
                .map(|item| claimed.take(self.event_id(item)))
                .collect::<Vec<bool>>()
        });
        match outcome {
            Ok(went_in) => self.acked(items, &went_in, decided),
            Err(failure) if items.len() > 1 => {
                info!(batch.size = items.len(), %failure, "batch transaction failed: applying its messages one by one");
                if self.probe.is_some() {
                    let ids: Vec<&str> = items.iter().map(|item| self.event_id(item)).collect();
                    probe::reach(&self.probe, Point::BatchFailed, &ids).await;
                }
                for item in items {
                    Box::pin(self.apply(vec![item], decided, None)).await;
                }
            }
            Err(failure) => {
                for item in items {
                    self.failed(item, &failure, decided).await;
                }
            }
        }
    }

    /// Applies `items`, none redelivered, in one transaction, and acks
    /// them; when that fails for any reason, gives them back undecided,
    /// for the caller to apply another way.
    pub(super) async fn apply_whole(
        &self,
        items: Vec<Item<H::Event>>,
        decided: &mut Decided,
    ) -> Result<(), Vec<Item<H::Event>>> {
        let events: Vec<&H::Event> = items.iter().map(|item| &item.event).collect();
        let first_deliveries = !items.iter().any(|item| {
            may_follow_an_attempt(
                item.delivery.redelivered,
                item.delivery.properties.headers().as_ref(),
            )
        });
        let Ok(mut claimed) = self.commit_on_disk(&events, first_deliveries, None).await else {
            drop(events);
            return Err(items);
        };
        if self.probe.is_some() {
            let ids: Vec<&str> = items.iter().map(|item| self.event_id(item)).collect();
            probe::reach(&self.probe, Point::AfterCommit, &ids).await;
        }
        let went_in: Vec<bool> = items
            .iter()
            .map(|item| claimed.take(self.event_id(item)))
            .collect();
        drop(events);
        self.acked(items, &went_in, decided);
        Ok(())
    }

    /// Commits `events` and returns what they claimed once a flush found it
    /// on disk: a commit that did not wait for its own flush waits for a
    /// flush to find its records, and runs again when one did not (an event
    /// it put in is then a duplicate, and counts as applied here still).
    /// Gives up `slot` once the transaction committed, so that another
    /// batch may start.
    async fn commit_on_disk<'e>(
        &self,
        events: &[&'e H::Event],
        first_deliveries: bool,
        mut slot: Option<&mut Option<OwnedSemaphorePermit>>,
    ) -> Result<Claimed<'e>, Failure> {
        // The handler's statements, as a span of their own when traced.
        let transaction = if trace::on() {
            info_span!(
                "transaction",
                otel.name = "idem transaction",
                db.system.name = "postgresql",
                events = events.len()
            )
        } else {
            Span::none()
        };
        let (mut earlier, mut pause) = (None, crate::store::RERUN_PAUSE);
        loop {
            let started = std::time::Instant::now();
            let committed = self
                .until_database_answers(
                    || self.applier.commit(events, first_deliveries),
                    |failure: &Failure| self.holds(failure),
                )
                .instrument(transaction.clone())
                .await;
            self.stats.transaction(events.len(), started.elapsed());
            let committed = committed?.after(earlier.take());
            if let Some(slot) = &mut slot {
                slot.take();
            }
            if self.applier.flushed(&committed).await {
                return Ok(committed.claimed);
            }
            self.stats.unconfirmed();
            debug!(
                events = events.len(),
                "a flush did not find what the transaction put in: running it again"
            );
            // Not at once: a flush that keeps failing would spin.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(self.retry().max_hold_backoff());
            earlier = Some(committed);
        }
    }

    /// Acks `items` whose transaction committed, each applied or a
    /// duplicate as `went_in` says.
    fn acked(&self, items: Vec<Item<H::Event>>, went_in: &[bool], decided: &mut Decided) {
        for (item, went_in) in items.into_iter().zip(went_in) {
            let event_id = self.event_id(&item);
            if *went_in {
                self.stats.applied(1);
                debug!(delivery.tag = item.tag(), event.id = %event_id, "applied");
            } else {
                self.stats.duplicates(1);
                debug!(delivery.tag = item.tag(), event.id = %event_id, "duplicate: acked without effect");
            }
            if let Some(latency) = since_published(&item.delivery) {
                self.stats.latency(latency);
            }
            decided.settle(item.tag(), Disposition::Ack);
        }
    }

    /// Dead-letters, without another attempt, the redelivered items whose
    /// budget is already spent: the worker stopped after counting their last
    /// failure and before the broker heard of it.
    async fn dead_letter_exhausted(
        &self,
        items: Vec<Item<H::Event>>,
        decided: &mut Decided,
    ) -> Vec<Item<H::Event>> {
        let ids: Vec<&str> = items
            .iter()
            .filter(|item| item.delivery.redelivered)
            .map(|item| self.event_id(item))
            .collect();
        let exhausted = match self
            .until_database_answers(
                || self.store().exhausted(&ids, self.retry().attempts()),
                |error| error.kind() == FailureKind::Infrastructure,
            )
            .await
        {
            Ok(exhausted) => exhausted,
            // The ledger cannot be read: attempt them; a failure is counted anyway.
            Err(_) => return items,
        };
        let (spent, rest): (Vec<_>, Vec<_>) = items.into_iter().partition(|item| {
            item.delivery.redelivered && exhausted.iter().any(|id| id == self.event_id(item))
        });
        for item in spent {
            warn!(
                delivery.tag = item.tag(),
                event.id = %self.event_id(&item),
                max_attempts = self.retry().attempts(),
                "out of attempts before the last restart: dead-lettering it"
            );
            let why = format!("used up its {} attempts", self.retry().attempts());
            if self.topology.is_ordered() {
                // Its key waits for it, dead-lettered, as after any last
                // failure.
                let spent = Failure::new(FailureKind::Permanent, why);
                self.park_failed(item, &spent, decided).await;
                continue;
            }
            self.stats.dead_lettered(1);
            self.give_up(decided, item.delivery, Some(&item.event), None, &why, None);
        }
        rest
    }

    /// This message's transaction failed and rolled back: count the failure,
    /// then send it to wait for its next attempt (or give it back at once,
    /// for a delay of zero), or dead-letter it once it has used up its
    /// attempts. A failure that cannot be counted has not been: the delivery
    /// is held, as in an outage, until the ledger takes it; returning it
    /// uncounted would let the broker's delivery limit dead-letter a message
    /// idem never gave up on.
    async fn failed(&self, item: Item<H::Event>, failure: &Failure, decided: &mut Decided) {
        if self.topology.is_ordered() {
            return self.park_failed(item, failure, decided).await;
        }
        let event_id = self.event_id(&item).to_owned();
        let event_id = event_id.as_str();
        // The budget is the event's: a copy that arrives after it was spent
        // (published twice, or replayed from elsewhere) spends nothing more.
        // Asked here, on the failure path, so that no batch pays for it.
        let ids = [event_id];
        let spent_before = self
            .until_database_answers(
                || self.store().exhausted(&ids, self.retry().attempts()),
                |error| error.kind() == FailureKind::Infrastructure,
            )
            .await
            .is_ok_and(|exhausted| !exhausted.is_empty());
        if spent_before {
            warn!(
                delivery.tag = item.tag(),
                event.id = %event_id,
                max_attempts = self.retry().attempts(),
                error = %failure,
                error.detail = failure.detail.as_deref(),
                "transaction failed and the event was out of attempts before this copy arrived: \
                 dead-lettering it"
            );
            self.stats.failed(1);
            self.give_up_failed(decided, item, failure);
            return;
        }
        let (failures, next) = self.count_failure(event_id, failure).await;
        let outcome = match next {
            Next::DeadLetter(GiveUp::Permanent) => {
                "the handler says the message can never apply: dead-lettering it now"
            }
            Next::DeadLetter(_) => {
                "transaction failed and the message is out of attempts: dead-lettering it"
            }
            Next::Now => "transaction failed: returning the message for another attempt",
            Next::Wait(_) => "transaction failed: the message waits for its next attempt",
            Next::Hold => unreachable!("a failure of the infrastructure is held, never counted"),
        };
        warn!(
            delivery.tag = item.tag(),
            delivery.redelivered = item.delivery.redelivered,
            delivery.count = item.delivery_count,
            event.id = %event_id,
            attempt = failures,
            max_attempts = self.retry().attempts(),
            retry.delay_ms = match next {
                Next::Wait(delay) => Some(delay.as_millis() as u64),
                Next::Now => Some(0),
                _ => None,
            },
            error = %failure,
            error.detail = failure.detail.as_deref(),
            "{outcome}"
        );
        match next {
            Next::Now => {
                self.stats.retried(1, Duration::ZERO);
                decided.settle(item.tag(), Disposition::Retry);
            }
            Next::Wait(delay) => {
                self.stats.retried(1, delay);
                decided.waiting.push(Waiting {
                    delivery: item.delivery,
                    delay,
                });
            }
            Next::DeadLetter(_) | Next::Hold => self.give_up_failed(decided, item, failure),
        }
    }

    /// Counts a genuine failure of `event_id` in the failure ledger (held,
    /// as in an outage, until the ledger takes it: a failure returned
    /// uncounted would let the broker's delivery limit dead-letter a message
    /// idem never gave up on); the failures so far and what the policy says
    /// follows.
    pub(super) async fn count_failure(&self, event_id: &str, failure: &Failure) -> (u32, Next) {
        let counted = self
            .until_database_answers(
                || self.store().record_failure(event_id, &failure.reason),
                |_| true,
            )
            .await;
        let Ok(failures) = counted else {
            unreachable!("every error of the ledger is retried");
        };
        self.stats.failed(1);
        (failures, self.retry().after(failure.kind, failures))
    }

    /// Runs `operation` until it succeeds or fails with an error `held` does
    /// not hold it for; while it is held, waits with exponential backoff and
    /// jitter, however long that takes, and keeps the intake closed.
    pub(super) async fn until_database_answers<T, E, F, Fut>(
        &self,
        operation: F,
        held: impl Fn(&E) -> bool,
    ) -> Result<T, E>
    where
        E: Display,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut hold: Option<Hold<'_>> = None;
        let result = operation
            .retry(self.retry().hold())
            .sleep(tokio::time::sleep)
            .when(|error: &E| held(error))
            .notify(|error, wait| {
                if hold.is_none() {
                    hold = Some(self.health.hold(error));
                }
                self.stats.infrastructure_retries(1);
                debug!(%error, wait_ms = wait.as_millis() as u64, "database unavailable; retrying");
            })
            .await;
        if let Some(hold) = hold {
            hold.release();
        }
        result
    }
}

/// `handler`'s event of `body`, checked against idem's own rules: a body
/// of at most `max_body_bytes`, a usable deduplication key. A handler that
/// panics on a body finds it invalid.
pub(crate) fn decode<H: Handler>(
    handler: &H,
    body: &[u8],
    max_body_bytes: usize,
) -> Result<H::Event, Invalid> {
    if body.len() > max_body_bytes {
        return Err(Invalid::new(format!(
            "body is {} bytes, above the limit of {max_body_bytes} bytes",
            body.len()
        )));
    }
    let event = caught::call(|| handler.decode(body))
        .map_err(|panic| Invalid::new(format!("decoding it {panic}")))??;
    caught::call(|| check_event_id(handler.event_id(&event)))
        .map_err(|panic| Invalid::new(format!("reading its event id {panic}")))??;
    Ok(event)
}

/// How long ago the producer published `delivery`: from its
/// `timestamp_in_ms` header when it has one (milliseconds; `idem publish`
/// and RabbitMQ's message-timestamp plugin set it), else from its
/// `timestamp` property (seconds).
fn since_published(delivery: &Delivery) -> Option<Duration> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?;
    let properties = &delivery.properties;
    let millis = properties
        .headers()
        .as_ref()
        .and_then(|headers| integer(headers.inner().get("timestamp_in_ms")?));
    let published = match (millis, properties.timestamp()) {
        (Some(millis), _) => Duration::from_millis(u64::try_from(millis).ok()?),
        (None, Some(seconds)) => Duration::from_secs(*seconds),
        (None, None) => return None,
    };
    now.checked_sub(published)
}

fn integer(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::Timestamp(n) => i64::try_from(*n).ok(),
        _ => None,
    }
}

/// The `x-delivery-count` header a quorum queue puts on redeliveries.
fn delivery_count(delivery: &Delivery) -> Option<i64> {
    let headers = delivery.properties.headers().as_ref()?;
    integer(headers.inner().get("x-delivery-count")?)
}
