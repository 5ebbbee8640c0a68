//! Taking deliveries off the consumer in batches: up to `size` deliveries,
//! or what arrived within `wait` of the first.

use std::time::Duration;

use futures::StreamExt;
use lapin::Consumer;
use lapin::message::Delivery;
use tokio::time::Instant;

/// Reads batches from a consumer. Every delivery read is returned in a batch:
/// none is dropped, so delivery tags reach the settler in order.
pub(crate) struct Intake {
    consumer: Consumer,
    size: usize,
    wait: Duration,
}

impl Intake {
    pub(crate) fn new(consumer: Consumer, size: usize, wait: Duration) -> Self {
        Self {
            consumer,
            size: size.max(1),
            wait,
        }
    }

    /// The next batch; `Ok(None)` once the consumer was cancelled and every
    /// delivery buffered before the cancel was handed out.
    pub(crate) async fn next_batch(&mut self) -> lapin::Result<Option<Vec<Delivery>>> {
        let first = match self.consumer.next().await {
            Some(delivery) => delivery?,
            None => return Ok(None),
        };
        let mut batch = Vec::with_capacity(self.size);
        batch.push(first);
        let deadline = Instant::now() + self.wait;
        while batch.len() < self.size {
            // `Consumer::next` loses nothing when the timeout drops it.
            match tokio::time::timeout_at(deadline, self.consumer.next()).await {
                Ok(Some(delivery)) => batch.push(delivery?),
                Ok(None) | Err(_) => break,
            }
        }
        Ok(Some(batch))
    }
}
