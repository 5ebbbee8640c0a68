//! A wallet service: transfers between accounts, once however often they
//! arrive; `transfer.completed` for each, `transfer.rejected` for one that
//! can never apply; its settings given once, here, for every command.
//!
//! ```sh
//! cargo run --example wallet -- migrate
//! cargo run --example wallet -- worker      # until SIGINT/SIGTERM
//! cargo run --example wallet -- status      # the same retry queues, no flag
//! cargo run --example wallet -- check --events transfers.jsonl --setup seed.sql
//! ```

use std::process::ExitCode;
use std::time::Duration;

use idem::RetryPolicy;
use idem::broker::{Exchange, Topology};

mod wallet;

fn main() -> ExitCode {
    let topology = Topology {
        retry: RetryPolicy::new([Duration::from_secs(1), Duration::from_secs(5)], 3),
        ..Topology::for_queue("wallet.transfers").bound_to("payments", "transfer.requested")
    };
    idem::cli::Service::new(wallet::Wallet)
        .topology(topology)
        .consumer_group("wallet-transfers")
        .sends_to(Exchange::topic(wallet::EVENTS))
        .version(env!("CARGO_PKG_VERSION"))
        .run()
}
