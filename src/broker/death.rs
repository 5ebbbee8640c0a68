//! The record of a dead-lettered message: the broker's `x-death`, or
//! idem's own headers when idem made the hop to the dead-letter exchange
//! itself; and the headers a copy carries when idem publishes a message
//! again (to wait, to the dead-letter exchange, as a replay).

use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

/// Header idem sets on a replayed message: how many times it was replayed.
pub const REPLAY_HEADER: &str = "x-idem-replays";

/// Headers idem sets on a message the first time it sends it to wait: the
/// exchange and routing key it was first published with. The broker's
/// `x-death` names the last publish, which for a message that waited is
/// idem's, to a wait queue through the default exchange.
pub const EXCHANGE_HEADER: &str = "x-idem-exchange";
/// See [`EXCHANGE_HEADER`].
pub const ROUTING_KEY_HEADER: &str = "x-idem-routing-key";

/// Header idem sets on a message it sends to wait: when it is due back in
/// the work queue, in milliseconds since the Unix epoch.
pub const DUE_HEADER: &str = "x-idem-due";

/// On a message the console replayed with a body an operator edited: the
/// key in the dead-letter index of the letter it replaces (`event <id>`,
/// or `body <digest>` for a body that was invalid).
pub const REPLACES_HEADER: &str = "x-idem-replaces";

/// Headers idem sets on a message it dead-letters itself (a copy published
/// to the dead-letter exchange, then the delivery acked): what the broker's
/// `x-death` entry would say. The queue the message died in.
pub const DEATH_QUEUE_HEADER: &str = "x-idem-death-queue";
/// Why it died: `rejected`, as the broker says of a reject. See
/// [`DEATH_QUEUE_HEADER`].
pub const DEATH_REASON_HEADER: &str = "x-idem-death-reason";
/// When it died, a timestamp (seconds since the Unix epoch). See
/// [`DEATH_QUEUE_HEADER`].
pub const DEATH_TIME_HEADER: &str = "x-idem-death-time";
/// How many times it died this way in that queue since it was last
/// published by its producer or replayed: 1. See [`DEATH_QUEUE_HEADER`].
pub const DEATH_COUNT_HEADER: &str = "x-idem-death-count";
/// The handler's detail of the failure that killed it
/// ([`HandlerError::permanent_for`](crate::handler::HandlerError::permanent_for)'s
/// second part), when it gave one: kept out of the grouping, shown on the
/// console's letter page. See [`DEATH_QUEUE_HEADER`].
pub const DEATH_DETAIL_HEADER: &str = "x-idem-death-detail";

/// The most recent death of a message, from its `x-death` header, or from
/// idem's own (see [`DEATH_QUEUE_HEADER`]) when it has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    /// The queue it died in: where a replay sends it back.
    pub queue: String,
    /// `rejected`, `delivery_limit`, `expired` or `maxlen`.
    pub reason: String,
    /// How many times it died this way in this queue.
    pub count: i64,
    /// When, in seconds since the Unix epoch, if the broker said.
    pub time: Option<u64>,
    /// Exchange it was first published to.
    pub exchange: String,
    /// Routing keys it was first published with.
    pub routing_keys: Vec<String>,
}

impl Death {
    /// The first (most recent) entry of `x-death`, else idem's record, if
    /// there is one, with the route it was first published with
    /// ([`EXCHANGE_HEADER`] when idem recorded it). Both can be there only
    /// when the broker dead-lettered a message idem had dead-lettered
    /// before (idem drops `x-death` from what it publishes): the broker's
    /// is then the later one.
    pub fn latest(headers: Option<&FieldTable>) -> Option<Self> {
        let mut death = Self::recorded(headers?).or_else(|| Self::recorded_by_idem(headers?))?;
        let table = headers?.inner();
        if let Some(exchange) = table.get(EXCHANGE_HEADER).and_then(text) {
            death.exchange = exchange;
            death.routing_keys = table
                .get(ROUTING_KEY_HEADER)
                .and_then(text)
                .into_iter()
                .collect();
        }
        Some(death)
    }

