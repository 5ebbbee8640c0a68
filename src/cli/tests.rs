//! The command line of a points binary, as idem's is built.

use super::*;
use crate::handler::Invalid;
use crate::store::DatabaseConfig;
use crate::worker::Mode;

/// A handler named as the points service's; its effect is never run here.
struct Points;

impl Handler for Points {
    type Event = String;

    const NAME: &'static str = "points";

    fn decode(&self, body: &[u8]) -> Result<String, Invalid> {
        Ok(String::from_utf8(body.to_vec())?)
    }

    fn event_id<'e>(&self, event: &'e String) -> &'e str {
        event
    }
}

/// The points service's topology and consumer group.
mod points {
    use crate::broker::Topology;

    pub(super) const CONSUMER_GROUP: &str = "points-consumer-group";

    pub(super) fn topology() -> Topology {
        Topology::for_queue("points.payment-succeeded").bound_to("payments", "payment.succeeded")
    }
}

fn service() -> Service<Points> {
    Service::new(Points)
        .name("idem")
        .topology(points::topology())
        .consumer_group(points::CONSUMER_GROUP)
}

fn parse(args: &[&str]) -> Result<Cli<NoCommands, NoFlags, NoFlags>, String> {
    service()
        .command()
        .try_get_matches_from(args)
        .and_then(|matches| Cli::from_arg_matches(&matches))
        .map_err(|e| e.to_string())
}

fn worker(args: &[&str]) -> Result<WorkerConfig, String> {
    let cli = parse(&[&["idem", "worker"][..], args].concat())?;
    let Command::Worker(args) = &cli.command else {
        return Err("parsed as another command".into());
    };
    args.config().map_err(|e| e.to_string())
}

#[test]
fn verify_cli() {
    service().command().debug_assert();
}

#[test]
fn defaults_reach_the_local_services_and_the_points_topology() -> Result<(), String> {
    let config = worker(&[])?;
    assert_eq!(
        config.amqp.url.expose(),
        "amqp://guest:guest@127.0.0.1:5672/%2f"
    );
    assert_eq!(
        config.database.url.expose(),
        "postgres://postgres@127.0.0.1:5432/postgres"
    );
    assert_eq!(config.consumer_group, "points-consumer-group");
    assert_eq!(config.topology, points::topology());
    // The library's defaults, unchanged by the CLI.
    let library = WorkerConfig::new(
        config.amqp.clone(),
        DatabaseConfig::new(config.database.url.clone()),
        points::topology(),
        points::CONSUMER_GROUP,
    );
    assert_eq!(
        (
            config.prefetch,
            config.batch_size,
            config.max_in_flight,
            config.database.pool_size
        ),
        (
            library.prefetch,
            library.batch_size,
            library.max_in_flight,
            library.database.pool_size
        )
    );
    assert_eq!(
        (
            config.batch_wait,
            config.topology.retry.attempts(),
            config.shutdown_timeout,
            config.startup_timeout
        ),
        (
            library.batch_wait,
            library.topology.retry.attempts(),
            library.shutdown_timeout,
            library.startup_timeout
        )
    );
    assert_eq!(
        (
            config.database.lock_timeout,
            config.database.statement_timeout
        ),
        (
            library.database.lock_timeout,
            library.database.statement_timeout
        )
    );
    Ok(())
}

#[test]
fn per_message_mode_takes_its_own_tuning() -> Result<(), String> {
    let config = worker(&["--mode", "per-message"])?;
    let tuning = Mode::PerMessage.tuning();
    assert_eq!(
        (config.prefetch, config.batch_size, config.max_in_flight),
        (tuning.prefetch, tuning.batch_size, tuning.max_in_flight)
    );
    assert!(worker(&["--mode", "sometimes"]).is_err());
    Ok(())
}

fn console(args: &[&str]) -> Result<crate::console::ConsoleConfig, String> {
    let cli = parse(&[&["idem", "console"][..], args].concat())?;
    let Command::Console(args) = &cli.command else {
        return Err("parsed as another command".into());
    };
    args.config().map_err(|e| e.to_string())
}

#[test]
fn a_console_beyond_loopback_without_a_token_is_refused_in_one_line() {
    // The suite runs without IDEM_CONSOLE_TOKEN in its environment.
    let refused = console(&["--http-addr", "0.0.0.0:9480"]);
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.contains("beyond loopback")
                && e.contains("IDEM_CONSOLE_TOKEN")
                && !e.contains('\n')),
        "{refused:?}"
    );
    let behind_a_proxy = console(&[
        "--http-addr",
        "0.0.0.0:9480",
        "--trust-user-header",
        "X-Forwarded-User",
    ]);
    assert!(behind_a_proxy.is_ok_and(|config| config.reading_needs_token));
    let local = console(&["--http-addr", "127.0.0.1:9480"]);
    assert!(local.is_ok_and(|config| !config.reading_needs_token));
}

#[test]
fn a_batch_larger_than_the_prefetch_is_refused() {
    let refused = worker(&["--prefetch", "100", "--batch-size", "200"]);
    assert!(refused.is_err_and(|e| e.contains("--batch-size (200) is above --prefetch (100)")));
    assert!(worker(&["--prefetch", "300", "--batch-size", "200"]).is_ok());
}

