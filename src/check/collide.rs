//! Batches that collide. A team's events file is in the order its producer
//! sent them, where two events of one account, one show or one order are
//! seldom side by side; a batch then rarely holds two events that touch a
//! row, and a handler that nets a batch per row (one capacity check a
//! batch, say) passes. Production's hot rows do put them in one batch.
//!
//! So a check puts the events that name a same row side by side, for
//! batch equivalence and for the worker's runs: a row is named by its
//! key's text values (what the reference left in the handler's tables),
//! and an event names the rows whose key values are strings of its body.

use std::collections::{BTreeSet, HashMap};

use serde_json::Value;

/// An event as the order is drawn from: its body, and its ordering key.
pub(crate) struct Placed<'a> {
    pub(crate) body: &'a [u8],
    pub(crate) key: Option<&'a str>,
}

/// A new order of `events` (given in the file's order), as indexes into
/// them: each event in turn brings along, right after it, every later one
/// that names a row it names, row by row. Events that name no row another
/// names stay where they come. A key's events keep their order: they take
/// the places the key's events have in the new order, in the file's order.
pub(crate) fn side_by_side(events: &[Placed<'_>], rows: &BTreeSet<String>) -> Vec<usize> {
    let named: Vec<Vec<&str>> = events.iter().map(|event| names(event.body, rows)).collect();
    let mut naming: HashMap<&str, Vec<usize>> = HashMap::new();
    for (index, names) in named.iter().enumerate() {
        for name in names {
            naming.entry(name).or_default().push(index);
        }
    }
    let mut placed = vec![false; events.len()];
    let mut order = Vec::with_capacity(events.len());
    for index in 0..events.len() {
        if placed[index] {
            continue;
        }
        placed[index] = true;
        order.push(index);
        for name in &named[index] {
            for &other in naming.get(name).map(Vec::as_slice).unwrap_or_default() {
                if !placed[other] {
                    placed[other] = true;
                    order.push(other);
                }
            }
        }
    }
    keep_keys_in_order(events, &mut order);
    order
}

/// Within `order`, gives each ordering key's places to its events in the
/// file's order (their indexes').
fn keep_keys_in_order(events: &[Placed<'_>], order: &mut [usize]) {
    let mut places: HashMap<&str, Vec<usize>> = HashMap::new();
    for (place, &index) in order.iter().enumerate() {
        if let Some(key) = events[index].key {
            places.entry(key).or_default().push(place);
        }
    }
    for places in places.values() {
        let mut indexes: Vec<usize> = places.iter().map(|&place| order[place]).collect();
        indexes.sort_unstable();
        for (&place, index) in places.iter().zip(indexes) {
            order[place] = index;
        }
    }
}

/// The rows `body` names: its string values (at any depth) that are among
/// `rows`, each once; none for a body that is no JSON.
fn names<'r>(body: &[u8], rows: &'r BTreeSet<String>) -> Vec<&'r str> {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let mut stack = vec![&value];
    while let Some(value) = stack.pop() {
        match value {
            Value::String(text) => {
                if let Some(row) = rows.get(text)
                    && !found.contains(&row.as_str())
                {
                    found.push(row.as_str());
                }
            }
            Value::Array(values) => stack.extend(values.iter().rev()),
            Value::Object(fields) => stack.extend(fields.values().rev()),
            _ => {}
        }
    }
    found
}

/// `bodies` (every message of the file, in its order) ordered as
/// `events`' bodies are in `order`: a body that is no event's (invalid, or
/// another copy's bytes) stays right after the body before it.
pub(crate) fn bodies_in_order(
    bodies: &[Vec<u8>],
    events: &[Placed<'_>],
    order: &[usize],
) -> Vec<Vec<u8>> {
    let rank: HashMap<&[u8], usize> = order
        .iter()
        .enumerate()
        .map(|(rank, &index)| (events[index].body, rank))
        .collect();
    let mut last = 0;
    let mut ranked: Vec<(usize, &Vec<u8>)> = bodies
        .iter()
        .map(|body| {
            last = rank.get(body.as_slice()).copied().unwrap_or(last);
            (last, body)
        })
        .collect();
    ranked.sort_by_key(|(rank, _)| *rank);
    ranked.into_iter().map(|(_, body)| body.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transfer(from: &str, to: &str) -> Vec<u8> {
        serde_json::json!({"from": from, "to": to, "amount": 10})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn events_naming_a_same_row_come_side_by_side_and_a_key_keeps_its_order() {
        let bodies = [
            transfer("a", "b"),
            transfer("c", "d"),
            transfer("e", "f"),
            transfer("b", "a"),
            transfer("d", "c"),
            b"not json".to_vec(),
        ];
        let keys = [None, Some("k"), None, Some("k"), None, None];
        let events: Vec<Placed<'_>> = bodies
            .iter()
            .zip(keys)
            .map(|(body, key)| Placed { body, key })
            .collect();
        let rows: BTreeSet<String> = ["a", "b", "c", "d"].map(String::from).into();
        let order = side_by_side(&events, &rows);
        // a→b brings b→a and c→d brings d→c; but b→a's key is c→d's, which
        // comes first in the file, so the two swap places.
        assert_eq!(order, [0, 1, 3, 4, 2, 5]);
        let unkeyed: Vec<Placed<'_>> = bodies
            .iter()
            .map(|body| Placed { body, key: None })
            .collect();
        assert_eq!(side_by_side(&unkeyed, &rows), [0, 3, 1, 4, 2, 5]);
        let none = side_by_side(&events, &BTreeSet::new());
        assert_eq!(none, [0, 1, 2, 3, 4, 5], "no row named: the file's order");
        let reordered = bodies_in_order(
            &[b"first".to_vec(), bodies[3].clone(), bodies[0].clone()],
            &events,
            &order,
        );
        assert_eq!(
            reordered,
            [b"first".to_vec(), bodies[0].clone(), bodies[3].clone()]
        );
    }

    #[test]
    fn a_row_is_named_by_a_string_at_any_depth_once() {
        let rows: BTreeSet<String> = ["show-1", "seat-9"].map(String::from).into();
        let body = br#"{"show":{"id":"show-1"},"seats":["seat-9","seat-9"],"n":"show-1x"}"#;
        let mut named = names(body, &rows);
        named.sort_unstable();
        assert_eq!(named, ["seat-9", "show-1"]);
    }
}
