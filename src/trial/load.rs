//! A run's load: its events' bodies, each several times, and extra copies
//! where a producer's retries would put them; published with confirms.

use std::time::Duration;

use anyhow::bail;
use tokio_util::sync::CancellationToken;

use crate::broker::{AmqpConfig, Outgoing, PublishOptions, publish_all};

/// A run's load: how often each event is in it, and how many consumers
/// share it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// How often each event is published.
    pub repeats: Repeats,
    /// Consumers at once: a lab's strategy's, or a check's workers.
    pub consumers: usize,
}

/// How a run's load repeats its events: what the lab and a check both
/// send, so that a duplicate is the same thing in both.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Repeats {
    /// Copies of every event, back to back.
    pub copies: usize,
    /// Extra copies of random events, as a share of them (0.1: one in
    /// ten), each at a random place.
    pub extra: f64,
    /// Seed of where the extra copies go.
    pub seed: u64,
}

impl Repeats {
    /// Every event once, nothing more.
    pub fn once(seed: u64) -> Self {
        Self {
            copies: 1,
            extra: 0.0,
            seed,
        }
    }

    /// The messages of `bodies` (one per event), in publishing order.
    pub fn of(&self, bodies: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut rng = fastrand::Rng::with_seed(self.seed);
        let mut load: Vec<Vec<u8>> = Vec::with_capacity(bodies.len() * self.copies);
        for body in bodies {
            for _ in 0..self.copies {
                load.push(body.clone());
            }
        }
        if bodies.is_empty() {
            return load;
        }
        let extra = (bodies.len() as f64 * self.extra).round() as usize;
        for _ in 0..extra {
            let copy = bodies[rng.usize(..bodies.len())].clone();
            load.insert(rng.usize(..=load.len()), copy);
        }
        load
    }
}

/// Publishes `bodies` as JSON to `exchange` with `routing_key`, with
/// publisher confirms and `mandatory`; an error unless the broker confirmed
/// every one within `patience`.
pub async fn publish(
    amqp: &AmqpConfig,
    exchange: &str,
    routing_key: &str,
    bodies: &[Vec<u8>],
    patience: Duration,
) -> anyhow::Result<()> {
    publish_keyed(amqp, exchange, routing_key, bodies, |_| None, patience).await
}

/// [`publish`], each body with the ordering key `key_of` gives it, if
/// any, in its header (as an ordered queue's producer sends it).
pub async fn publish_keyed(
    amqp: &AmqpConfig,
    exchange: &str,
    routing_key: &str,
    bodies: &[Vec<u8>],
    key_of: impl Fn(&[u8]) -> Option<String>,
    patience: Duration,
) -> anyhow::Result<()> {
    let messages: Vec<Outgoing> = bodies
        .iter()
        .map(|body| {
            let message = Outgoing::json(exchange, routing_key, body.clone());
            match key_of(body) {
                Some(key) => message.with_ordering_key(&key),
                None => message,
            }
        })
        .collect();
    let options = PublishOptions {
        window: 256,
        patience,
    };
    let report = publish_all(amqp, &messages, &options, &CancellationToken::new()).await?;
    if !report.all_confirmed() {
        bail!("the broker did not confirm every message of the load: {report:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_body_comes_copies_times_in_a_row_and_the_extra_copies_repeat_bodies() {
        let bodies: Vec<Vec<u8>> = (0..10).map(|n| vec![n]).collect();
        let repeats = |copies, extra| Repeats {
            copies,
            extra,
            seed: 7,
        };
        let plain = repeats(3, 0.0).of(&bodies);
        assert_eq!(plain.len(), 30);
        assert_eq!(&plain[..3], &[vec![0], vec![0], vec![0]]);
        let extra = repeats(1, 0.5).of(&bodies);
        assert_eq!(extra.len(), 15);
        assert!(extra.iter().all(|body| bodies.contains(body)));
        assert_eq!(
            extra,
            repeats(1, 0.5).of(&bodies),
            "the same seed, the same load"
        );
    }
}
