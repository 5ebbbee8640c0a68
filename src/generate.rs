//! Generated loads of events, reproducible from a seed, with duplicates:
//! for demos, load tests and benchmarks.

use std::collections::{BTreeMap, HashSet};

use crate::points::PaymentSucceeded;

/// What to generate.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Messages in all, duplicates included.
    pub count: usize,
    /// Share of messages that repeat an earlier event (0.0 to 1.0).
    pub duplicate_ratio: f64,
    /// Orders the events are spread over.
    pub orders: usize,
    /// Seed of the random choices; the same seed gives the same load.
    pub seed: u64,
    /// Start of every event and order id, to keep loads apart.
    pub prefix: String,
}

/// The events of `spec`, in publishing order. An event that repeats is the
/// same event (id, order and points), as a producer retry would send it.
pub fn events(spec: &LoadSpec) -> Vec<PaymentSucceeded> {
    let mut rng = fastrand::Rng::with_seed(spec.seed);
    let mut events: Vec<PaymentSucceeded> = Vec::with_capacity(spec.count);
    let mut distinct = 0usize;
    for _ in 0..spec.count {
        if distinct > 0 && rng.f64() < spec.duplicate_ratio {
            let earlier = events[rng.usize(..events.len())].clone();
            events.push(earlier);
        } else {
            distinct += 1;
            events.push(PaymentSucceeded {
                event_id: format!("{}-event-{distinct}", spec.prefix),
                order_id: format!("{}-order-{}", spec.prefix, rng.usize(..spec.orders.max(1))),
                points: rng.i64(1..=100),
            });
        }
    }
    events
}

/// The points each order must end with once every event is applied once.
pub fn expected_points(events: &[PaymentSucceeded]) -> BTreeMap<String, i64> {
    let mut seen = HashSet::new();
    let mut totals = BTreeMap::new();
    for event in events {
        if seen.insert(event.event_id.as_str()) {
            *totals.entry(event.order_id.clone()).or_insert(0) += event.points;
        }
    }
    totals
}

/// How many distinct events `events` holds.
pub fn distinct_events(events: &[PaymentSucceeded]) -> usize {
    events
        .iter()
        .map(|e| e.event_id.as_str())
        .collect::<HashSet<_>>()
        .len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64) -> LoadSpec {
        LoadSpec {
            count: 10_000,
            duplicate_ratio: 0.2,
            orders: 50,
            seed,
            prefix: "t".into(),
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_load() {
        assert_eq!(events(&spec(7)), events(&spec(7)));
        assert_ne!(events(&spec(7)), events(&spec(8)));
    }

    #[test]
    fn duplicates_come_close_to_the_ratio_and_repeat_whole_events() {
        let load = events(&spec(1));
        let distinct = distinct_events(&load);
        let ratio = 1.0 - distinct as f64 / load.len() as f64;
        assert!((0.18..0.22).contains(&ratio), "duplicate ratio {ratio}");
        let mut by_id = BTreeMap::new();
        for event in &load {
            assert_eq!(by_id.entry(&event.event_id).or_insert(event), &event);
        }
    }

    #[test]
    fn expected_points_count_each_event_once() {
        let load = events(&spec(3));
        let total: i64 = expected_points(&load).values().sum();
        let once: i64 = load
            .iter()
            .map(|e| (e.event_id.as_str(), e.points))
            .collect::<BTreeMap<_, _>>()
            .values()
            .sum();
        assert_eq!(total, once);
    }
}
