//! A second handler, to show what a team writes to put its own effect under
//! idem's guarantees: stock reservations.
//!
//! `{"eventId": "reservation-1", "sku": "SKU-1", "quantity": 2}` takes two
//! units of SKU-1 off `stock.available`, once however often it arrives. A
//! reservation that would oversell breaks the table's `CHECK (available >=
//! 0)`: its transaction fails, it is retried and then dead-lettered, while
//! the others apply. A reservation for a SKU the table does not know fails
//! the same way, by the handler's own rule.
//!
//! ```sh
//! cargo run --example stock -- migrate    # idem's tables and `stock`
//! cargo run --example stock -- worker     # until SIGINT/SIGTERM
//! cargo run --example stock -- requeue    # replay its dead letters
//! ```
//!
//! It reads `AMQP_URL`, `DATABASE_URL`, `IDEM_SCHEMA`, `IDEM_MODE` and
//! `IDEM_RETRY_DELAYS`, as `idem` does; everything else is idem's defaults.

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::Context;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use idem::broker::Topology;
use idem::commands::dlq::{self, Action, DlqConfig, Filter, Printed, View};
use idem::duration;
use idem::handler::{Handler, HandlerError, Invalid, Migration, Transaction};
use idem::store::migrate;
use idem::vars;
use idem::worker::{Worker, WorkerConfig};

/// A reservation of `quantity` units of `sku`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reservation {
    event_id: String,
    sku: String,
    quantity: i64,
}

/// Takes reserved units off the stock.
struct Stock;

/// Every SKU's reservations of a batch at once, SKUs in order (so that
/// concurrent batches lock rows in one order). `$1` SKUs, `$2` quantities.
const RESERVE: &str = "\
    UPDATE stock SET available = stock.available - wanted.quantity \
    FROM unnest($1::varchar[], $2::bigint[]) AS wanted(sku, quantity) \
    WHERE stock.sku = wanted.sku";

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
        reservations: &[&Reservation],
    ) -> Result<(), HandlerError> {
        let mut wanted: BTreeMap<&str, i64> = BTreeMap::new();
        for reservation in reservations {
            *wanted.entry(&reservation.sku).or_default() += reservation.quantity;
        }
        let (skus, quantities): (Vec<&str>, Vec<i64>) = wanted.into_iter().unzip();
        let reserve = tx.prepare_cached(RESERVE).await?;
        // An oversold SKU breaks the CHECK here: SQLSTATE 23514, a failure
        // of the message by idem's classification.
        let updated = tx.execute(&reserve, &[&skus, &quantities]).await?;
        if updated != skus.len() as u64 {
            return Err(HandlerError::message(format!(
                "no such SKU among {}",
                skus.join(", ")
            )));
        }
        Ok(())
    }
}

/// The exchange inventory events go to, and this consumer group's queues.
fn topology() -> Topology {
    Topology::new(
        "inventory",
        "stock.reserve",
        "stock.reservations",
        "stock.dlx",
        "stock.reservations.dlq",
    )
}

const CONSUMER_GROUP: &str = "stock-reservations";

fn config() -> anyhow::Result<WorkerConfig> {
    let mut topology = topology();
    if let Ok(delays) = std::env::var(vars::RETRY_DELAYS) {
        topology.retry_delays = duration::parse_list(&delays, Topology::MAX_RETRY_DELAY)
            .map_err(anyhow::Error::msg)
            .context(vars::RETRY_DELAYS)?;
    }
    common::worker_config(topology, CONSUMER_GROUP)
}

async fn run(command: &str, shutdown: CancellationToken) -> anyhow::Result<()> {
    let config = config()?;
    match command {
        "migrate" => {
            let pool = config.database.pool()?;
            let applied = migrate::run::<Stock>(&pool, config.database.schema.as_deref()).await?;
            println!("migrations: applied {}", applied.join(", "));
        }
        "worker" => Worker::new(config, Stock).run(shutdown).await?,
        "requeue" => {
            let dead_letters = DlqConfig {
                amqp: config.amqp,
                database: config.database,
                consumer_group: config.consumer_group,
                dead_letter_queue: config.topology.dead_letter_queue,
                filter: Filter::default(),
                limit: None,
                patience: config.startup_timeout,
            };
            let replay = Action::Replay {
                rate: None,
                include_invalid: true,
            };
            let report = dlq::run(&dead_letters, &replay, &Stock, &shutdown).await?;
            let view = View::Listing;
            println!(
                "{}",
                Printed {
                    report: &report,
                    view
                }
            );
        }
        other => anyhow::bail!("unknown command {other:?}: migrate, worker or requeue"),
    }
    Ok(())
}

fn main() -> ExitCode {
    common::main("stock", |command, shutdown| async move {
        run(&command, shutdown).await
    })
}
