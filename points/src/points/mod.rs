//! The reference handler: a "payment succeeded" event credits its order's
//! points, once. What `idem worker` runs by default, and the first
//! implementation of [`Handler`].
//!
//! Its effect is a [`Tally`] (points added per order), which idem runs
//! inside its claim statement: one round trip per transaction.

mod event;

pub use event::{InvalidMessage, MAX_ORDER_ID_CHARS, PaymentSucceeded};

use serde::Serialize;

use idem::broker::Topology;
use idem::handler::{Handler, Invalid, Migration, OutboxMessage, Tally};

/// Exchange producers publish payment events to.
pub const EXCHANGE: &str = "payments";
/// Routing key of "payment succeeded" events.
pub const ROUTING_KEY: &str = "payment.succeeded";
/// The points consumer group's work queue.
pub const QUEUE: &str = "points.payment-succeeded";
/// Where the work queue dead-letters (as [`topology`] names it).
pub const DEAD_LETTER_EXCHANGE: &str = "points.dlx";
/// Where dead letters wait to be replayed.
pub const DEAD_LETTER_QUEUE: &str = "points.payment-succeeded.dlq";
/// The consumer group of the points worker.
pub const CONSUMER_GROUP: &str = "points-consumer-group";
/// The routing key of `points.credited`.
pub const CREDITED_ROUTING_KEY: &str = "points.credited";

/// The exchanges and queues of the points worker (DESIGN.md, topology):
/// idem's convention for its work queue.
pub fn topology() -> Topology {
    Topology::for_queue(QUEUE).bound_to(EXCHANGE, ROUTING_KEY)
}

/// Credits an order's points once per payment event.
#[derive(Debug, Clone, Copy, Default)]
pub struct Points;

/// Points per order in `user_points`.
pub const POINTS: Tally<PaymentSucceeded> = Tally {
    table: "user_points",
    key: "order_id",
    amount: "points",
    entry: credit,
};

fn credit(event: &PaymentSucceeded) -> (&str, i64) {
    (&event.order_id, event.points)
}

impl Points {
    /// The same effect, announcing each credit as a `points.credited`
    /// message to `exchange` through the outbox.
    pub fn announcing(self, exchange: impl Into<String>) -> Announcing {
        Announcing {
            exchange: exchange.into(),
        }
    }
}

impl Handler for Points {
    type Event = PaymentSucceeded;

    const NAME: &'static str = "points";

    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_user_points.sql",
        sql: include_str!("../../sql/0001_user_points.sql"),
    }];

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
        Ok(PaymentSucceeded::parse(body)?)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        &event.event_id
    }

    /// The order: on an ordered queue (`--slots`), an order's credits apply
    /// in the order they were sent. Credits commute, so points' own queue
    /// is not ordered.
    fn ordering_key<'e>(&self, event: &'e PaymentSucceeded) -> Option<&'e str> {
        Some(&event.order_id)
    }

    fn tally(&self) -> Option<Tally<PaymentSucceeded>> {
        Some(POINTS)
    }
}

/// The points handler that also sends `points.credited` for every credit
/// it applies, through the outbox: in the transaction that credits the
/// points, so it leaves if and only if they were credited, once per event.
#[derive(Debug, Clone)]
pub struct Announcing {
    exchange: String,
}

/// The body of `points.credited`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PointsCredited {
    /// The payment event that earned them: a receiver's deduplication key
    /// (as is the message's idempotency key).
    pub source_event_id: String,
    /// The order credited.
    pub order_id: String,
    /// How many points.
    pub points: i64,
}

impl Handler for Announcing {
    type Event = PaymentSucceeded;

    const NAME: &'static str = Points::NAME;
    const MIGRATIONS: &'static [Migration] = Points::MIGRATIONS;
    const SENDS_MESSAGES: bool = true;

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
        Points.decode(body)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        &event.event_id
    }

    fn ordering_key<'e>(&self, event: &'e PaymentSucceeded) -> Option<&'e str> {
        Points.ordering_key(event)
    }

    fn tally(&self) -> Option<Tally<PaymentSucceeded>> {
        Points.tally()
    }

    fn outgoing(&self, event: &PaymentSucceeded) -> Vec<OutboxMessage> {
        let credited = PointsCredited {
            source_event_id: event.event_id.clone(),
            order_id: event.order_id.clone(),
            points: event.points,
        };
        // A struct of strings and an integer always serializes.
        let body = serde_json::to_vec(&credited).unwrap_or_default();
        vec![
            OutboxMessage::json(&self.exchange, CREDITED_ROUTING_KEY, body)
                .with_header("Event-Type", CREDITED_ROUTING_KEY),
        ]
    }
}
