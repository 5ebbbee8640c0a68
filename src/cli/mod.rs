//! Every operator command idem has, for any handler's binary: a service's
//! `main` is its handler and one call.
//!
//! ```no_run
//! # use idem::handler::{Handler, HandlerError, Invalid, Outbox, Transaction};
//! # struct Stock;
//! # impl Handler for Stock {
//! #     type Event = String;
//! #     const NAME: &'static str = "stock";
//! #     fn decode(&self, body: &[u8]) -> Result<String, Invalid> { Ok(String::from_utf8(body.to_vec())?) }
//! #     fn event_id<'e>(&self, event: &'e String) -> &'e str { event }
//! #     async fn apply(&self, _: &Transaction<'_>, _: &[&String], _: &mut Outbox<'_>) -> Result<(), HandlerError> { Ok(()) }
//! # }
//! use idem::broker::Topology;
//!
//! fn main() -> std::process::ExitCode {
//!     idem::cli::Service::new(Stock)
//!         .topology(Topology::for_queue("stock.reservations").bound_to("inventory", "stock.reserve"))
//!         .run()
//! }
//! ```
//!
//! The binary then has `migrate`, `worker`, `requeue`, `dlq` (summary,
//! list, replay, discard), `status`, `parked`, `console`, `reconcile`,
//! `relay`, `publish`, `prune` and `check`, with the flags, environment variables, help, errors and exit
//! codes of the `idem` binary; the topology and consumer group given here
//! are the defaults of `--queue`, `--exchange`, `--consumer-group` and the
//! rest.
//! A service adds subcommands of its own with [`Service::commands`],
//! flags of its own to `worker` with [`Service::worker_flags`], and sources
//! of events to `publish` with [`Service::publish_sources`].
//!
//! [`run`] is the shortest form: the queue and the consumer group are the
//! handler's [`NAME`](Handler::NAME), and `--exchange` and `--routing-key`
//! must be given.
//!
//! Over 700 lines: the `Service` builder and the dispatch of every command it
//! gives a binary, each arm a few lines into the library; the flags are in
//! `args`.

mod args;

use std::ffi::OsString;
use std::future::Future;
use std::marker::PhantomData;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::error::ErrorKind;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

pub use args::{
    AmqpArgs, DatabaseArgs, Delays, RouteArgs, ServerArgs, SettingError, Wait, WaitArgs, choice,
};

use crate::broker::{Exchange, Topology};
use crate::check;
use crate::commands::{parked, prune, publish, reconcile, status};
use crate::console::Console;
use crate::dlq::{self, Printed};
use crate::duration;
use crate::handler::Handler;
use crate::progress::Progress;
use crate::relay;
use crate::store::{ReadyError, Store, migrate};
use crate::telemetry::{self, LogFormat};
use crate::vars;
use crate::worker::{Mode, Worker, WorkerConfig, WorkerError};
use args::{
    CheckArgs, ConsoleArgs, DlqArgs, MigrateArgs, ParkedArgs, PruneArgs, PublishArgs,
    ReconcileArgs, RelayArgs, RequeueArgs, StatusArgs, WorkerArgs,
};

/// The log filter unless `RUST_LOG` says otherwise: lapin logs from its own
/// task what it also returns to idem, and idem logs each error once, where
/// it is handled.
pub const DEFAULT_LOG_FILTER: &str = "info,lapin=off,tokio_postgres=warn";

/// The log filter of `check` unless `RUST_LOG` says otherwise: the faults
/// it injects make its workers say what they would say in production.
const CHECK_LOG_FILTER: &str =
    "error,idem::worker=off,idem::store=off,lapin=off,tokio_postgres=off";

/// Runs the command line of a binary of `handler`, with every idem command:
/// its queue and consumer group named after the handler, its exchange and
/// routing key given by flags. [`Service`] says more.
pub fn run<H: Handler>(handler: H) -> ExitCode {
    Service::new(handler).run()
}

