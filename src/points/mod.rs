//! The reference handler: a "payment succeeded" event credits its order's
//! points, once. What `idem worker` runs by default, and the first
//! implementation of [`Handler`].
//!
//! Its effect is a [`Tally`] (points added per order), which idem runs
//! inside its claim statement: one round trip per transaction.

mod event;

pub use event::{InvalidMessage, MAX_ORDER_ID_CHARS, PaymentSucceeded};

use crate::broker::Topology;
use crate::handler::{Handler, HandlerError, Invalid, Migration, Tally, Transaction};
use crate::store::apply_tally;

/// Exchange producers publish payment events to.
pub const EXCHANGE: &str = "payments";
/// Routing key of "payment succeeded" events.
pub const ROUTING_KEY: &str = "payment.succeeded";
/// The points consumer group's work queue.
pub const QUEUE: &str = "points.payment-succeeded";
/// Where the work queue dead-letters.
pub const DEAD_LETTER_EXCHANGE: &str = "points.dlx";
/// Where dead letters wait to be replayed.
pub const DEAD_LETTER_QUEUE: &str = "points.payment-succeeded.dlq";
/// The consumer group of the points worker.
pub const CONSUMER_GROUP: &str = "points-consumer-group";

/// The exchanges and queues of the points worker (DESIGN.md, topology).
pub fn topology() -> Topology {
    Topology::new(
        EXCHANGE,
        ROUTING_KEY,
        QUEUE,
        DEAD_LETTER_EXCHANGE,
        DEAD_LETTER_QUEUE,
    )
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

impl Handler for Points {
    type Event = PaymentSucceeded;

    const NAME: &'static str = "points";

    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_user_points.sql",
        sql: include_str!("../../sql/points/0001_user_points.sql"),
    }];

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
        Ok(PaymentSucceeded::parse(body)?)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        &event.event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&PaymentSucceeded],
    ) -> Result<(), HandlerError> {
        apply_tally(tx, &POINTS, events).await
    }

    fn tally(&self) -> Option<Tally<PaymentSucceeded>> {
        Some(POINTS)
    }
}
