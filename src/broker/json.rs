//! Messages' properties as JSON: what a discard writes of a letter, what
//! the dead-letter index keeps of its headers.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::{Value, json};

/// A message's properties as JSON: what an operator reads of them.
pub(crate) fn properties_json(properties: &BasicProperties) -> Value {
    json!({
        "content_type": properties.content_type().as_ref().map(|v| v.to_string()),
        "message_id": properties.message_id().as_ref().map(|v| v.to_string()),
        "timestamp": properties.timestamp(),
        "app_id": properties.app_id().as_ref().map(|v| v.to_string()),
        "headers": properties.headers().as_ref().map(table_json),
    })
}

/// A field table as a JSON object.
pub(crate) fn table_json(table: &FieldTable) -> Value {
    Value::Object(
        table
            .inner()
            .iter()
            .map(|(key, value)| (key.to_string(), value_json(value)))
            .collect(),
    )
}

/// A field value as JSON; kinds JSON lacks as their debug text.
pub(crate) fn value_json(value: &AMQPValue) -> Value {
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