/// A handler's binary: its names, the defaults of its topology, and the
/// commands and flags of its own.
pub struct Service<H, X = NoCommands, F = NoFlags, P = NoFlags> {
    /// The effect every command works for.
    handler: H,
    /// The binary's name, in its help and in the line an error ends with;
    /// `None`: the name it was started under.
    name: Option<String>,
    /// The first line of its help.
    about: Option<String>,
    /// What `--version` prints.
    version: Option<String>,
    /// The defaults of the topology flags.
    topology: Topology,
    /// The default of `--consumer-group`.
    consumer_group: String,
    /// Defaults of other flags the service set, by argument id
    /// (`batch_size`), as the flag would write them.
    settings: Vec<(&'static str, String)>,
    /// Where the handler's messages go: declared by `worker` and `relay`.
    outgoing: Vec<Exchange>,
    /// The service's own subcommands, worker flags and publish sources.
    own: PhantomData<Own<X, F, P>>,
}

/// What a [`Service`] holds of its own types: none of their values.
type Own<X, F, P> = fn() -> (X, F, P);

/// Subcommands of a service's own, beside idem's: a `clap::Subcommand` enum
/// and how each runs.
pub trait Commands<H: Handler>: Subcommand {
    /// The log filter of this command unless `RUST_LOG` is set.
    fn log_filter(&self) -> &'static str {
        DEFAULT_LOG_FILTER
    }

    /// Runs the command until it is done or `shutdown` (SIGINT, SIGTERM)
    /// fires; an error is printed on one line and exits 1.
    fn run(
        self,
        handler: &H,
        shutdown: CancellationToken,
    ) -> impl Future<Output = anyhow::Result<ExitCode>>;
}

/// Flags of a service's own for `worker` (a `clap::Args` struct), and how
/// the worker starts with them: with the handler as it is, or another one
/// the flags make of it.
pub trait WorkerFlags<H: Handler>: Args {
    /// Starts the worker that `worker` says.
    fn start(
        self,
        handler: Arc<H>,
        worker: WorkerStart,
    ) -> impl Future<Output = Result<(), WorkerError>>;
}

/// A worker about to start, its settings read from the flags.
pub struct WorkerStart {
    /// What the flags say.
    pub config: WorkerConfig,
    /// Fires on SIGINT or SIGTERM.
    pub shutdown: CancellationToken,
}

impl WorkerStart {
    /// Runs the worker with `handler` until shutdown.
    pub async fn run<G: Handler>(self, handler: G) -> Result<(), WorkerError> {
        Worker::new(self.config, handler).run(self.shutdown).await
    }
}

/// No subcommands beyond idem's.
#[derive(Debug, Clone, Copy, Subcommand)]
pub enum NoCommands {}

impl<H: Handler> Commands<H> for NoCommands {
    async fn run(self, _: &H, _: CancellationToken) -> anyhow::Result<ExitCode> {
        match self {}
    }
}

/// No flags beyond idem's.
#[derive(Debug, Clone, Copy, Args)]
pub struct NoFlags {}

/// Sources of events of a service's own for `publish` (a `clap::Args`
/// struct flattened into it), beside `--file`: one event from flags, a
/// generated load.
pub trait PublishSources<H: Handler>: Args {
    /// The bodies the flags give; `None` when none of them was given, and
    /// `--file` is read.
    fn bodies(&self, handler: &H) -> Result<Option<Vec<Vec<u8>>>, SettingError>;
}

impl<H: Handler> PublishSources<H> for NoFlags {
    fn bodies(&self, _: &H) -> Result<Option<Vec<Vec<u8>>>, SettingError> {
        Ok(None)
    }
}

impl<H: Handler> WorkerFlags<H> for NoFlags {
    async fn start(self, handler: Arc<H>, worker: WorkerStart) -> Result<(), WorkerError> {
        worker.run(handler).await
    }
}

/// The command line as clap reads it; its name and about are the service's.
#[derive(Debug, Parser)]
#[command(about = None, long_about = None)]
struct Cli<X: Subcommand, F: Args, P: Args> {
    /// Log format.
    #[arg(
        long,
        env = vars::LOG_FORMAT,
        default_value = LogFormat::default().as_flag(),
        value_parser = choice(&LogFormat::ALL, |format| format.as_flag()),
        global = true,
        help_heading = "Global options"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command<X, F, P>,
}

