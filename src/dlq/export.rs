//! What a discard writes of a letter: one JSON line with everything needed
//! to publish it again by hand.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use serde_json::{Value, json};

use super::Letter;
use crate::duration::rfc3339;

/// What the discard file keeps of a letter: everything needed to publish it
/// again by hand.
pub(super) fn discarded(queue: &str, letter: &Letter) -> Value {
    let entry = &letter.entry;
    let properties = &letter.delivery.properties;
    let body = &letter.delivery.data;
    let mut line = json!({
        "discarded_at": rfc3339(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()),
        "dead_letter_queue": queue,
        "event_id": entry.event_id,
        "invalid": entry.invalid,
        "death": entry.death.as_ref().map(|death| json!({
            "queue": death.queue,
            "reason": death.reason,
            "count": death.count,
            "time": death.time.map(rfc3339),
            "exchange": death.exchange,
            "routing_keys": death.routing_keys,
        })),
        "replays": entry.replays,
        "failures": entry.failures.as_ref().map(|f| f.failures),
        "last_error": entry.failures.as_ref().map(|f| f.last_error.clone()),
        "properties": crate::broker::json::properties_json(properties),
    });
    let body = match std::str::from_utf8(body) {
        Ok(text) => ("body", Value::String(text.to_owned())),
        Err(_) => (
            "body_base64",
            Value::String(base64::engine::general_purpose::STANDARD.encode(body)),
        ),
    };
    if let Value::Object(fields) = &mut line {
        fields.insert(body.0.to_owned(), body.1);
    }
    line
}
