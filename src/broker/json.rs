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

/// The properties (as [`properties_json`] writes them) of a message that
/// died of a failure the handler gave `detail` of, as the index keeps them:
/// with the header its dead-letter copy carries
/// ([`DEATH_DETAIL_HEADER`](super::death::DEATH_DETAIL_HEADER)), so that a
/// sync from the queue reads the same.
pub(crate) fn with_death_detail(mut properties: Value, detail: Option<&str>) -> Value {
    let Some(detail) = detail else {
        return properties;
    };
    if !properties.is_object() {
        properties = json!({});
    }
    let headers = &mut properties["headers"];
    if !headers.is_object() {
        *headers = json!({});
    }
    headers[super::death::DEATH_DETAIL_HEADER] = json!(detail);
    properties
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

/// Properties from what [`properties_json`] kept of them (a parked event's):
/// the content type, message id, timestamp, app id and the headers of plain
/// values (strings, booleans, integers).
pub(crate) fn properties_from_json(json: &Value) -> BasicProperties {
    let text = |name: &str| json.get(name).and_then(Value::as_str).map(str::to_owned);
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(value) = text("content_type") {
        properties = properties.with_content_type(value.into());
    }
    if let Some(value) = text("message_id") {
        properties = properties.with_message_id(value.into());
    }
    if let Some(value) = text("app_id") {
        properties = properties.with_app_id(value.into());
    }
    if let Some(value) = json.get("timestamp").and_then(Value::as_u64) {
        properties = properties.with_timestamp(value);
    }
    if let Some(Value::Object(headers)) = json.get("headers") {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            let value = match value {
                Value::String(text) => AMQPValue::LongString(text.as_str().into()),
                Value::Bool(flag) => AMQPValue::Boolean(*flag),
                Value::Number(number) => match number.as_i64() {
                    Some(n) => AMQPValue::LongLongInt(n),
                    None => continue,
                },
                _ => continue,
            };
            table.insert(name.as_str().into(), value);
        }
        properties = properties.with_headers(table);
    }
    properties
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_kept_as_json_come_back_with_their_plain_headers() {
        let mut headers = FieldTable::default();
        headers.insert(
            "idem-ordering-key".into(),
            AMQPValue::LongString("o-7".into()),
        );
        headers.insert("attempt".into(), AMQPValue::LongLongInt(3));
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id("m-1".into())
            .with_timestamp(1_700_000_000)
            .with_headers(headers.clone());
        let back = properties_from_json(&properties_json(&properties));
        assert_eq!(
            back.content_type().as_ref().map(|v| v.as_str()),
            Some("application/json")
        );
        assert_eq!(back.message_id().as_ref().map(|v| v.as_str()), Some("m-1"));
        assert_eq!(*back.timestamp(), Some(1_700_000_000));
        assert_eq!(back.headers().as_ref(), Some(&headers));
    }
}
