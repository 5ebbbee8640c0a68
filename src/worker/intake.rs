//! Taking deliveries off the consumer in batches: up to `size` deliveries,
//! or what arrived within `wait` of the first.

use std::time::Duration;

use futures::{FutureExt, StreamExt};
use lapin::Consumer;
use lapin::message::Delivery;
use tokio::time::Instant;

/// While a batch fills, how often it looks for more deliveries. Looking at
/// ticks instead of waking up for each delivery saves a thread hand-off per
/// message, which at tens of thousands of messages a second is most of the
/// worker's CPU.
const TICK: Duration = Duration::from_millis(1);

/// Reads batches from a consumer. Every delivery read is returned in a batch:
/// none is dropped, so delivery tags reach the settler in order.
pub(crate) struct Intake {
    consumer: Consumer,
    size: usize,
    wait: Duration,
    /// The consumer's stream ended; it must not be polled again.
    ended: bool,
}

impl Intake {
    pub(crate) fn new(consumer: Consumer, size: usize, wait: Duration) -> Self {
        Self {
            consumer,
            size: size.max(1),
            wait,
            ended: false,
        }
    }

    /// The next batch; `Ok(None)` once the consumer was cancelled and every
    /// delivery buffered before the cancel was handed out.
    pub(crate) async fn next_batch(&mut self) -> lapin::Result<Option<Vec<Delivery>>> {
        if self.ended {
            return Ok(None);
        }
        let Some(first) = self.consumer.next().await else {
            self.ended = true;
            return Ok(None);
        };
        let mut batch = Vec::with_capacity(self.size);
        batch.push(first?);
        let deadline = Instant::now() + self.wait;
        loop {
            self.take_buffered(&mut batch)?;
            let now = Instant::now();
            if batch.len() >= self.size || self.ended || now >= deadline {
                return Ok(Some(batch));
            }
            tokio::time::sleep(TICK.min(deadline - now)).await;
        }
    }

    /// Moves what the consumer has buffered into `batch`, without waiting.
    fn take_buffered(&mut self, batch: &mut Vec<Delivery>) -> lapin::Result<()> {
        while batch.len() < self.size {
            match self.consumer.next().now_or_never() {
                Some(Some(delivery)) => batch.push(delivery?),
                Some(None) => {
                    self.ended = true;
                    break;
                }
                None => break,
            }
        }
        Ok(())
    }
}