    /// idem's own record, from the headers it sets when it dead-letters a
    /// message itself.
    fn recorded_by_idem(headers: &FieldTable) -> Option<Self> {
        let table = headers.inner();
        Some(Death {
            queue: table.get(DEATH_QUEUE_HEADER).and_then(text)?,
            reason: table
                .get(DEATH_REASON_HEADER)
                .and_then(text)
                .unwrap_or_default(),
            count: table.get(DEATH_COUNT_HEADER).and_then(integer).unwrap_or(1),
            time: match table.get(DEATH_TIME_HEADER) {
                Some(AMQPValue::Timestamp(t)) => Some(*t),
                _ => None,
            },
            exchange: String::new(),
            routing_keys: Vec::new(),
        })
    }

    /// The broker's own record of the most recent death.
    fn recorded(headers: &FieldTable) -> Option<Self> {
        let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
            return None;
        };
        let AMQPValue::FieldTable(entry) = deaths.as_slice().first()? else {
            return None;
        };
        let entry = entry.inner();
        let field = |key: &str| entry.get(key).and_then(text);
        Some(Death {
            queue: field("queue")?,
            reason: field("reason").unwrap_or_default(),
            count: entry.get("count").and_then(integer).unwrap_or(1),
            time: match entry.get("time") {
                Some(AMQPValue::Timestamp(t)) => Some(*t),
                _ => None,
            },
            exchange: field("exchange").unwrap_or_default(),
            routing_keys: match entry.get("routing-keys") {
                Some(AMQPValue::FieldArray(keys)) => {
                    keys.as_slice().iter().filter_map(text).collect()
                }
                _ => Vec::new(),
            },
        })
    }
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// True when a delivery may follow an earlier attempt at its message, one
/// that could have left a row in the failure ledger: the broker delivered
/// it before, it comes back from a wait queue (idem's route headers, the
/// broker's `x-death`), or it was replayed. A message's first delivery, as
/// its producer published it, bears none of these.
pub fn may_follow_an_attempt(redelivered: bool, headers: Option<&FieldTable>) -> bool {
    redelivered
        || headers.is_some_and(|headers| {
            headers.inner().keys().any(|key| {
                matches!(
                    key.as_str(),
                    "x-death"
                        | "x-delivery-count"
                        | EXCHANGE_HEADER
                        | REPLAY_HEADER
                        | DEATH_QUEUE_HEADER
                )
            })
        })
}

/// The headers of a copy sent to wait: the original ones without those the
/// broker owns, the route the message was first published with, unless an
/// earlier wait recorded it already, and when it is `due` (since the Unix
/// epoch).
pub fn wait_headers(
    original: Option<&FieldTable>,
    exchange: &str,
    routing_key: &str,
    due: Duration,
) -> FieldTable {
    let mut headers = routed_headers(original, exchange, routing_key);
    headers.insert(
        ShortString::from(DUE_HEADER),
        AMQPValue::LongLongInt(i64::try_from(due.as_millis()).unwrap_or(i64::MAX)),
    );
    headers
}

/// The original headers without those the broker owns, and the route the
/// message was first published with, unless an earlier wait recorded it.
fn routed_headers(original: Option<&FieldTable>, exchange: &str, routing_key: &str) -> FieldTable {
    let mut headers = without_broker_headers(original);
    if !headers.inner().contains_key(EXCHANGE_HEADER) {
        headers.insert(
            ShortString::from(EXCHANGE_HEADER),
            AMQPValue::LongString(exchange.into()),
        );
        headers.insert(
            ShortString::from(ROUTING_KEY_HEADER),
            AMQPValue::LongString(routing_key.into()),
        );
    }
    headers
}

/// The properties of the copy idem publishes to the dead-letter exchange
/// when it dead-letters `properties`' message itself, as the broker would:
/// persistent, without an expiration (a letter must not expire in the
/// dead-letter queue), with the route it was first published with (the
/// delivery's `exchange` and `routing_key`, unless a wait recorded it), and
/// idem's record of its death in `queue` for `reason`, at `time` (seconds
/// since the Unix epoch), with the handler's `detail` of the failure.
pub fn dead_letter_properties(
    properties: &BasicProperties,
    exchange: &str,
    routing_key: &str,
    queue: &str,
    reason: &str,
    time: u64,
    detail: Option<&str>,
) -> BasicProperties {
    let mut headers = routed_headers(properties.headers().as_ref(), exchange, routing_key);
    for (name, value) in [
        (DEATH_QUEUE_HEADER, AMQPValue::LongString(queue.into())),
        (DEATH_REASON_HEADER, AMQPValue::LongString(reason.into())),
        (DEATH_COUNT_HEADER, AMQPValue::LongLongInt(1)),
        (DEATH_TIME_HEADER, AMQPValue::Timestamp(time)),
    ] {
        headers.insert(ShortString::from(name), value);
    }
    if let Some(detail) = detail {
        headers.insert(
            ShortString::from(DEATH_DETAIL_HEADER),
            AMQPValue::LongString(detail.into()),
        );
    }
    without_expiration(properties)
        .with_headers(headers)
        .with_delivery_mode(2)
}