/// What to do.
#[derive(Debug, Subcommand)]
enum Command<X: Subcommand, F: Args, P: Args> {
    /// Apply idem's migrations and the handler's (idempotent; safe to run
    /// concurrently).
    Migrate(MigrateArgs),
    /// Consume and apply events until SIGINT/SIGTERM, then drain and exit 0.
    Worker(Box<WorkerArgs<F>>),
    /// Replay dead-lettered messages to the queue they died in (all of them;
    /// `dlq` filters).
    Requeue(RequeueArgs),
    /// Dead-letter triage: a summary, a listing, a replay or a discard, of
    /// the dead letters that match the filters.
    Dlq(DlqArgs),
    /// A consumer group at a glance: its queues, records, ledger and dead letters.
    Status(StatusArgs),
    /// The keys of an ordered queue parked behind a failed head: list them,
    /// release a key whose head was discarded, or discard a key's events.
    Parked(ParkedArgs),
    /// The dead letters and the group's state in a browser: failure groups,
    /// letters, replays and discards, the audit of what was done.
    Console(Box<ConsoleArgs>),
    /// Compare the upstream's export of the events it sent with what idem
    /// recorded; exits 1 unless everything matches.
    Reconcile(ReconcileArgs),
    /// Publish what the outbox holds (with confirms), until SIGINT/SIGTERM
    /// or, with --until-empty, until nothing is due.
    Relay(RelayArgs),
    /// Publish events to the service's exchange, with publisher confirms
    /// and its handler's ordering keys; each decoded first, as the worker
    /// will. Exits 1 if any was nacked or returned.
    Publish(Box<PublishArgs<P>>),
    /// Remove the consume records older than a window (a whole epoch at a
    /// time), and the ledger and outbox rows older than it, keeping what a
    /// dead letter may still need.
    Prune(PruneArgs),
    /// Prove the handler under idem's faults: its events through the real
    /// worker (copies at once, workers killed, connections cut, replays,
    /// other orders) against the events applied one at a time; exits 1
    /// unless every run matches.
    Check(Box<CheckArgs>),
    #[command(flatten)]
    Own(X),
}

impl<H: Handler> Service<H> {
    /// The commands of `handler`'s binary, named after the handler: the
    /// binary, the work queue (by [`Topology::for_queue`]'s convention) and
    /// the consumer group are its [`NAME`](Handler::NAME) until said
    /// otherwise.
    pub fn new(handler: H) -> Self {
        Self {
            handler,
            name: None,
            about: None,
            version: None,
            topology: Topology::for_queue(H::NAME),
            consumer_group: H::NAME.to_owned(),
            settings: Vec::new(),
            outgoing: Vec::new(),
            own: PhantomData,
        }
    }
}

impl<H: Handler, X: Commands<H>, F: WorkerFlags<H>, P: PublishSources<H>> Service<H, X, F, P> {
    /// The binary's name, for its help, its errors and the commands its
    /// messages suggest [default: the name it was started under].
    pub fn name(self, name: impl Into<String>) -> Self {
        Self {
            name: Some(name.into()),
            ..self
        }
    }

    /// The first line of its help.
    pub fn about(self, about: impl Into<String>) -> Self {
        Self {
            about: Some(about.into()),
            ..self
        }
    }

    /// What `--version` prints, before idem's version.
    pub fn version(self, version: impl Into<String>) -> Self {
        Self {
            version: Some(version.into()),
            ..self
        }
    }

    /// The defaults of the topology flags of every command (`--exchange`,
    /// `--routing-key`, `--queue`, `--dead-letter-exchange`,
    /// `--dead-letter-queue`, `--retry-delays`, `--delivery-limit`,
    /// `--quorum-size`): set once here, every command agrees.
    pub fn topology(self, topology: Topology) -> Self {
        Self { topology, ..self }
    }

    /// The default of `--consumer-group`.
    pub fn consumer_group(self, group: impl Into<String>) -> Self {
        Self {
            consumer_group: group.into(),
            ..self
        }
    }

