//! Mistakes `check` catches: a transfer service whose handler is chosen by
//! the first word, `right` or one of six that are wrong in a way teams
//! write in good faith (`transfers.rs` says how each is wrong, and which run
//! of `check` catches it). Every idem command follows the handler's name:
//!
//! ```sh
//! cd examples/mistakes
//! cargo run --example mistakes -- netting check --events transfers.jsonl --setup seed.sql \
//!   --invariant 'SELECT sum(balance) FROM account HAVING sum(balance) <> 10000'
//! cargo run --example mistakes -- right check --events transfers.jsonl --setup seed.sql
//! ```
//!
//! `own-connection` writes through a connection of its own to
//! `DATABASE_URL`, and `publishing` publishes to `mistakes.events` on
//! `AMQP_URL`, as the worker's defaults do.

use std::ffi::OsString;
use std::process::ExitCode;

use idem::broker::Exchange;
use idem::cli::Service;
use idem::handler::Handler;

mod transfers;

/// Where `publishing` sends, and what `check` watches.
const EVENTS: &str = "mistakes.events";

const HANDLERS: &str =
    "right, netting, own-connection, clock, summarizing, cache, publishing, unlocked";

fn main() -> ExitCode {
    let mut args: Vec<OsString> = std::env::args_os().collect();
    let chosen = (args.len() > 1).then(|| args.remove(1));
    let chosen = chosen.as_ref().and_then(|name| name.to_str()).unwrap_or("");
    let url = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    match chosen {
        "right" => serve(chosen, transfers::Wallet, args),
        "netting" => serve(chosen, transfers::Netting, args),
        "own-connection" => {
            let database_url = url(
                idem::vars::DATABASE_URL,
                "postgres://postgres@127.0.0.1:5432/postgres",
            );
            serve(chosen, transfers::OwnConnection { database_url }, args)
        }
        "clock" => serve(chosen, transfers::Stamped, args),
        "summarizing" => serve(chosen, transfers::Summarizing, args),
        "cache" => serve(chosen, transfers::Cached::default(), args),
        "publishing" => {
            let amqp_url = url(
                idem::vars::AMQP_URL,
                "amqp://guest:guest@127.0.0.1:5672/%2f",
            );
            serve(chosen, transfers::Publishing::to(&amqp_url, EVENTS), args)
        }
        "unlocked" => serve(chosen, transfers::Unlocked, args),
        _ => {
            eprintln!(
                "mistakes: name a handler first ({HANDLERS}), then a command: \
                 mistakes netting check --events FILE"
            );
            ExitCode::from(2)
        }
    }
}

/// The handler's commands, its name in the binary's (so that a failing
/// check's command to run it again names it too).
fn serve<H: Handler>(chosen: &str, handler: H, mut args: Vec<OsString>) -> ExitCode {
    let name = format!("mistakes {chosen}");
    if let Some(first) = args.first_mut() {
        *first = name.clone().into();
    }
    Service::new(handler)
        .name(&name)
        .sends_to(Exchange::topic(EVENTS))
        .run_from(args)
}