/// `properties` without its `expiration`, which lapin's builder cannot unset.
fn without_expiration(properties: &BasicProperties) -> BasicProperties {
    let mut copy = BasicProperties::default();
    macro_rules! keep {
        ($($field:ident => $with:ident),* $(,)?) => {
            $(if let Some(value) = properties.$field() {
                copy = copy.$with(value.clone());
            })*
        };
    }
    keep!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        headers => with_headers,
        delivery_mode => with_delivery_mode,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        user_id => with_user_id,
        app_id => with_app_id,
        cluster_id => with_cluster_id,
    );
    copy
}

/// The headers of a replayed copy: the original ones without those the
/// broker owns (RabbitMQ 4 ignores them from publishers, 3.x would count
/// old deaths) nor idem's record of a death, and with the replay counter
/// one higher.
pub fn replay_headers(original: Option<&FieldTable>) -> FieldTable {
    let mut headers = without_broker_headers(original);
    headers.insert(
        ShortString::from(REPLAY_HEADER),
        AMQPValue::LongLongInt(replays(original) + 1),
    );
    headers
}

/// The original headers without those the broker owns and without idem's
/// record of an earlier death: what a message published again by idem (to
/// a wait queue, say) carries.
pub fn without_broker_headers(original: Option<&FieldTable>) -> FieldTable {
    let mut headers = FieldTable::default();
    for (key, value) in original.map(FieldTable::inner).into_iter().flatten() {
        if !is_dropped_on_republish(key.as_str()) {
            headers.insert(key.clone(), value.clone());
        }
    }
    headers
}

/// How many times a message was replayed, from its headers.
pub fn replays(headers: Option<&FieldTable>) -> i64 {
    headers
        .and_then(|h| h.inner().get(REPLAY_HEADER))
        .and_then(integer)
        .unwrap_or(0)
}

fn is_dropped_on_republish(name: &str) -> bool {
    name == "x-death"
        || name == "x-delivery-count"
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
        || name.starts_with("x-idem-death-")
        || name == DUE_HEADER
}

