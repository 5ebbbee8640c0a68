//! The points handler's message contract: what a "payment succeeded" event
//! is, and how a body becomes one or is found invalid.
//!
//! Invalid means that retrying cannot help, so the worker dead-letters the
//! message at once. Validation mirrors the columns the event lands in.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use idem::handler::MAX_EVENT_ID_CHARS;

/// Longest `orderId` accepted, in characters: `user_points.order_id`.
pub const MAX_ORDER_ID_CHARS: usize = 64;

/// A payment succeeded; the order earns `points`, once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PaymentSucceeded {
    /// The business key deduplication rests on; stable across producer retries.
    pub event_id: String,
    /// The order whose points go up.
    pub order_id: String,
    /// How many points; positive.
    pub points: i64,
}

/// Why a body is not a [`PaymentSucceeded`]. Retrying cannot fix any of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidMessage {
    /// The body is not UTF-8, not JSON, not an object, or a field has the wrong type.
    #[error("body is not a payment event: {0}")]
    Malformed(String),
    /// A required field is absent or null.
    #[error("field `{0}` is missing")]
    Missing(&'static str),
    /// A required text field is empty or only white space.
    #[error("field `{0}` is empty")]
    Empty(&'static str),
    /// A text field is longer than its column.
    #[error("field `{field}` has {chars} characters, above the limit of {limit}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length in characters.
        chars: usize,
        /// The column's limit.
        limit: usize,
    },
    /// A text field holds a control character (PostgreSQL cannot store NUL).
    #[error("field `{0}` contains a control character")]
    ControlCharacter(&'static str),
    /// `points` is not a positive integer that fits a BIGINT.
    #[error("field `points` must be a positive integer that fits 64 bits, got {0}")]
    PointsOutOfRange(String),
}

/// The body as it arrives, before the contract's rules are checked; text
/// is borrowed from the body unless it holds escapes.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw<'a> {
    #[serde(borrow)]
    event_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    order_id: Option<Cow<'a, str>>,
    points: Option<serde_json::Number>,
}

