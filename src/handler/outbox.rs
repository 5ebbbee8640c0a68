//! What a handler sends on: messages for the outbox, their idempotency
//! keys, and the collector [`Handler::apply`](super::Handler::apply) writes
//! to.

use std::collections::BTreeMap;

use super::HandlerError;

/// A message for the outbox: where it goes and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The exchange it is published to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Its `content_type` property, if any.
    pub content_type: Option<String>,
    /// Headers of its own (idem adds `Idempotency-Key`).
    pub headers: BTreeMap<String, String>,
    /// Its body.
    pub body: Vec<u8>,
}

impl OutboxMessage {
    /// A JSON body for `exchange` and `routing_key`.
    pub fn json(exchange: &str, routing_key: &str, body: Vec<u8>) -> Self {
        Self {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            content_type: Some("application/json".to_owned()),
            headers: BTreeMap::new(),
            body,
        }
    }

    /// The same message with header `name` set to `value`.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The same message with `key` in the
    /// [`ORDERING_KEY_HEADER`](super::ORDERING_KEY_HEADER) header: the key
    /// an ordered queue of idem's downstream routes it by. (The order in
    /// which the outbox sends it is its event's key's, not this one's.)
    pub fn with_ordering_key(self, key: impl Into<String>) -> Self {
        self.with_header(super::ORDERING_KEY_HEADER, key)
    }
}

/// A message of the outbox as idem writes it: the event that sends it, that
/// event's ordering key (its messages leave in the key's order), its index
/// among the event's messages, the message.
#[derive(Debug)]
pub(crate) struct Entry<'e> {
    pub(crate) event_id: &'e str,
    pub(crate) ordering_key: Option<&'e str>,
    pub(crate) index: usize,
    pub(crate) message: OutboxMessage,
}

/// The idempotency key of the `index`-th message that the event `event_id`
/// sends in `consumer_group`: a name-based UUID (version 5), the same
/// however often the event arrives, different for every group, event and
/// index.
pub fn message_id(consumer_group: &str, event_id: &str, index: usize) -> uuid::Uuid {
    // Neither a group nor an event id holds a control character: the
    // newlines keep ("a", "b\nc") and ("a\nb", "c") apart.
    let name = format!("{consumer_group}\n{event_id}\n{index}");
    uuid::Uuid::new_v5(&OUTBOX_NAMESPACE, name.as_bytes())
}

/// The idempotency key of the `index`-th message [`Handler::given_up`]
/// returned when `consumer_group` dead-letters the letter `letter_key`
/// (`event <id>`, or `body <digest>` for an invalid body) after `replays`
/// replays: the same for every copy of that death, another after a replay.
///
/// [`Handler::given_up`]: super::Handler::given_up
pub fn given_up_id(
    consumer_group: &str,
    letter_key: &str,
    replays: i64,
    index: usize,
) -> uuid::Uuid {
    message_id(consumer_group, &given_up_name(letter_key, replays), index)
}

/// What stands for the event in the key of a death's messages: no event id
/// holds a newline, so no key of [`message_id`] is one of these.
pub(crate) fn given_up_name(letter_key: &str, replays: i64) -> String {
    format!("{letter_key}\ngiven up {replays}")
}

/// The namespace of [`message_id`]'s UUIDs: idem's own, fixed forever.
const OUTBOX_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6f1c_2e0a_9b57_4d3e_8a41_5c7e_b2d9_0f13);

/// The messages that the events of one transaction send on, which idem
/// writes to the outbox in that transaction: they exist if and only if the
/// effect commits.
///
/// It starts with what [`Handler::outgoing`](super::Handler::outgoing)
/// returns for each event; [`Handler::apply`](super::Handler::apply) adds
/// what depends on what it found with [`send`](Outbox::send). An event's
/// messages keep their order: `outgoing`'s first (indices 0, 1, …, as
/// always), then `apply`'s in the order it sent them. Each is keyed by
/// [`message_id`] from the consumer group, the event's id and that index, so
/// an `apply` that decides the same way on every attempt sends the same keys.
#[derive(Debug)]
pub struct Outbox<'e> {
    /// Whether the handler declared that it sends messages.
    open: bool,
    /// The transaction's fresh events, sorted, and how many messages each
    /// has so far.
    events: Vec<(&'e str, usize)>,
    /// Each event's ordering key, index for index with `events`.
    keys: Vec<Option<&'e str>>,
    /// Per message: its event's place in `events`, its index, the message.
    messages: Vec<(usize, usize, OutboxMessage)>,
}

