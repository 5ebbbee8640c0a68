//! A second handler, to show what a team writes to put its own effect under
//! idem's guarantees: stock reservations, and a binary with every idem
//! command for them.
//!
//! `{"eventId": "reservation-1", "sku": "SKU-1", "quantity": 2}` takes two
//! units of SKU-1 off `stock.available`, once however often it arrives. A
//! reservation that would oversell breaks the table's `CHECK (available >=
//! 0)`: its transaction fails, it is retried and then dead-lettered, while
//! the others apply. A reservation for a SKU the table does not know can
//! never apply, by the handler's own rule: it is dead-lettered at once.
//!
//! ```sh
//! cargo run --example stock -- migrate      # idem's tables and `stock`
//! cargo run --example stock -- worker       # until SIGINT/SIGTERM
//! cargo run --example stock -- dlq summary  # or status, requeue, prune …
//! cargo run --example stock -- --help
//! ```

use std::process::ExitCode;

use idem::broker::Topology;
use idem::handler::{Handler, HandlerError, Invalid, Migration, Outbox, Transaction};

/// A reservation of `quantity` units of `sku`.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reservation {
    event_id: String,
    sku: String,
    quantity: i64,
}

/// Takes reserved units off the stock.
struct Stock;

/// The batch's SKUs locked in order, so that concurrent batches never wait
/// on each other in a circle (an UPDATE locks rows in the order of its
/// plan, not of its arguments); the unknown ones are missing. `$1` SKUs.
const LOCK: &str = "SELECT sku FROM stock WHERE sku = ANY($1) ORDER BY sku FOR UPDATE";

/// Every SKU's reservations of a batch at once. `$1` SKUs, `$2` quantities.
const RESERVE: &str = "UPDATE stock SET available = stock.available - wanted.quantity \
    FROM unnest($1::varchar[], $2::bigint[]) AS wanted(sku, quantity) WHERE stock.sku = wanted.sku";

impl Handler for Stock {
    type Event = Reservation;
    const NAME: &'static str = "stock";
    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_stock.sql",
        sql: include_str!("0001_stock.sql"),
    }];

    fn decode(&self, body: &[u8]) -> Result<Reservation, Invalid> {
        let reservation: Reservation = serde_json::from_slice(body)?;
        if reservation.sku.trim().is_empty() || reservation.sku.chars().count() > 64 {
            return Err(Invalid::new("sku must be 1 to 64 characters"));
        }
        if reservation.quantity <= 0 {
            return Err(Invalid::new("quantity must be positive"));
        }
        Ok(reservation)
    }

    fn event_id<'e>(&self, reservation: &'e Reservation) -> &'e str {
        &reservation.event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        batch: &[&Reservation],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        let mut wanted = std::collections::BTreeMap::<&str, i64>::new();
        for reservation in batch {
            *wanted.entry(&reservation.sku).or_default() += reservation.quantity;
        }
        let (skus, quantities): (Vec<&str>, Vec<i64>) = wanted.into_iter().unzip();
        // An unknown SKU is not there to lock: it can never apply. The
        // batch's SKUs are the detail, kept out of the error's text, which
        // the dead letters are grouped by.
        let lock = tx.prepare_cached(LOCK).await?;
        if tx.query(&lock, &[&skus]).await?.len() != skus.len() {
            return Err(HandlerError::permanent_for("no such SKU", skus.join(", ")));
        }
        // An oversold SKU breaks the CHECK here: SQLSTATE 23514, a failure
        // of the message by idem's classification.
        let reserve = tx.prepare_cached(RESERVE).await?;
        tx.execute(&reserve, &[&skus, &quantities]).await?;
        Ok(())
    }
}

fn main() -> ExitCode {
    idem::cli::Service::new(Stock)
        .topology(Topology::for_queue("stock.reservations").bound_to("inventory", "stock.reserve"))
        .consumer_group("stock-reservations")
        .run()
}