impl PaymentSucceeded {
    /// Parses and validates a message body.
    ///
    /// Unknown fields are ignored so that producers can evolve.
    pub fn parse(body: &[u8]) -> Result<Self, InvalidMessage> {
        // serde would take a JSON array for the struct too.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(InvalidMessage::Malformed("not a JSON object".into()));
        }
        let raw: Raw =
            serde_json::from_slice(body).map_err(|e| InvalidMessage::Malformed(e.to_string()))?;
        Ok(Self {
            event_id: text("eventId", raw.event_id, MAX_EVENT_ID_CHARS)?,
            order_id: text("orderId", raw.order_id, MAX_ORDER_ID_CHARS)?,
            points: points(raw.points)?,
        })
    }

    /// The JSON body of this event, as producers send it.
    pub fn to_body(&self) -> Vec<u8> {
        // Serializing a struct of strings and an integer cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Checks a text field: present, not blank, within its column, no control
/// characters.
fn text(
    field: &'static str,
    value: Option<Cow<'_, str>>,
    limit: usize,
) -> Result<String, InvalidMessage> {
    let value = value.ok_or(InvalidMessage::Missing(field))?;
    let (chars, control, blank) = if value.is_ascii() {
        // The common case, byte by byte.
        let bytes = value.as_bytes();
        (
            bytes.len(),
            bytes.iter().any(u8::is_ascii_control),
            bytes.iter().all(u8::is_ascii_whitespace),
        )
    } else {
        (
            value.chars().count(),
            value.chars().any(char::is_control),
            value.chars().all(char::is_whitespace),
        )
    };
    if control {
        return Err(InvalidMessage::ControlCharacter(field));
    }
    if blank {
        return Err(InvalidMessage::Empty(field));
    }
    if chars > limit {
        return Err(InvalidMessage::TooLong {
            field,
            chars,
            limit,
        });
    }
    Ok(value.into_owned())
}

fn points(value: Option<serde_json::Number>) -> Result<i64, InvalidMessage> {
    let number = value.ok_or(InvalidMessage::Missing("points"))?;
    match number.as_i64() {
        Some(points) if points > 0 => Ok(points),
        _ => Err(InvalidMessage::PointsOutOfRange(number.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<PaymentSucceeded, InvalidMessage> {
        PaymentSucceeded::parse(body.as_bytes())
    }

    #[test]
    fn the_contract_example_parses() {
        let event =
            parse(r#"{"eventId": "payment-success-10001", "orderId": "10001", "points": 100}"#);
        assert_eq!(
            event,
            Ok(PaymentSucceeded {
                event_id: "payment-success-10001".into(),
                order_id: "10001".into(),
                points: 100,
            })
        );
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let event = parse(r#"{"eventId":"e","orderId":"o","points":1,"currency":"EUR","v":2}"#);
        assert_eq!(event.map(|e| e.points), Ok(1));
    }

    #[test]
    fn a_body_round_trips() {
        let event = PaymentSucceeded {
            event_id: "e-1".into(),
            order_id: "o-1".into(),
            points: 7,
        };
        assert_eq!(PaymentSucceeded::parse(&event.to_body()), Ok(event));
    }

    #[test]
    fn missing_null_and_empty_fields_are_invalid() {
        assert_eq!(
            parse(r#"{"orderId":"o","points":1}"#),
            Err(InvalidMessage::Missing("eventId"))
        );
        assert_eq!(
            parse(r#"{"eventId":"e","orderId":null,"points":1}"#),
            Err(InvalidMessage::Missing("orderId"))
        );
        assert_eq!(
            parse(r#"{"eventId":"e","orderId":"o"}"#),
            Err(InvalidMessage::Missing("points"))
        );
        assert_eq!(
            parse(r#"{"eventId":"  ","orderId":"o","points":1}"#),
            Err(InvalidMessage::Empty("eventId"))
        );
    }

    #[test]
    fn zero_negative_fractional_and_huge_points_are_invalid() {
        for points in ["0", "-5", "1.5", "1e3", "9223372036854775808"] {
            let body = format!(r#"{{"eventId":"e","orderId":"o","points":{points}}}"#);
            assert!(
                matches!(parse(&body), Err(InvalidMessage::PointsOutOfRange(_))),
                "points {points} was accepted"
            );
        }
        let max = format!(r#"{{"eventId":"e","orderId":"o","points":{}}}"#, i64::MAX);
        assert_eq!(parse(&max).map(|e| e.points), Ok(i64::MAX));
    }

    #[test]
    fn wrong_types_and_non_json_are_malformed() {
        for body in [
            r#"{"eventId":"e","orderId":"o","points":"100"}"#,
            r#"{"eventId":1,"orderId":"o","points":1}"#,
            r#"["e","o",1]"#,
            "not json",
            "",
            r#"{"eventId":"e","eventId":"f","orderId":"o","points":1}"#,
        ] {
            assert!(
                matches!(parse(body), Err(InvalidMessage::Malformed(_))),
                "{body:?} was not malformed"
            );
        }
        let not_utf8 = PaymentSucceeded::parse(&[0x7b, 0xff, 0xfe, 0x7d]);
        assert!(matches!(not_utf8, Err(InvalidMessage::Malformed(_))));
    }

    #[test]
    fn fields_longer_than_their_columns_are_invalid() {
        let long_id = "x".repeat(MAX_EVENT_ID_CHARS + 1);
        let body = format!(r#"{{"eventId":"{long_id}","orderId":"o","points":1}}"#);
        assert_eq!(
            parse(&body),
            Err(InvalidMessage::TooLong {
                field: "eventId",
                chars: 129,
                limit: 128
            })
        );
        // The limit is in characters, as VARCHAR(n) counts them, not bytes.
        let wide = "é".repeat(MAX_ORDER_ID_CHARS);
        let body = format!(r#"{{"eventId":"e","orderId":"{wide}","points":1}}"#);
        assert!(parse(&body).is_ok());
    }

    #[test]
    fn control_characters_are_invalid() {
        assert_eq!(
            parse(r#"{"eventId":"e\u0000","orderId":"o","points":1}"#),
            Err(InvalidMessage::ControlCharacter("eventId"))
        );
    }
}
