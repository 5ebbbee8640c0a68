//! Parked keys, applied once their head is due: beside the consumer of an
//! ordered queue, a worker takes the keys whose head waited long enough
//! (each leased to it, so that two workers never drain one key), and
//! applies each key's parked events oldest first, one transaction each. A
//! head that fails again waits again, or is dead-lettered once it has
//! used up its attempts; the key stays parked behind it either way. The
//! key is unparked with its last event, and the slot's next event of the
//! key then applies as any.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::process::{DEAD_LETTER_REASON, Processor, decode};
use crate::broker::death::dead_letter_properties;
use crate::broker::{AmqpConfig, ConfirmChannel, Outgoing, connect};
use crate::handler::{FailureKind, Handler};
use crate::retry::Next;
use crate::store::dead_letters::event_key;
use crate::store::{DeadLetter, ParkedEvent, StoreError};

/// How often a worker looks for parked keys whose head is due.
const POLL: Duration = Duration::from_millis(200);

/// How long a key is the draining worker's: past it, another worker takes
/// it (the first one died).
const LEASE: Duration = Duration::from_secs(60);

/// Keys taken at once.
const KEYS_AT_ONCE: i64 = 16;

/// Events of a key read at once.
const EVENTS_AT_ONCE: i64 = 100;

/// How often the parked keys and their events are counted, for the
/// `idem_parked_keys` and `idem_parked_events` gauges.
const COUNT_EVERY: Duration = Duration::from_secs(5);

/// The wait before a head is tried again after the database or the broker
/// failed (not the event: its attempts are not spent).
const OUTAGE_PAUSE: Duration = Duration::from_secs(1);

/// Drains the parked keys that are due until `shutdown` fires.
pub(super) async fn run<H: Handler>(
    processor: Arc<Processor<H>>,
    amqp: AmqpConfig,
    shutdown: CancellationToken,
) {
    let mut drainer = Drainer {
        processor,
        amqp,
        broker: None,
    };
    let mut counted: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            () = shutdown.cancelled() => return,
        }
        if counted.is_none_or(|at| at.elapsed() >= COUNT_EVERY) {
            counted = Some(tokio::time::Instant::now());
            match drainer.store().parked_totals().await {
                Ok(totals) => drainer
                    .processor
                    .stats
                    .parked_now(totals.keys, totals.events),
                Err(error) => debug!(%error, "cannot count the parked keys"),
            }
        }
        let keys = match drainer.store().due_keys(KEYS_AT_ONCE, LEASE).await {
            Ok(keys) => keys,
            Err(error) => {
                debug!(%error, "cannot look for parked keys that are due");
                continue;
            }
        };
        for key in keys {
            if shutdown.is_cancelled() {
                // The lease runs out, and a worker takes the key again.
                return;
            }
            if let Err(error) = drainer.drain(&key).await {
                warn!(%error, ordering.key = %key, "cannot drain a parked key: it is tried again once its lease ends");
            }
        }
    }
}

/// What drains: the worker's processor, and a broker connection opened for
/// the first dead letter.
struct Drainer<H: Handler> {
    processor: Arc<Processor<H>>,
    amqp: AmqpConfig,
    broker: Option<(lapin::Connection, ConfirmChannel)>,
}

impl<H: Handler> Drainer<H> {
    fn store(&self) -> &crate::store::Store {
        self.processor.applier.store()
    }

    /// Applies `key`'s parked events oldest first, until one fails (it
    /// waits or dies, the key parked behind it) or none is left (the key
    /// is unparked).
    async fn drain(&mut self, key: &str) -> Result<(), StoreError> {
        loop {
            let events = self.store().parked_events(key, EVENTS_AT_ONCE).await?;
            if events.is_empty() {
                if self.store().finish_key(key).await? {
                    info!(ordering.key = %key, "parked key applied in order: unparked");
                    return Ok(());
                }
                continue;
            }
            for event in events {
                if !self.apply(key, event).await? {
                    return Ok(());
                }
            }
        }
    }

