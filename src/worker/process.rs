//! Handling a batch of deliveries: parse, apply in one transaction, and
//! decide what the broker is told. All failure handling lives here.
//!
//! - invalid message: dead-letter at once;
//! - this message failed: count it in the failure ledger and give it back,
//!   or dead-letter it once it has used up its attempts;
//! - infrastructure unavailable: hold the deliveries and retry with backoff,
//!   never spending a message's attempts on an outage.

use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, DeliveryTag};
use tracing::{debug, info, warn};

use super::health::DatabaseHealth;
use super::settle::{Disposition, Settlement};
use super::stats::Stats;
use crate::event::PaymentSucceeded;
use crate::store::{FailureKind, Store, StoreError};

/// A delivery whose body is a valid event.
struct Item {
    tag: DeliveryTag,
    redelivered: bool,
    /// The quorum queue's count of earlier deliveries, when it set one.
    delivery_count: Option<i64>,
    event: PaymentSucceeded,
}

/// Applies batches of deliveries; shared by every in-flight batch.
#[derive(Debug)]
pub(crate) struct Processor {
    pub(crate) store: Store,
    /// Genuine failures after which a message is dead-lettered.
    pub(crate) max_attempts: u32,
    /// Bodies above this are invalid and never parsed.
    pub(crate) max_body_bytes: usize,
    pub(crate) health: DatabaseHealth,
    pub(crate) stats: Arc<Stats>,
    /// Longest wait between two attempts while the database is unavailable.
    pub(crate) max_hold_backoff: Duration,
}