/// The help states the per-mode defaults in words; they are the library's.
#[test]
fn the_help_states_the_defaults_of_each_mode() {
    let command = service().command();
    let worker = command
        .find_subcommand("worker")
        .cloned()
        .unwrap_or_default();
    let help = |flag: &str| {
        worker
            .get_arguments()
            .find(|arg| arg.get_long() == Some(flag))
            .and_then(|arg| arg.get_help().map(ToString::to_string))
            .unwrap_or_default()
    };
    let (batch, per_message) = (Mode::Batch.tuning(), Mode::PerMessage.tuning());
    assert!(
        help("prefetch").contains(&format!(
            "{} in batch mode, {} per message",
            batch.prefetch, per_message.prefetch
        )),
        "{}",
        help("prefetch")
    );
    assert!(help("batch-size").contains(&format!("[default: {}]", batch.batch_size)));
    assert!(help("max-in-flight").contains(&format!(
        "{} in batch mode, {} per message",
        batch.max_in_flight, per_message.max_in_flight
    )));
}

/// Each subcommand lists the flags it uses, and no others.
#[test]
fn each_subcommand_takes_only_the_flags_it_uses() {
    let command = service().command();
    let flags = |name: &str| -> Vec<String> {
        command
            .find_subcommand(name)
            .map(|sub| {
                sub.get_arguments()
                    .filter_map(|arg| arg.get_long().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let migrate = flags("migrate");
    assert!(migrate.contains(&"database-url".to_owned()));
    assert!(!migrate.iter().any(|flag| flag.starts_with("amqp")));
    assert!(!migrate.contains(&"queue".to_owned()));
    let status = flags("status");
    assert!(status.contains(&"amqp-url".to_owned()) && status.contains(&"queue".to_owned()));
    assert!(!status.contains(&"exchange".to_owned()));
    let worker = flags("worker");
    for flag in [
        "amqp-url",
        "database-url",
        "queue",
        "retry-delays",
        "consumer-group",
    ] {
        assert!(worker.contains(&flag.to_owned()), "worker lacks --{flag}");
    }
}

#[test]
fn a_consumer_group_longer_than_its_column_is_refused() {
    let long = "g".repeat(65);
    assert!(worker(&["--consumer-group", &long]).is_err());
}

#[test]
fn a_service_without_an_exchange_must_be_told_one() {
    let service = Service::new(Points);
    let parsed = service
        .command()
        .try_get_matches_from(["points", "worker"])
        .map(|_| ());
    assert!(
        parsed.is_err_and(|e| e.to_string().contains("--exchange")),
        "the worker of an unbound topology needs --exchange"
    );
    let status = Service::new(Points)
        .command()
        .try_get_matches_from(["points", "status"])
        .map(|matches| {
            matches
                .subcommand_matches("status")
                .and_then(|m| m.get_one::<String>("queue").cloned())
        });
    assert_eq!(
        status.ok().flatten().as_deref(),
        Some("points"),
        "the queue is the handler's name"
    );
}

#[test]
fn a_pool_too_small_for_the_transactions_in_flight_is_refused_by_flag() {
    let refused = worker(&["--max-in-flight", "8", "--pool-size", "9"]);
    assert!(refused.is_err_and(|e| e.contains(
        "--pool-size (9) must be at least the transactions in flight (8: --max-in-flight"
    )),);
    assert!(worker(&["--max-in-flight", "8", "--pool-size", "10"]).is_ok());
}

/// `args` split as a POSIX shell splits them: words, single quotes, and
/// `'\''` for a quote inside them.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                quoted = !quoted;
                in_word = true;
            }
            '\\' if !quoted => {
                word.extend(chars.next());
                in_word = true;
            }
            ' ' if !quoted => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                }
                in_word = false;
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

#[test]
fn a_failing_check_s_command_again_parses_to_the_same_check() -> Result<(), String> {
    let given = [
        "idem",
        "check",
        "--events",
        "incident 7.jsonl",
        "--seed",
        "42",
        "--invariant",
        "SELECT id FROM account WHERE note = 'it''s'",
        "--witness",
        "SELECT count(*) FROM log WHERE event_id = $1",
        "--ignore-column",
        "log.at",
        "--copies",
        "5",
        "--consumer-group",
        "wallet",
    ];
    let cli = parse(&given)?;
    let Command::Check(args) = &cli.command else {
        return Err("parsed as another command".into());
    };
    let again = args.again("idem");
    let words = shell_words(&again);
    let cli_again = parse(&words.iter().map(String::as_str).collect::<Vec<_>>())?;
    let Command::Check(again_args) = &cli_again.command else {
        return Err(format!("{again} parsed as another command"));
    };
    assert_eq!(again_args.events, args.events, "{again}");
    assert_eq!(again_args.seed, 42, "{again}");
    assert_eq!(again_args.invariants, args.invariants, "{again}");
    assert_eq!(again_args.witness, args.witness, "{again}");
    assert_eq!(again_args.ignore_columns, args.ignore_columns, "{again}");
    assert_eq!(again_args.copies, 5, "{again}");
    assert_eq!(again_args.group.consumer_group, "wallet", "{again}");
    Ok(())
}

#[test]
fn publish_reads_a_file_to_the_service_s_exchange_unless_it_has_sources_of_its_own()
-> Result<(), String> {
    let missing = parse(&["idem", "publish"]).err().unwrap_or_default();
    assert!(missing.contains("--file <FILE>"), "{missing}");
    let cli = parse(&["idem", "publish", "--file", "-"])?;
    let Command::Publish(args) = &cli.command else {
        return Err("parsed as another command".into());
    };
    let config = args.config();
    assert_eq!(args.file.as_deref(), Some(std::path::Path::new("-")));
    assert_eq!(
        (config.exchange.as_str(), config.routing_key.as_str()),
        ("payments", "payment.succeeded")
    );
    Ok(())
}
