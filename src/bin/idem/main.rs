//! The `idem` binary: the points worker and its tools. Parse flags, set up
//! logging and signals, run one subcommand with the points handler, turn its
//! outcome into an exit code.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use clap::error::ErrorKind;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

mod cli;

use cli::{Cli, Command};
use idem::commands::dlq::{self, Printed};
use idem::commands::{bench, demo, lab, prune, publish, reconcile, status};
use idem::points::Points;
use idem::progress::Progress;
use idem::relay;
use idem::store::{ReadyError, Store, migrate};
use idem::telemetry::{self, LogFormat};
use idem::worker::Worker;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            e.exit()
        }
        Err(e) => {
            telemetry::fatal(log_format_asked(), &usage_error(&e));
            return ExitCode::from(2);
        }
    };
    let format = cli.log_format;
    let default_filter = match cli.command {
        Command::Demo(_) | Command::Bench(_) | Command::Lab(_) => {
            "warn,lapin=off,tokio_postgres=warn"
        }
        // lapin logs from its own task what it also returns to us, and we log
        // each error once, where it is handled.
        _ => "info,lapin=off,tokio_postgres=warn",
    };
    telemetry::init(default_filter, cli.log_format);
    // One thread: idem's own work per message is small next to lapin's I/O
    // thread and PostgreSQL, and a single thread saves the wake-ups between
    // threads that a multi-threaded runtime pays per batch and per ack
    // (measured with `idem bench`: about a sixth less CPU per message).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            telemetry::fatal(format, &format!("cannot start the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        if let Err(e) = watch_signals(shutdown.clone()) {
            telemetry::fatal(format, &format!("cannot install signal handlers: {e}"));
            return ExitCode::FAILURE;
        }
        match run(cli, shutdown).await {
            Ok(code) => code,
            Err(e) => {
                telemetry::fatal(format, &one_line(&e));
                ExitCode::FAILURE
            }
        }
    })
}