fn integer(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;

    fn field_array(values: Vec<AMQPValue>) -> FieldArray {
        values.into()
    }

    fn dead_lettered_headers() -> FieldTable {
        let mut death = FieldTable::default();
        death.insert("queue".into(), AMQPValue::LongString("work".into()));
        death.insert("reason".into(), AMQPValue::LongString("rejected".into()));
        death.insert("count".into(), AMQPValue::LongLongInt(3));
        death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        death.insert("exchange".into(), AMQPValue::LongString("payments".into()));
        death.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(field_array(vec![AMQPValue::LongString(
                "payment.succeeded".into(),
            )])),
        );
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(field_array(vec![AMQPValue::FieldTable(death)])),
        );
        headers.insert(
            "x-first-death-queue".into(),
            AMQPValue::LongString("work".into()),
        );
        headers.insert(
            "x-last-death-reason".into(),
            AMQPValue::LongString("rejected".into()),
        );
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(4));
        headers.insert("trace-id".into(), AMQPValue::LongString("abc".into()));
        headers
    }

    #[test]
    fn the_latest_death_names_queue_reason_and_route() {
        let headers = dead_lettered_headers();
        assert_eq!(
            Death::latest(Some(&headers)),
            Some(Death {
                queue: "work".into(),
                reason: "rejected".into(),
                count: 3,
                time: Some(1_700_000_000),
                exchange: "payments".into(),
                routing_keys: vec!["payment.succeeded".into()],
            })
        );
        assert_eq!(Death::latest(None), None);
        assert_eq!(Death::latest(Some(&FieldTable::default())), None);
    }

    #[test]
    fn a_message_that_waited_keeps_the_route_it_was_first_published_with() {
        // The first wait records the route of the delivery as it came...
        let first = wait_headers(
            Some(&dead_lettered_headers()),
            "payments",
            "payment.succeeded",
            Duration::from_secs(1),
        );
        // ...later ones, arriving from a wait queue, keep it.
        let again = wait_headers(Some(&first), "", "work.retry.1s", Duration::from_secs(2));
        assert_eq!(
            again.inner().get(DUE_HEADER),
            Some(&AMQPValue::LongLongInt(2000)),
            "the due time is the latest wait's"
        );
        let mut died = again.clone();
        for (key, value) in dead_lettered_headers().inner() {
            if key.as_str() == "x-death" {
                died.insert(key.clone(), value.clone());
            }
        }
        let death = Death::latest(Some(&died));
        assert_eq!(
            death.map(|death| (death.exchange, death.routing_keys)),
            Some(("payments".to_owned(), vec!["payment.succeeded".to_owned()]))
        );
        assert!(!again.inner().contains_key("x-death"));
    }

    #[test]
    fn a_replay_drops_broker_headers_keeps_the_rest_and_counts() {
        let first = replay_headers(Some(&dead_lettered_headers()));
        let names: Vec<&str> = first.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(names, vec!["trace-id", REPLAY_HEADER]);
        assert_eq!(replays(Some(&first)), 1);
        assert_eq!(replays(Some(&replay_headers(Some(&first)))), 2);
    }

    #[test]
    fn a_letter_idem_dead_lettered_reads_as_the_broker_would_have_written_it() {
        let mut published = FieldTable::default();
        published.insert("trace-id".into(), AMQPValue::LongString("abc".into()));
        let properties = BasicProperties::default()
            .with_headers(published)
            .with_expiration("60000".into())
            .with_message_id("m-1".into());
        let letter = dead_letter_properties(
            &properties,
            "payments",
            "payment.succeeded",
            "work",
            "rejected",
            1_700_000_000,
            Some("account 42"),
        );
        assert_eq!(letter.expiration(), &None, "a letter must not expire");
        assert_eq!(letter.delivery_mode(), &Some(2));
        assert_eq!(
            letter.message_id().as_ref().map(|id| id.as_str()),
            Some("m-1")
        );
        let headers = letter.headers().as_ref();
        assert_eq!(
            headers.and_then(|h| h.inner().get(DEATH_DETAIL_HEADER)),
            Some(&AMQPValue::LongString("account 42".into()))
        );
        assert_eq!(
            Death::latest(headers),
            Some(Death {
                queue: "work".into(),
                reason: "rejected".into(),
                count: 1,
                time: Some(1_700_000_000),
                exchange: "payments".into(),
                routing_keys: vec!["payment.succeeded".into()],
            })
        );
        // The broker's later death wins over idem's earlier one.
        let mut died_again = headers.cloned().unwrap_or_default();
        for (key, value) in dead_lettered_headers().inner() {
            died_again.insert(key.clone(), value.clone());
        }
        assert_eq!(Death::latest(Some(&died_again)).map(|d| d.count), Some(3));
        // A replay drops the record, as it drops `x-death`.
        let replayed = replay_headers(headers);
        let names: Vec<&str> = replayed.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "trace-id",
                EXCHANGE_HEADER,
                REPLAY_HEADER,
                ROUTING_KEY_HEADER
            ]
        );
        assert_eq!(Death::latest(Some(&replayed)), None);
    }

    #[test]
    fn only_a_first_delivery_as_published_follows_no_attempt() {
        let mut published = FieldTable::default();
        published.insert("trace-id".into(), AMQPValue::LongString("abc".into()));
        assert!(!may_follow_an_attempt(false, None));
        assert!(!may_follow_an_attempt(false, Some(&published)));
        assert!(may_follow_an_attempt(true, Some(&published)));
        let waited = wait_headers(
            Some(&published),
            "payments",
            "payment.succeeded",
            Duration::ZERO,
        );
        assert!(may_follow_an_attempt(false, Some(&waited)));
        assert!(may_follow_an_attempt(false, Some(&dead_lettered_headers())));
        let replayed = replay_headers(Some(&published));
        assert!(may_follow_an_attempt(false, Some(&replayed)));
    }
}