impl Processor {
    /// Decides every delivery of `batch`. Returns only once each is decided,
    /// which may be long while the database is unavailable.
    pub(crate) async fn process(&self, batch: Vec<Delivery>) -> Vec<Settlement> {
        self.stats.received(batch.len() as u64);
        let mut settlements = Vec::with_capacity(batch.len());
        let mut items = Vec::with_capacity(batch.len());
        for delivery in batch {
            match PaymentSucceeded::parse(&delivery.data, self.max_body_bytes) {
                Ok(event) => items.push(Item {
                    tag: delivery.delivery_tag,
                    redelivered: delivery.redelivered,
                    delivery_count: delivery_count(&delivery),
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
                    settlements.push(Settlement {
                        tag: delivery.delivery_tag,
                        disposition: Disposition::DeadLetter,
                    });
                }
            }
        }
        self.apply(items, &mut settlements).await;
        settlements
    }

    /// Applies `items` in one transaction; when that fails for a message
    /// reason and there is more than one, applies them one by one so that a
    /// poison message cannot hold back the others.
    async fn apply(&self, mut items: Vec<Item>, settlements: &mut Vec<Settlement>) {
        if items.iter().any(|item| item.redelivered) {
            items = self.dead_letter_exhausted(items, settlements).await;
        }
        if items.is_empty() {
            return;
        }
        let events: Vec<&PaymentSucceeded> = items.iter().map(|item| &item.event).collect();
        let outcome = self
            .until_database_answers(|| self.store.apply(&events))
            .await
            .map(|mut claimed| {
                items
                    .iter()
                    .map(|item| claimed.take(&item.event.event_id))
                    .collect::<Vec<bool>>()
            });
        match outcome {
            Ok(went_in) => {
                for (item, went_in) in items.into_iter().zip(went_in) {
                    if went_in {
                        self.stats.applied(1);
                        debug!(delivery.tag = item.tag, event.id = %item.event.event_id, "applied");
                    } else {
                        self.stats.duplicates(1);
                        debug!(delivery.tag = item.tag, event.id = %item.event.event_id, "duplicate: acked without effect");
                    }
                    settlements.push(Settlement {
                        tag: item.tag,
                        disposition: Disposition::Ack,
                    });
                }
            }
            Err(error) if items.len() > 1 => {
                info!(batch.size = items.len(), %error, "batch transaction failed: applying its messages one by one");
                for item in items {
                    Box::pin(self.apply(vec![item], settlements)).await;
                }
            }
            Err(error) => {
                for item in items {
                    settlements.push(self.failed(item, &error).await);
                }
            }
        }
    }

    /// Dead-letters, without another attempt, the redelivered items whose
    /// budget is already spent: the worker stopped after counting their last
    /// failure and before the broker heard of it.
    async fn dead_letter_exhausted(
        &self,
        items: Vec<Item>,
        settlements: &mut Vec<Settlement>,
    ) -> Vec<Item> {
        let ids: Vec<&str> = items
            .iter()
            .filter(|item| item.redelivered)
            .map(|item| item.event.event_id.as_str())
            .collect();
        let exhausted = match self
            .until_database_answers(|| self.store.exhausted(&ids, self.max_attempts))
            .await
        {
            Ok(exhausted) => exhausted,
            // The ledger cannot be read: attempt them; a failure is counted anyway.
            Err(_) => return items,
        };
        let (spent, rest): (Vec<Item>, Vec<Item>) = items
            .into_iter()
            .partition(|item| item.redelivered && exhausted.contains(&item.event.event_id));
        for item in spent {
            warn!(
                delivery.tag = item.tag,
                event.id = %item.event.event_id,
                max_attempts = self.max_attempts,
                "out of attempts before the last restart: dead-lettering it"
            );
            self.stats.dead_lettered(1);
            settlements.push(Settlement {
                tag: item.tag,
                disposition: Disposition::DeadLetter,
            });
        }
        rest
    }

    /// This message's transaction failed and rolled back: count the failure,
    /// then give it back for another attempt or dead-letter it.
    async fn failed(&self, item: Item, error: &StoreError) -> Settlement {
        let text = error.to_string();
        let failures = match self
            .until_database_answers(|| self.store.record_failure(&item.event.event_id, &text))
            .await
        {
            Ok(failures) => failures,
            Err(ledger_error) => {
                // Counting failed for a reason of its own; the broker's
                // delivery limit remains the backstop.
                warn!(event.id = %item.event.event_id, %ledger_error, "could not count the failure");
                0
            }
        };
        let disposition = if failures >= self.max_attempts {
            self.stats.dead_lettered(1);
            Disposition::DeadLetter
        } else {
            self.stats.retried(1);
            Disposition::Retry
        };
        warn!(
            delivery.tag = item.tag,
            delivery.redelivered = item.redelivered,
            delivery.count = item.delivery_count,
            event.id = %item.event.event_id,
            attempt = failures,
            max_attempts = self.max_attempts,
            %error,
            "{}",
            if disposition == Disposition::DeadLetter {
                "transaction failed and the message is out of attempts: dead-lettering it"
            } else {
                "transaction failed: returning the message for another attempt"
            }
        );
        Settlement {
            tag: item.tag,
            disposition,
        }
    }

    /// Runs `operation` until it succeeds or fails for a reason of the
    /// message's own; while the database is unavailable, waits with
    /// exponential backoff and jitter, however long that takes.
    async fn until_database_answers<T, F, Fut>(&self, operation: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let result = operation
            .retry(crate::backoff::forever(self.max_hold_backoff))
            .sleep(tokio::time::sleep)
            .when(|error: &StoreError| error.kind() == FailureKind::Infrastructure)
            .notify(|error, wait| {
                self.health.set_down(error);
                self.stats.infrastructure_retries(1);
                debug!(%error, wait_ms = wait.as_millis() as u64, "database unavailable; retrying");
            })
            .await;
        self.health.set_up();
        result
    }
}

/// The `x-delivery-count` header a quorum queue puts on redeliveries.
fn delivery_count(delivery: &Delivery) -> Option<i64> {
    let headers = delivery.properties.headers().as_ref()?;
    match headers.inner().get("x-delivery-count")? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}