impl<'e> Outbox<'e> {
    /// An outbox for the events `ids` (sorted, distinct), each with the
    /// ordering key `key` gives it, holding the messages `outgoing` gives
    /// each; closed (every send refused) unless `open`. A closed one keeps
    /// no events: it never needs them, and the transactions of a handler
    /// that sends nothing copy nothing.
    pub(crate) fn new(
        open: bool,
        ids: &[&'e str],
        key: impl Fn(usize) -> Option<&'e str>,
        mut outgoing: impl FnMut(usize) -> Vec<OutboxMessage>,
    ) -> Self {
        let (events, keys) = if open {
            let events = ids.iter().map(|id| (*id, 0)).collect();
            (events, (0..ids.len()).map(key).collect())
        } else {
            (Vec::new(), Vec::new())
        };
        let mut outbox = Self {
            open,
            events,
            keys,
            messages: Vec::new(),
        };
        if open {
            for place in 0..outbox.events.len() {
                for message in outgoing(place) {
                    outbox.push(place, message);
                }
            }
        }
        outbox
    }

    /// Sends `message` on for the event `event_id`, one of the events
    /// `apply` was given. Refused, as a failure no retry fixes, when the
    /// handler does not declare [`SENDS_MESSAGES`](super::Handler::SENDS_MESSAGES)
    /// (no relay would publish it) or when `event_id` is not one of them
    /// (its key would belong to no consume record).
    pub fn send(&mut self, event_id: &str, message: OutboxMessage) -> Result<(), HandlerError> {
        if !self.open {
            return Err(HandlerError::permanent(
                "the handler sent a message but does not declare SENDS_MESSAGES: \
                 no relay would publish it",
            ));
        }
        let place = self
            .events
            .binary_search_by(|(id, _)| (*id).cmp(event_id))
            .map_err(|_| {
                HandlerError::permanent(format!(
                    "the handler sent a message for the event {event_id:?}, \
                     which is not one of the events it was given"
                ))
            })?;
        self.push(place, message);
        Ok(())
    }

    /// How many messages the event `event_id` sends so far.
    pub fn count(&self, event_id: &str) -> usize {
        self.events
            .binary_search_by(|(id, _)| (*id).cmp(event_id))
            .map_or(0, |place| self.events[place].1)
    }

    /// Whether no message is to be sent.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    fn push(&mut self, place: usize, message: OutboxMessage) {
        let count = &mut self.events[place].1;
        let index = *count;
        *count += 1;
        self.messages.push((place, index, message));
    }

    /// The messages, event by event in the events' order, each event's in
    /// index order. (A transaction holds one event of a key at most: the
    /// events' order is not their keys'.)
    pub(crate) fn into_messages(mut self) -> impl Iterator<Item = Entry<'e>> {
        // Stable, and within an event the indices were handed out in order.
        self.messages.sort_by_key(|(place, _, _)| *place);
        let (events, keys) = (self.events, self.keys);
        self.messages
            .into_iter()
            .map(move |(place, index, message)| Entry {
                event_id: events[place].0,
                ordering_key: keys[place],
                index,
                message,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &str) -> OutboxMessage {
        OutboxMessage::json("x", "k", body.as_bytes().to_vec())
    }

    fn sent(outbox: Outbox<'_>) -> Vec<(String, usize, String)> {
        outbox
            .into_messages()
            .map(|entry| {
                let body = String::from_utf8(entry.message.body).unwrap_or_default();
                (entry.event_id.to_owned(), entry.index, body)
            })
            .collect()
    }

    #[test]
    fn apply_s_messages_follow_outgoing_s_event_by_event() -> Result<(), HandlerError> {
        let mut outbox = Outbox::new(
            true,
            &["a", "b"],
            |_| None,
            |place| vec![message(["a0", "b0"][place])],
        );
        outbox.send("b", message("b1"))?;
        outbox.send("a", message("a1"))?;
        outbox.send("b", message("b2"))?;
        assert_eq!(outbox.count("b"), 3);
        let expected = [
            ("a", 0, "a0"),
            ("a", 1, "a1"),
            ("b", 0, "b0"),
            ("b", 1, "b1"),
        ]
        .into_iter()
        .chain([("b", 2, "b2")])
        .map(|(id, index, body)| (id.to_owned(), index, body.to_owned()))
        .collect::<Vec<_>>();
        assert_eq!(sent(outbox), expected);
        Ok(())
    }

    #[test]
    fn a_send_for_another_event_or_from_a_handler_that_sends_nothing_is_permanent() {
        let mut outbox = Outbox::new(true, &["a"], |_| None, |_| Vec::new());
        let stranger = outbox.send("z", message("z0"));
        assert!(
            matches!(stranger, Err(HandlerError::Permanent(_))),
            "{stranger:?}"
        );
        let mut closed = Outbox::new(false, &["a"], |_| None, |_| vec![message("never asked")]);
        assert!(closed.is_empty(), "a closed outbox does not ask outgoing");
        let refused = closed.send("a", message("a0"));
        assert!(
            matches!(&refused, Err(HandlerError::Permanent(reason)) if reason.to_string().contains("SENDS_MESSAGES")),
            "{refused:?}"
        );
        assert!(closed.is_empty());
    }
}
