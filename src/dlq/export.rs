//! What a discard writes of a letter: one JSON line with everything needed
//! to publish it again by hand.

use super::*;

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
        "properties": properties_json(properties),
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

pub(super) fn properties_json(properties: &BasicProperties) -> Value {
    json!({
        "content_type": properties.content_type().as_ref().map(|v| v.to_string()),
        "message_id": properties.message_id().as_ref().map(|v| v.to_string()),
        "timestamp": properties.timestamp(),
        "app_id": properties.app_id().as_ref().map(|v| v.to_string()),
        "headers": properties.headers().as_ref().map(table_json),
    })
}

pub(super) fn table_json(table: &FieldTable) -> Value {
    Value::Object(
        table
            .inner()
            .iter()
            .map(|(key, value)| (key.to_string(), value_json(value)))
            .collect(),
    )
}

pub(super) fn value_json(value: &AMQPValue) -> Value {
    match value {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Float(n) => json!(n),
        AMQPValue::Double(n) => json!(n),
        AMQPValue::Timestamp(t) => json!(t),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => json!(s.to_string()),
        AMQPValue::FieldArray(array) => {
            Value::Array(array.as_slice().iter().map(value_json).collect())
        }
        AMQPValue::FieldTable(table) => table_json(table),
        AMQPValue::Void => Value::Null,
        other => json!(format!("{other:?}")),
    }
}