async fn run(cli: Cli, shutdown: CancellationToken) -> anyhow::Result<ExitCode> {
    match &cli.command {
        Command::Migrate(args) => {
            let database = args.database.config(1);
            let pool = database.pool()?;
            let applied = migrate::run_when_ready::<Points>(
                &pool,
                database.schema.as_deref(),
                args.wait.startup_timeout.0,
                &shutdown,
            )
            .await
            .with_context(|| format!("migrating {}", database.describe()))?;
            match applied.as_slice() {
                [] => println!("migrations: up to date"),
                names => println!("migrations: applied {}", names.join(", ")),
            }
        }
        Command::Worker(args) => {
            let config = args.config()?;
            let pruner = args.pruner()?.map(|(settings, interval)| {
                let shutdown = shutdown.child_token();
                let stop = shutdown.clone();
                let task = tokio::spawn(prune::keep_pruning(settings, Points, interval, shutdown));
                (task, stop)
            });
            let worked = if let Some(exchange) = &args.credits_exchange {
                let handler = Points.announcing(exchange.as_str());
                Worker::new(config, handler).run(shutdown).await
            } else {
                Worker::new(config, Points).run(shutdown).await
            };
            if let Some((task, stop)) = pruner {
                stop.cancel();
                let _ = task.await;
            }
            worked?;
        }
        Command::Relay(args) => {
            let (config, database) = args.config();
            let pool = database.pool()?;
            // The outbox is idem's: any handler's history will do.
            match Store::new(pool.clone(), "")
                .wait_until_ready::<Points>(config.patience, &shutdown)
                .await
            {
                Err(ReadyError::Interrupted) => return Ok(ExitCode::SUCCESS),
                ready => ready.with_context(|| format!("relaying from {}", database.describe()))?,
            }
            let counters = relay::RelayCounters::default();
            let report = relay::run(&pool, &config, &counters, &shutdown).await?;
            relay::log_report(&report);
            println!("relayed: {} sent, {} refused", report.sent, report.refused);
            if config.until_empty {
                // What is left was refused and waits for its next attempt.
                let client = pool.get().await.context("counting what is left")?;
                let left = idem::store::outbox::unsent(&client).await?;
                if left > 0 {
                    println!("left in the outbox: {left} not sent (see the log for why)");
                    return Ok(ExitCode::FAILURE);
                }
            }
        }
        Command::Prune(args) => {
            let settings = args.config()?;
            let outcome = prune::run(&settings, &Points, &shutdown).await?;
            println!("{outcome}");
        }
        Command::Publish(args) => {
            let (config, source) = args.config()?;
            let summary = publish::run(&config, source, &shutdown).await?;
            println!("{summary}");
            if !summary.report.all_confirmed() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Requeue(args) => {
            let (config, action, view) = args.config()?;
            return dead_letters(&config, &action, view, &shutdown).await;
        }
        Command::Dlq(args) => {
            let (config, action, view) = args.config()?;
            return dead_letters(&config, &action, view, &shutdown).await;
        }
        Command::Reconcile(args) => {
            let config = args.config()?;
            let found = reconcile::run(&config, &Points, &shutdown).await?;
            println!("{found}");
            if !found.matched() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Status(args) => {
            let status = status::run(&args.config()?, &Points, &shutdown).await?;
            println!("{status}");
        }
        Command::Bench(args) => {
            let report = bench::run(&args.config()?, &shutdown).await?;
            println!("{report}");
        }
        Command::Demo(args) => {
            let report = demo::run(args.amqp.config(), args.database.config(4)).await?;
            println!("{report}");
        }
        Command::Lab(args) => {
            let report = lab::run(&args.config()).await?;
            println!("{report}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `idem dlq` (or `requeue`) with the points handler and prints what it
/// did; exit code 1 when something could not be replayed.
async fn dead_letters(
    config: &dlq::DlqConfig,
    action: &dlq::Action,
    view: dlq::View,
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    let progress = match action {
        dlq::Action::List => Progress::hidden(),
        dlq::Action::Replay { .. } => Progress::new("replaying", 0),
        dlq::Action::Discard { .. } => Progress::new("discarding", 0),
    };
    let report = dlq::run_showing(config, action, &Points, &progress, shutdown).await;
    progress.finish(&report);
    let report = report?;
    println!(
        "{}",
        Printed {
            report: &report,
            view
        }
    );
    Ok(if report.succeeded() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// clap's explanation on one line: what is wrong, the arguments it names,
/// its suggestion or the valid values, and the help of the subcommand that
/// was being given.
fn usage_error(error: &clap::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for raw in error.render().to_string().lines() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with("Usage:") || line.starts_with("For more information")
        {
            continue;
        }
        let continues_a_list =
            raw.starts_with("  ") && !line.starts_with("tip:") && !line.starts_with('[');
        match parts.last_mut() {
            Some(last) if continues_a_list => {
                let glue = if last.ends_with(':') { " " } else { ", " };
                last.push_str(glue);
                last.push_str(line);
            }
            _ => parts.push(line.trim_start_matches("error: ").to_owned()),
        }
    }
    format!("{} (see {} --help)", parts.join("; "), subcommand_asked())
}

/// `idem`, and the subcommands named on the command line (`idem dlq
/// replay`), as far as they are known.
fn subcommand_asked() -> String {
    use clap::CommandFactory;
    let mut command = Cli::command();
    let mut path = vec!["idem".to_owned()];
    for arg in std::env::args().skip(1) {
        let Some(sub) = command.find_subcommand(&arg).cloned() else {
            continue;
        };
        path.push(arg);
        command = sub;
    }
    path.join(" ")
}

/// The log format asked for, read from the raw arguments and environment:
/// for the line that says the arguments do not parse.
fn log_format_asked() -> LogFormat {
    let args: Vec<String> = std::env::args().collect();
    let json = args
        .windows(2)
        .any(|pair| pair[0] == "--log-format" && pair[1] == "json")
        || args.iter().any(|arg| arg == "--log-format=json")
        || std::env::var(idem::vars::LOG_FORMAT).is_ok_and(|format| format == "json");
    if json {
        LogFormat::Json
    } else {
        LogFormat::Text
    }
}

/// The error and its causes on one line, without the repetition that comes
/// from libraries whose messages already quote their cause.
fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line.replace('\n', " ")
}

/// SIGINT or SIGTERM cancels `shutdown`; a second one exits at once.
fn watch_signals(shutdown: CancellationToken) -> std::io::Result<()> {
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        warn!("shutdown signal received; a second one exits at once");
        shutdown.cancel();
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        error!("second signal: exiting now; unacked deliveries will be redelivered");
        std::process::exit(130);
    });
    Ok(())
}
