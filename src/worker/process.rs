//! Handling a batch of deliveries: parse, apply in one transaction, and
//! decide what the broker is told. All failure handling lives here.
//!
//! - invalid message: dead-letter at once;
//! - this message failed: give it back, counting toward its attempts;
//! - infrastructure unavailable: hold the deliveries and retry with backoff,
//!   never spending a message's attempts on an outage.

use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
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
    async fn apply(&self, items: Vec<Item>, settlements: &mut Vec<Settlement>) {
        if items.is_empty() {
            return;
        }
        let events: Vec<&PaymentSucceeded> = items.iter().map(|item| &item.event).collect();
        match self
            .until_database_answers(|| self.store.apply(&events))
            .await
        {
            Ok(mut claimed) => {
                for item in items {
                    if claimed.take(&item.event.event_id) {
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
                    settlements.push(self.failed(item, &error));
                }
            }
        }
    }

    /// This message's transaction failed and rolled back.
    fn failed(&self, item: Item, error: &StoreError) -> Settlement {
        warn!(
            delivery.tag = item.tag,
            delivery.redelivered = item.redelivered,
            delivery.count = item.delivery_count,
            event.id = %item.event.event_id,
            %error,
            "transaction failed: returning the message for another attempt"
        );
        self.stats.retried(1);
        Settlement {
            tag: item.tag,
            disposition: Disposition::Retry,
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
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(self.max_hold_backoff)
            .with_jitter()
            .without_max_times();
        let result = operation
            .retry(backoff)
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
