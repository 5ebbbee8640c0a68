//! Generated loads of events, reproducible from a seed, with duplicates:
//! for demos, load tests and benchmarks.

use std::collections::{BTreeMap, HashMap, HashSet};

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

/// Gives every event of `events` a random UUID (version 4, from `seed`)
/// as its id, as many producers do; the copies of an event keep sharing
/// theirs. Random ids land all over the consume records' index, where
/// sequential ones append at its end.
pub fn with_uuid_ids(events: &mut [PaymentSucceeded], seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut ids: HashMap<String, String> = HashMap::new();
    for event in events {
        let id = ids
            .entry(event.event_id.clone())
            .or_insert_with(|| uuid_v4(&mut rng));
        event.event_id.clone_from(id);
    }
}

fn uuid_v4(rng: &mut fastrand::Rng) -> String {
    let bits = rng.u128(..);
    // Version 4 in bits 76 to 79, variant 0b10 in bits 62 and 63.
    let bits = (bits & !(0xf << 76)) | (0x4 << 76);
    let bits = (bits & !(0x3 << 62)) | (0x2 << 62);
    let hex = format!("{bits:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
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
    fn uuid_ids_are_version_4_and_shared_by_the_copies_of_an_event() {
        let mut load = events(&spec(5));
        let before = distinct_events(&load);
        let pairs: Vec<(String, i64, String)> = load
            .iter()
            .map(|e| (e.order_id.clone(), e.points, e.event_id.clone()))
            .collect();
        with_uuid_ids(&mut load, 9);
        assert_eq!(distinct_events(&load), before);
        let mut old_to_new = BTreeMap::new();
        for (event, (_, _, old)) in load.iter().zip(&pairs) {
            let id = &event.event_id;
            assert_eq!(id.len(), 36, "{id}");
            assert_eq!(&id[14..15], "4", "{id}");
            assert!("89ab".contains(&id[19..20]), "{id}");
            assert_eq!(old_to_new.entry(old.clone()).or_insert(id.clone()), id);
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