    /// The default of `--max-attempts`: genuine failures after which a
    /// message is dead-lettered (the topology's retry policy, with
    /// `attempts`).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.topology.retry = self.topology.retry.with_attempts(attempts);
        self
    }

    /// The default of the worker's `--mode`.
    pub fn mode(self, mode: Mode) -> Self {
        self.setting("mode", mode.as_flag().to_owned())
    }

    /// The default of the worker's `--batch-size`.
    pub fn batch_size(self, deliveries: u32) -> Self {
        self.setting("batch_size", deliveries.to_string())
    }

    /// The default of the worker's `--prefetch`.
    pub fn prefetch(self, deliveries: u16) -> Self {
        self.setting("prefetch", deliveries.to_string())
    }

    /// An exchange the handler's messages go to ([`Handler::outgoing`],
    /// [`Handler::given_up`], [`Outbox::send`](crate::handler::Outbox::send)):
    /// `worker` and `relay` declare it, so that the relay's messages are
    /// not refused for want of it.
    pub fn sends_to(mut self, exchange: Exchange) -> Self {
        self.outgoing.push(exchange);
        self
    }

    fn setting(mut self, id: &'static str, value: String) -> Self {
        self.settings.retain(|(known, _)| *known != id);
        self.settings.push((id, value));
        self
    }

    /// Subcommands of the service's own, listed after idem's.
    pub fn commands<Y: Commands<H>>(self) -> Service<H, Y, F, P> {
        self.with_own()
    }

    /// Flags of the service's own for `worker`.
    pub fn worker_flags<G: WorkerFlags<H>>(self) -> Service<H, X, G, P> {
        self.with_own()
    }

    /// Sources of events of the service's own for `publish`, beside
    /// `--file` (one event from flags, a generated load).
    pub fn publish_sources<Q: PublishSources<H>>(self) -> Service<H, X, F, Q> {
        self.with_own()
    }

    /// The same service with other commands and flags of its own.
    fn with_own<Y, G, Q>(self) -> Service<H, Y, G, Q> {
        Service {
            handler: self.handler,
            name: self.name,
            about: self.about,
            version: self.version,
            topology: self.topology,
            consumer_group: self.consumer_group,
            settings: self.settings,
            outgoing: self.outgoing,
            own: PhantomData,
        }
    }

    /// The whole command line, as `--help` shows it, for the binary this
    /// process runs.
    pub fn command(&self) -> clap::Command {
        self.command_named(&self.binary_name(std::env::args_os().next().as_deref()))
    }

    /// The binary's name: the one the service gave, else the file name it
    /// was started under (`argv0`), else the handler's.
    fn binary_name(&self, argv0: Option<&std::ffi::OsStr>) -> String {
        let started_as = argv0
            .map(std::path::Path::new)
            .and_then(std::path::Path::file_name)
            .map(|name| name.to_string_lossy().into_owned());
        self.name
            .clone()
            .or(started_as)
            .unwrap_or_else(|| H::NAME.to_owned())
    }

    /// [`command`](Service::command) for the binary `name`.
    fn command_named(&self, name: &str) -> clap::Command {
        let about = self.about.clone().unwrap_or_else(|| {
            format!(
                "{name}: the {} handler's worker and operator commands, on idem",
                H::NAME
            )
        });
        // Its version, and idem's, which every subcommand answers too.
        let idem = concat!("idem ", env!("CARGO_PKG_VERSION"));
        let version = match &self.version {
            // idem's own binary.
            _ if name == "idem" => env!("CARGO_PKG_VERSION").to_owned(),
            Some(version) => format!("{version} ({idem})"),
            None => format!("({idem})"),
        };
        let command = Cli::<X, F, P>::command()
            .name(name.to_owned())
            .about(about)
            .version(version)
            .propagate_version(true);
        let topology = &self.topology;
        let mut defaults: Vec<(&str, String)> = vec![
            ("exchange", topology.exchange.clone()),
            ("routing_key", topology.routing_key.clone()),
            ("queue", topology.queue.clone()),
            (
                "dead_letter_exchange",
                topology.dead_letter_exchange.clone(),
            ),
            ("dead_letter_queue", topology.dead_letter_queue.clone()),
            ("consumer_group", self.consumer_group.clone()),
            (
                "retry_delays",
                duration::format_list(topology.retry.delays()),
            ),
            ("max_attempts", topology.retry.attempts().to_string()),
            ("delivery_limit", topology.delivery_limit.to_string()),
            ("quorum_size", topology.quorum_size.to_string()),
            ("slots", topology.slots.to_string()),
        ];
        defaults.extend(self.settings.iter().map(|(id, value)| (*id, value.clone())));
        let command = with_defaults(command, &defaults);
        // Without sources of the service's own, `--file` is the only one.
        let own_sources = P::augment_args(clap::Command::new("publish"))
            .get_arguments()
            .next()
            .is_some();
        if own_sources {
            command
        } else {
            command.mut_subcommand("publish", |publish| {
                publish.mut_arg("file", |file| file.required(true))
            })
        }
    }

    /// Parses the process's arguments, sets up logging and signals, runs
    /// the command, and says how it went: 0, 1 when it failed (one line on
    /// standard error), 2 for a usage error.
    pub fn run(self) -> ExitCode {
        self.run_from(std::env::args_os())
    }

    /// [`run`](Service::run) with these arguments, the binary's name first.
    pub fn run_from<I, T>(self, args: I) -> ExitCode
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
        let name = self.binary_name(args.first().map(OsString::as_os_str));
        crate::program::set(&name);
        let command = self.command_named(&name);
        let cli = match command
            .clone()
            .try_get_matches_from(&args)
            .and_then(|matches| Cli::<X, F, P>::from_arg_matches(&matches))
        {
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
                let line = format!(
                    "{} (see {} --help)",
                    blame_env(&usage_error(&e), &e, &command, &args),
                    asked(&command, &args)
                );
                telemetry::fatal_as(&name, log_format_asked(&args), &line);
                return ExitCode::from(2);
            }
        };
        let format = cli.log_format;
        let filter = match &cli.command {
            Command::Own(own) => own.log_filter(),
            // The report is the output; its workers' lines are noise.
            Command::Check(_) => CHECK_LOG_FILTER,
            _ => DEFAULT_LOG_FILTER,
        };
        let _telemetry = match telemetry::install(&name, filter, format) {
            Ok(telemetry) => telemetry,
            Err(e) => {
                telemetry::fatal_as(&name, format, &e.to_string());
                return ExitCode::from(2);
            }
        };
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
                telemetry::fatal_as(
                    &name,
                    format,
                    &format!("cannot start the async runtime: {e}"),
                );
                return ExitCode::FAILURE;
            }
        };
        runtime.block_on(async {
            let shutdown = CancellationToken::new();
            if let Err(e) = watch_signals(shutdown.clone()) {
                telemetry::fatal_as(
                    &name,
                    format,
                    &format!("cannot install signal handlers: {e}"),
                );
                return ExitCode::FAILURE;
            }
            match self.dispatch(cli.command, shutdown).await {
                Ok(code) => code,
                Err(e) => {
                    let (line, code) = failed(&e, &command, &args);
                    telemetry::fatal_as(&name, format, &line);
                    code
                }
            }
        })
    }

    /// Runs one command.
    async fn dispatch(
        self,
        command: Command<X, F, P>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<ExitCode> {
        let handler = self.handler;
        match command {
            Command::Migrate(args) => {
                let database = args.database.config(1);
                let pool = database.pool()?;
                let server = database.describe();
                let applied = match migrate::run_when_ready::<H>(
                    &server,
                    &pool,
                    database.schema.as_deref(),
                    args.wait.startup_timeout(),
                    &shutdown,
                )
                .await
                {
                    Ok(applied) => applied,
                    // Says which database itself.
                    Err(migrate::MigrateError::Ready(error)) => return Err(error.into()),
                    Err(error) => {
                        return Err(
                            anyhow::Error::new(error).context(format!("migrating {server}"))
                        );
                    }
                };
                let place = match &database.schema {
                    Some(schema) => format!("{server}, schema {schema}"),
                    None => format!("{server}, its search_path"),
                };
                match applied.as_slice() {
                    [] => println!("migrations: {place} is up to date"),
                    names => println!("migrations: applied {} to {place}", names.join(", ")),
                }
            }
            Command::Worker(args) => {
                let mut config = args.config()?;
                config.outgoing.clone_from(&self.outgoing);
                let handler = Arc::new(handler);
                let companions = args.companions(&config, &handler, &shutdown).await?;
                let start = |config| {
                    let start = WorkerStart {
                        config,
                        shutdown: shutdown.clone(),
                    };
                    args.own.start(Arc::clone(&handler), start)
                };
                companions.around(config, &shutdown, start).await?;
            }
            Command::Publish(args) => return publish(&args, &handler, &shutdown).await,
            Command::Relay(args) => {
                return relay_outbox::<H>(&args, &self.outgoing, &shutdown).await;
            }
            Command::Prune(args) => {
                let settings = args.config()?;
                let outcome = prune::run::<H>(&settings, &shutdown).await?;
                println!("{outcome}");
            }
            Command::Requeue(args) => {
                let (config, action, view) = args.config()?;
                return dead_letters(&config, &action, view, &handler, &shutdown).await;
            }
            Command::Dlq(args) => {
                let (config, action, view) = args.config()?;
                return dead_letters(&config, &action, view, &handler, &shutdown).await;
            }
            Command::Reconcile(args) => {
                let config = args.config()?;
                let found = reconcile::run(&config, &handler, &shutdown).await?;
                println!("{found}");
                if !found.matched() {
                    return Ok(ExitCode::FAILURE);
                }
            }
            Command::Status(args) => {
                let status = status::run::<H>(&args.config()?, &shutdown).await?;
                println!("{status}");
            }
            Command::Parked(args) => {
                let (target, action) = args.config(self.topology.clone())?;
                let report = parked::run::<H>(&target, &action, &shutdown).await?;
                println!("{report}");
                if !report.done() {
                    return Ok(ExitCode::FAILURE);
                }
            }
            Command::Console(args) => {
                let config = args.config()?;
                let console = Console::new(config, Arc::new(handler), shutdown).await?;
                console.serve(args.http_addr).await?;
            }
            Command::Check(args) => return prove(&args, handler, &self.outgoing, &shutdown).await,
            Command::Own(own) => return own.run(&handler, shutdown).await,
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// The one line a command that failed with `e` ends with, and its exit
/// code: flags that parsed but can never work together are a usage error
/// (2), as clap's own are; anything else is a failure (1), naming where the
/// servers' URLs came from and the patience it waited out.
fn failed(e: &anyhow::Error, command: &clap::Command, args: &[OsString]) -> (String, ExitCode) {
    if e.is::<SettingError>() {
        let line = format!("{e} (see {} --help)", asked(command, args));
        return (line, ExitCode::from(2));
    }
    let database = origin(args, "--database-url", crate::vars::DATABASE_URL);
    let broker = origin(args, "--amqp-url", crate::vars::AMQP_URL);
    let mut line = one_line(e)
        .replace(crate::store::ConfigError::URL, &database)
        .replace(crate::broker::AmqpConfig::URL, &broker);
    if waited_out(e) {
        line.push_str(&format!(
            " (--startup-timeout, {}, says how long to wait)",
            crate::vars::STARTUP_TIMEOUT
        ));
    }
    (line, ExitCode::FAILURE)
}

/// `check`: the report, as text or JSON; exit code 1 unless every run
/// matched.
async fn prove<H: Handler>(
    args: &CheckArgs,
    handler: H,
    outgoing: &[Exchange],
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    let mut config = args.config()?;
    config.outgoing = outgoing.to_vec();
    // The binary has one handler value: the check's workers share it.
    let handler = Arc::new(handler);
    let report = match check::run_until(&config, move || Arc::clone(&handler), shutdown).await {
        Ok(report) => report,
        Err(check::CheckError::Usage(why)) => return Err(SettingError::new(why).into()),
        Err(check::CheckError::Interrupted) => return Ok(ExitCode::from(130)),
        Err(error) => return Err(anyhow::Error::new(error).context("check")),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    if !report.passed() {
        // The binary as the service names it, else as it was started.
        let again = format!(
            "seed {}; the same runs again (with the same AMQP_URL and DATABASE_URL): {}",
            args.seed,
            args.again(crate::program::name())
        );
        // JSON on stdout stays JSON.
        if args.json {
            eprintln!("{again}");
        } else {
            println!("{again}");
        }
    }
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `publish`: the bodies the service's own flags give, else those of
/// `--file`; exits 1 unless the broker confirmed every one.
async fn publish<H: Handler, P: PublishSources<H>>(
    args: &PublishArgs<P>,
    handler: &H,
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    let bodies = match (args.own.bodies(handler)?, &args.file) {
        (Some(bodies), _) => bodies,
        (None, Some(path)) => publish::read(path, handler, args.allow_invalid)?,
        (None, None) => {
            return Err(
                SettingError::new("publish needs --file FILE (`-`: standard input)").into(),
            );
        }
    };
    let summary = publish::run(&args.config(), handler, bodies, shutdown).await?;
    println!("{summary}");
    Ok(if summary.report.all_confirmed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `relay`: publishes the outbox until shutdown, or until it is empty.
async fn relay_outbox<H: Handler>(
    args: &RelayArgs,
    outgoing: &[Exchange],
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    let (mut config, database) = args.config();
    config.outgoing = outgoing.to_vec();
    let pool = database.pool()?;
    // The outbox is idem's: the handler's history is only checked for being there.
    match Store::new(pool.clone(), "")
        .wait_until_ready::<H>(&database.describe(), config.patience, shutdown)
        .await
    {
        Err(ReadyError::Interrupted) => return Ok(ExitCode::SUCCESS),
        ready => ready?,
    }
    let counters = relay::RelayCounters::default();
    let report = relay::run(&pool, &config, &counters, shutdown).await?;
    relay::log_report(&report);
    println!("relayed: {} sent, {} refused", report.sent, report.refused);
    if config.until_empty {
        // What is left was refused and waits for its next attempt.
        let client = pool.get().await.context("counting what is left")?;
        let left = crate::store::outbox::unsent(&client).await?;
        if left > 0 {
            println!("left in the outbox: {left} not sent (see the log for why)");
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `dlq` (or `requeue`) and prints what it did; exit code 1 when
/// something could not be replayed.
async fn dead_letters<H: Handler>(
    config: &dlq::DlqConfig,
    action: &dlq::Action,
    view: dlq::View,
    handler: &H,
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    if view == dlq::View::Summary {
        println!("{}", dlq::summary::<H>(config, shutdown).await?);
        return Ok(ExitCode::SUCCESS);
    }
    let progress = match action {
        dlq::Action::List => Progress::hidden(),
        dlq::Action::Sync => Progress::new("syncing", 0),
        dlq::Action::Replay { .. } | dlq::Action::ReplayEdited { .. } => {
            Progress::new("replaying", 0)
        }
        dlq::Action::Discard { .. } => Progress::new("discarding", 0),
    };
    let report = dlq::run_showing(config, action, handler, &progress, shutdown).await;
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

/// `command` with each argument of `defaults` (by id) defaulting to its
/// value, in every subcommand that has it; one left empty stays required.
fn with_defaults(mut command: clap::Command, defaults: &[(&str, String)]) -> clap::Command {
    for (id, value) in defaults {
        let present = command.get_arguments().any(|arg| arg.get_id() == *id);
        if present && !value.is_empty() {
            let value = (*value).clone();
            command = command.mut_arg(*id, |arg| arg.default_value(value).required(false));
        }
    }
    let subcommands: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    for name in subcommands {
        command = command.mut_subcommand(name, |sub| with_defaults(sub, defaults));
    }
    command
}

/// clap's explanation on one line: what is wrong, the arguments it names,
/// its suggestion or the valid values.
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
    parts.join("; ")
}

/// The binary, and the subcommands named in `args` (`idem dlq replay`), as
/// far as they are known: whose help to read.
fn asked(command: &clap::Command, args: &[OsString]) -> String {
    asked_command(command, args).0.join(" ")
}

/// The names of [`asked`], and the last subcommand's definition.
fn asked_command(command: &clap::Command, args: &[OsString]) -> (Vec<String>, clap::Command) {
    let mut command = command.clone();
    let mut path = vec![command.get_name().to_owned()];
    for arg in args.iter().skip(1) {
        let arg = arg.to_string_lossy();
        let Some(sub) = command.find_subcommand(arg.as_ref()).cloned() else {
            continue;
        };
        path.push(arg.into_owned());
        command = sub;
    }
    (path, command)
}

/// True when `flag` (`--database-url`) is among `args`, alone or with `=`.
fn given(args: &[OsString], flag: &str) -> bool {
    args.iter().skip(1).any(|arg| {
        let arg = arg.to_string_lossy();
        arg == flag
            || arg
                .strip_prefix(flag)
                .is_some_and(|rest| rest.starts_with('='))
    })
}

/// Where a setting came from, for an error about it: its flag when it is
/// on the command line, else its environment variable.
fn origin(args: &[OsString], flag: &str, env: &str) -> String {
    if given(args, flag) {
        flag.to_owned()
    } else {
        env.to_owned()
    }
}

/// `line`, clap's words for a value it refused, naming the environment
/// variable rather than the flag when the value came from there: clap
/// blames the flag either way.
fn blame_env(
    line: &str,
    error: &clap::Error,
    command: &clap::Command,
    args: &[OsString],
) -> String {
    use clap::error::{ContextKind, ContextValue};
    if !matches!(
        error.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return line.to_owned();
    }
    let Some(ContextValue::String(shown)) = error.get(ContextKind::InvalidArg) else {
        return line.to_owned();
    };
    let flag = shown.split_whitespace().next().unwrap_or_default();
    let (_, leaf) = asked_command(command, args);
    let env = leaf
        .get_arguments()
        .find(|arg| {
            arg.get_long()
                .is_some_and(|long| flag == format!("--{long}"))
        })
        .and_then(|arg| arg.get_env())
        .map(|env| env.to_string_lossy().into_owned());
    match env {
        Some(env) if !given(args, flag) && std::env::var_os(&env).is_some() => line.replace(
            &format!("for '{shown}'"),
            &format!("in {env} (read for {flag})"),
        ),
        _ => line.to_owned(),
    }
}

/// The log format asked for, read from the raw arguments and environment:
/// for the line that says the arguments do not parse.
fn log_format_asked(args: &[OsString]) -> LogFormat {
    let json = args
        .windows(2)
        .any(|pair| pair[0] == "--log-format" && pair[1] == "json")
        || args.iter().any(|arg| arg == "--log-format=json")
        || std::env::var(vars::LOG_FORMAT).is_ok_and(|format| format == "json");
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

/// True when `error` is a service that did not answer within the start-up
/// timeout: the flag that would have waited longer is worth naming.
fn waited_out(error: &anyhow::Error) -> bool {
    use crate::broker::ConnectError;
    use crate::error::CommandError;
    use crate::worker::WorkerError;
    let waited = |cause: &(dyn std::error::Error + 'static)| {
        matches!(
            cause.downcast_ref::<ReadyError>(),
            Some(ReadyError::Unavailable { .. })
        ) || matches!(
            cause.downcast_ref::<ConnectError>(),
            Some(ConnectError::Unreachable { .. })
        ) || matches!(
            cause.downcast_ref::<WorkerError>(),
            Some(
                WorkerError::Database(ReadyError::Unavailable { .. })
                    | WorkerError::Connect(ConnectError::Unreachable { .. })
            )
        )
    };
    // A command's error holds its own chain, whose outermost error is
    // known only from inside.
    error.chain().any(|cause| {
        waited(cause)
            || cause
                .downcast_ref::<CommandError>()
                .is_some_and(|command| command.chain().any(waited))
    })
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
        info!("shutdown signal received; a second one exits at once");
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

#[cfg(test)]
mod tests;
