//! A handler whose effect depends on order, and a binary with every idem
//! command for it: an order's status moves forward only (created, paid,
//! shipped, delivered), and every change is recorded in the order it was
//! applied. Its queue is ordered per order: eight slot queues behind a
//! consistent-hash exchange, each order's events applied one at a time in
//! the order they were published, an order whose event fails parked behind
//! it (`orders parked list`) instead of being overtaken.
//!
//! A producer publishes to the exchange `orders` with the routing key
//! `order.status`, and sets the header `idem-ordering-key` to the order:
//!
//! `{"eventId": "o-7-paid", "order": "o-7", "status": "paid"}`
//!
//! A status that would move an order back (paid after shipped) can never
//! apply: it is dead-lettered, and the order parked until an operator
//! replays or discards it. An unknown status is invalid.
//!
//! ```sh
//! cargo run --example orders -- migrate
//! cargo run --example orders -- worker      # as many as you like
//! cargo run --example orders -- parked list
//! cargo run --example orders -- --help
//! ```

use std::process::ExitCode;

use idem::broker::Topology;
use idem::handler::{Handler, HandlerError, Invalid, Migration, Outbox, Transaction};

/// The statuses, in the only order an order goes through them.
const STATUSES: [&str; 4] = ["created", "paid", "shipped", "delivered"];

/// An order's new status.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct StatusChanged {
    event_id: String,
    order: String,
    status: String,
}

/// Moves orders forward.
struct Orders;

/// The status, if it moves the order forward. `$1` order, `$2` status,
/// `$3` its rank.
const MOVE: &str = "INSERT INTO order_status VALUES ($1, $2, $3) \
    ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status, rank = EXCLUDED.rank \
    WHERE order_status.rank < EXCLUDED.rank";

const RECORD: &str =
    "INSERT INTO order_transitions (order_id, status, event_id) VALUES ($1, $2, $3)";

impl Handler for Orders {
    type Event = StatusChanged;
    const NAME: &'static str = "orders";
    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_orders.sql",
        sql: include_str!("0001_orders.sql"),
    }];

    fn decode(&self, body: &[u8]) -> Result<StatusChanged, Invalid> {
        let changed: StatusChanged = serde_json::from_slice(body)?;
        if !STATUSES.contains(&changed.status.as_str()) {
            return Err(Invalid::new(format!(
                "status must be one of {}",
                STATUSES.join(", ")
            )));
        }
        Ok(changed)
    }

    fn event_id<'e>(&self, changed: &'e StatusChanged) -> &'e str {
        &changed.event_id
    }

    fn ordering_key<'e>(&self, changed: &'e StatusChanged) -> Option<&'e str> {
        Some(&changed.order)
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        batch: &[&StatusChanged],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        // On an ordered queue a batch holds one event per order: their
        // order within it does not matter.
        let moving = tx.prepare_cached(MOVE).await?;
        let record = tx.prepare_cached(RECORD).await?;
        for changed in batch {
            let rank = STATUSES
                .iter()
                .position(|status| *status == changed.status)
                .unwrap_or_default() as i32;
            if tx
                .execute(&moving, &[&changed.order, &changed.status, &rank])
                .await?
                == 0
            {
                return Err(HandlerError::permanent(format!(
                    "order {} is past {} already",
                    changed.order, changed.status
                )));
            }
            tx.execute(
                &record,
                &[&changed.order, &changed.status, &changed.event_id],
            )
            .await?;
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    idem::cli::Service::new(Orders)
        .topology(
            Topology::for_queue("orders.status")
                .bound_to("orders", "order.status")
                .ordered(8),
        )
        .consumer_group("orders-status")
        .run()
}