    /// Applies one parked event; false when it failed and holds the key.
    async fn apply(&mut self, key: &str, parked: ParkedEvent) -> Result<bool, StoreError> {
        let processor = Arc::clone(&self.processor);
        let event = match decode(
            processor.applier.handler(),
            &parked.body,
            processor.max_body_bytes,
        ) {
            Ok(event) => event,
            Err(invalid) => {
                // Decoded when it was parked: a handler that changed since.
                let reason = invalid.to_string();
                processor.stats.invalid(1);
                self.dead_letter(key, &parked, None, (&reason, None))
                    .await?;
                return Ok(false);
            }
        };
        match processor.applier.apply(&[&event]).await {
            Ok(mut claimed) => {
                if claimed.take(&parked.event_id) {
                    processor.stats.applied(1);
                } else {
                    processor.stats.duplicates(1);
                }
                self.store().unpark(&parked.event_id).await?;
                debug!(event.id = %parked.event_id, ordering.key = %key, "parked event applied");
                Ok(true)
            }
            Err(failure) if failure.kind == FailureKind::Infrastructure => {
                processor.stats.infrastructure_retries(1);
                self.store()
                    .head_waits(key, &parked.event_id, OUTAGE_PAUSE, &failure.reason)
                    .await?;
                Ok(false)
            }
            Err(failure) => {
                let failures = self
                    .store()
                    .record_failure(&parked.event_id, &failure.reason)
                    .await?;
                processor.stats.failed(1);
                match processor.retry().after(failure.kind, failures) {
                    Next::Now | Next::Hold => {
                        processor.stats.retried(1, Duration::ZERO);
                        self.store()
                            .head_waits(key, &parked.event_id, Duration::ZERO, &failure.reason)
                            .await?;
                    }
                    Next::Wait(delay) => {
                        warn!(
                            event.id = %parked.event_id,
                            ordering.key = %key,
                            attempt = failures,
                            error = %failure,
                            "a parked key's head failed again: it waits for its next attempt"
                        );
                        processor.stats.retried(1, delay);
                        self.store()
                            .head_waits(key, &parked.event_id, delay, &failure.reason)
                            .await?;
                    }
                    Next::DeadLetter(_) => {
                        warn!(
                            event.id = %parked.event_id,
                            ordering.key = %key,
                            attempt = failures,
                            error = %failure,
                            "a parked key's head is out of attempts: dead-lettering it; its key stays parked until it is replayed or released"
                        );
                        processor.stats.dead_lettered(1);
                        let why = (failure.reason.as_str(), failure.detail.as_deref());
                        self.dead_letter(key, &parked, Some(&event), why).await?;
                    }
                }
                Ok(false)
            }
        }
    }

    /// Dead-letters the parked head `parked` (of `event`, when it decodes;
    /// written into the dead-letter index first, with what the handler
    /// sends when it gives up, then confirmed by the broker), then marks
    /// its key's head dead, for `error` (and the handler's detail of it).
    /// When the broker does not take it, the head waits and is tried again.
    async fn dead_letter(
        &mut self,
        key: &str,
        parked: &ParkedEvent,
        event: Option<&H::Event>,
        (error, detail): (&str, Option<&str>),
    ) -> Result<(), StoreError> {
        let processor = Arc::clone(&self.processor);
        let topology = &processor.topology;
        let properties = parked.properties.clone().unwrap_or(Value::Null);
        let original = crate::broker::json::properties_from_json(&properties);
        let given_up: Vec<_> = processor
            .given_up_messages(event, &parked.body, original.headers().as_ref(), error)
            .into_iter()
            .collect();
        let letter = DeadLetter {
            key: event_key(&parked.event_id),
            event_id: Some(parked.event_id.clone()),
            queue: parked.queue.clone(),
            reason: DEAD_LETTER_REASON.to_owned(),
            invalid: false,
            error: Some(error.to_owned()),
            dead_at: None,
            body: Some(parked.body.clone()),
            properties: Some(crate::broker::json::with_death_detail(
                properties.clone(),
                detail,
            )),
        };
        self.store().dead_lettered(&[letter], &given_up).await?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let message = Outgoing {
            exchange: topology.dead_letter_exchange.clone(),
            routing_key: topology.queue.clone(),
            body: parked.body.clone(),
            properties: dead_letter_properties(
                &original,
                "",
                &parked.queue,
                &parked.queue,
                DEAD_LETTER_REASON,
                now.as_secs(),
                detail,
            ),
        };
        if let Err(why) = self.publish(&message).await {
            warn!(event.id = %parked.event_id, ordering.key = %key, %why, "cannot dead-letter a parked key's head: it is tried again");
            return self
                .store()
                .head_waits(key, &parked.event_id, OUTAGE_PAUSE, error)
                .await;
        }
        self.store().head_dies(key, &parked.event_id, error).await
    }

    /// Publishes `message` and waits for its confirm, on the drainer's
    /// connection (opened now if it has none, or lost it).
    async fn publish(&mut self, message: &Outgoing) -> Result<(), String> {
        if self.broker.is_none() {
            let connection = connect(&self.amqp, "idem parked keys")
                .await
                .map_err(|error| error.to_string())?;
            let channel = ConfirmChannel::open(&connection)
                .await
                .map_err(|error| error.to_string())?;
            self.broker = Some((connection, channel));
        }
        let Some((_, channel)) = &self.broker else {
            unreachable!("opened above");
        };
        match channel.publish(message).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(refusal)) => Err(refusal.to_string()),
            Err(error) => {
                self.broker = None;
                Err(error.to_string())
            }
        }
    }
}
