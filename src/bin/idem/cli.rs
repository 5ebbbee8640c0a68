//! Flags and environment variables, and their translation into the typed
//! settings the library takes. Every flag has an environment fallback
//! ([`idem::vars`]); every default is the library's. Each subcommand takes
//! the groups of flags it uses, and lists only those in its help.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};
use tracing::warn;

use idem::broker::{AmqpConfig, PublishOptions, Topology};
use idem::commands::bench::{self, BenchConfig};
use idem::commands::dlq::{Action, DlqConfig, Filter, View};
use idem::commands::lab::{LabConfig, Strategy};
use idem::commands::prune::PruneSettings;
use idem::commands::publish::{PublishConfig, Source};
use idem::commands::reconcile::ReconcileConfig;
use idem::commands::status::StatusConfig;
use idem::duration;
use idem::generate::LoadSpec;
use idem::points::{self, PaymentSucceeded};
use idem::relay::RelayConfig;
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;
use idem::telemetry::LogFormat;
use idem::vars;
use idem::worker::{EpochSettings, Mode, WorkerConfig};

/// Longest consumer group: `mq_consume_record.consumer_group`.
const MAX_CONSUMER_GROUP_CHARS: usize = 64;

/// idem: exactly-once effects from at-least-once RabbitMQ delivery.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
pub(crate) struct Cli {
    /// Log format.
    #[arg(
        long,
        env = vars::LOG_FORMAT,
        default_value = LogFormat::default().as_flag(),
        value_parser = choice(&LogFormat::ALL, |format| format.as_flag()),
        global = true,
        help_heading = "Global options"
    )]
    pub(crate) log_format: LogFormat,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Apply idem's and the points handler's migrations (idempotent; safe to
    /// run concurrently).
    Migrate(MigrateArgs),
    /// Consume and apply events until SIGINT/SIGTERM, then drain and exit 0.
    Worker(Box<WorkerArgs>),
    /// Publish events with publisher confirms; exits 1 if any is nacked or returned.
    Publish(PublishArgs),
    /// Replay dead-lettered messages to the queue they died in (all of them;
    /// `idem dlq` filters).
    Requeue(RequeueArgs),
    /// Dead-letter triage: a summary, a listing, a replay or a discard, of
    /// the dead letters that match the filters.
    Dlq(DlqArgs),
    /// A consumer group at a glance: its queues, records, ledger and dead letters.
    Status(StatusArgs),
    /// Compare the upstream's export of the events it sent with what idem
    /// recorded; exits 1 unless everything matches.
    Reconcile(ReconcileArgs),
    /// Run the whole story on local services, on data of its own, and report.
    Demo(DemoArgs),
    /// Measure throughput against the broker's ceiling, on data of its own.
    Bench(BenchArgs),
    /// Publish what the outbox holds (with confirms), until SIGINT/SIGTERM
    /// or, with --until-empty, until nothing is due.
    Relay(RelayArgs),
    /// Remove the consume records older than a window (a whole epoch at a
    /// time), and the ledger and outbox rows older than it, keeping what a
    /// dead letter may still need.
    Prune(PruneArgs),
    /// Run the deduplication strategies a team might choose side by side,
    /// under the same faults, and show what each does to the effect.
    Lab(LabArgs),
}

/// Where RabbitMQ is.
#[derive(Debug, Args)]
#[command(next_help_heading = "RabbitMQ")]
pub(crate) struct AmqpArgs {
    /// RabbitMQ URL, vhost included (`%2f` is `/`); for a cluster, one URL
    /// per node, separated by commas.
    #[arg(
        long,
        env = vars::AMQP_URL,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    pub(crate) amqp_url: String,
    /// With an `amqps://` URL: CA certificates (PEM) the broker's certificate
    /// may chain to, besides the system's.
    #[arg(long, env = vars::AMQP_CA_FILE)]
    pub(crate) amqp_ca_file: Option<PathBuf>,
}

/// Where PostgreSQL is, and how idem's sessions behave.
#[derive(Debug, Args)]
#[command(next_help_heading = "PostgreSQL")]
pub(crate) struct DatabaseArgs {
    /// PostgreSQL URL or key/value connection string.
    #[arg(
        long,
        env = vars::DATABASE_URL,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        hide_env_values = true
    )]
    pub(crate) database_url: String,
    /// With `sslmode=require` in the database URL: CA certificates (PEM) the
    /// server's certificate must chain to; default: the system's.
    #[arg(long, env = vars::DATABASE_CA_FILE)]
    pub(crate) database_ca_file: Option<PathBuf>,
    /// Schema for idem's tables (created by `migrate`); default: the server's search_path.
    #[arg(long, env = vars::SCHEMA)]
    pub(crate) schema: Option<String>,
    /// How long a statement waits for a lock before it fails (and its
    /// deliveries are held and retried, with a log line), instead of hanging.
    #[arg(
        long,
        env = vars::LOCK_TIMEOUT,
        default_value_t = Wait(DatabaseConfig::DEFAULT_LOCK_TIMEOUT)
    )]
    pub(crate) lock_timeout: Wait,
    /// How long a statement may run before PostgreSQL cancels it (held and
    /// retried as well). Migrations have none.
    #[arg(
        long,
        env = vars::STATEMENT_TIMEOUT,
        default_value_t = Wait(DatabaseConfig::DEFAULT_STATEMENT_TIMEOUT)
    )]
    pub(crate) statement_timeout: Wait,
}

/// How long to wait for the services.
#[derive(Debug, Args)]
#[command(next_help_heading = "Waiting")]
pub(crate) struct WaitArgs {
    /// How long to wait for PostgreSQL and RabbitMQ to answer at start (and
    /// for RabbitMQ after a connection loss, for publish and the dead-letter
    /// commands).
    #[arg(
        long,
        env = vars::STARTUP_TIMEOUT,
        default_value_t = Wait(WorkerConfig::DEFAULT_STARTUP_TIMEOUT)
    )]
    pub(crate) startup_timeout: Wait,
}

/// Where events are published.
#[derive(Debug, Args)]
#[command(next_help_heading = "Topology")]
pub(crate) struct RouteArgs {
    /// Exchange producers publish to (topic).
    #[arg(long, env = vars::EXCHANGE, default_value = points::EXCHANGE)]
    pub(crate) exchange: String,
    /// Routing key of payment events.
    #[arg(long, env = vars::ROUTING_KEY, default_value = points::ROUTING_KEY)]
    pub(crate) routing_key: String,
}

/// Which dead-letter queue.
#[derive(Debug, Args)]
#[command(next_help_heading = "Topology")]
pub(crate) struct DeadLetterQueueArgs {
    /// Dead-letter queue (classic).
    #[arg(long, env = vars::DEAD_LETTER_QUEUE, default_value = points::DEAD_LETTER_QUEUE)]
    pub(crate) dead_letter_queue: String,
}

/// The queues of a consumer group.
#[derive(Debug, Args)]
#[command(next_help_heading = "Topology")]
pub(crate) struct QueueArgs {
    /// Work queue (quorum).
    #[arg(long, env = vars::QUEUE, default_value = points::QUEUE)]
    pub(crate) queue: String,
    /// Dead-letter exchange.
    #[arg(
        long,
        env = vars::DEAD_LETTER_EXCHANGE,
        default_value = points::DEAD_LETTER_EXCHANGE
    )]
    pub(crate) dead_letter_exchange: String,
    #[command(flatten)]
    pub(crate) dead_letters: DeadLetterQueueArgs,
    /// The work queue's x-delivery-limit: a backstop above --max-attempts for
    /// a message that crashes the worker itself.
    #[arg(
        long,
        env = vars::DELIVERY_LIMIT,
        default_value_t = Topology::DEFAULT_DELIVERY_LIMIT,
        value_parser = clap::value_parser!(u32).range(1..=10_000)
    )]
    pub(crate) delivery_limit: u32,
    /// How long a failed message waits before its next attempt, after the
    /// first failure, the second, …; the last repeats until --max-attempts.
    /// Each delay has a wait queue; `0` returns the message at once.
    #[arg(
        long,
        env = vars::RETRY_DELAYS,
        default_value_t = Delays(Topology::DEFAULT_RETRY_DELAYS.to_vec())
    )]
    pub(crate) retry_delays: Delays,
    /// Replicas of each quorum queue idem creates (x-quorum-initial-group-size);
    /// a cluster of fewer nodes gives each node one. A queue that exists keeps
    /// its replicas.
    #[arg(
        long,
        env = vars::QUORUM_SIZE,
        default_value_t = Topology::DEFAULT_QUORUM_SIZE,
        value_parser = clap::value_parser!(u32).range(1..=99)
    )]
    pub(crate) quorum_size: u32,
}

/// Whose consume records and failure ledger.
#[derive(Debug, Args)]
#[command(next_help_heading = "Topology")]
pub(crate) struct GroupArgs {
    /// Consumer group: part of the deduplication key, so each group applies
    /// an event once.
    #[arg(long, env = vars::CONSUMER_GROUP, default_value = points::CONSUMER_GROUP)]
    pub(crate) consumer_group: String,
}

/// `idem migrate`.
#[derive(Debug, Args)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

/// `idem worker`.
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// Genuine failures (counted in the failure ledger) after which a message is dead-lettered.
    #[arg(
        long,
        env = vars::MAX_ATTEMPTS,
        default_value_t = WorkerConfig::DEFAULT_MAX_ATTEMPTS,
        value_parser = clap::value_parser!(u32).range(1..=1000)
    )]
    pub(crate) max_attempts: u32,
    /// `batch`: many deliveries per transaction; `per-message`: one transaction per delivery.
    #[arg(
        long,
        env = vars::MODE,
        default_value = Mode::Batch.as_flag(),
        value_parser = choice(&Mode::ALL, |mode| mode.as_flag())
    )]
    pub(crate) mode: Mode,
    /// Most unacknowledged deliveries in this worker [default: 1000 in batch mode, 64 per message].
    #[arg(long, env = vars::PREFETCH, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefetch: Option<u16>,
    /// Batch mode: most deliveries in one transaction [default: 200].
    #[arg(long, env = vars::BATCH_SIZE, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) batch_size: Option<u32>,
    /// Batch mode: how long a batch waits for more deliveries after its first.
    #[arg(long, env = vars::BATCH_WAIT, default_value_t = Wait(WorkerConfig::DEFAULT_BATCH_WAIT))]
    pub(crate) batch_wait: Wait,
    /// Most transactions in flight at once [default: 3 in batch mode, 16 per message].
    #[arg(long, env = vars::MAX_IN_FLIGHT, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) max_in_flight: Option<u32>,
    /// Most PostgreSQL connections [default: transactions in flight + 2].
    #[arg(long, env = vars::POOL_SIZE, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) pool_size: Option<u32>,
    /// Bodies larger than this many bytes are invalid (dead-lettered unparsed).
    #[arg(long, env = vars::MAX_BODY_BYTES, default_value_t = WorkerConfig::DEFAULT_MAX_BODY_BYTES)]
    pub(crate) max_body_bytes: usize,
    /// After SIGINT/SIGTERM, how long in-flight work may take before the worker closes anyway.
    #[arg(
        long,
        env = vars::SHUTDOWN_TIMEOUT,
        default_value_t = Wait(WorkerConfig::DEFAULT_SHUTDOWN_TIMEOUT)
    )]
    pub(crate) shutdown_timeout: Wait,
    /// Serve /metrics (Prometheus), /healthz and /readyz on this address
    /// (e.g. 127.0.0.1:9475) [default: nowhere].
    #[arg(long, env = vars::HTTP_ADDR)]
    pub(crate) http_addr: Option<std::net::SocketAddr>,
    /// How often to log what was done (applied, duplicates, dead-lettered,
    /// rate); `0` only logs the totals at the end.
    #[arg(
        long,
        env = vars::SUMMARY_INTERVAL,
        default_value_t = Wait(WorkerConfig::DEFAULT_SUMMARY_INTERVAL)
    )]
    pub(crate) summary_interval: Wait,
    /// Send a `points.credited` message for every credit, through the
    /// outbox, to this exchange (`points.events`, say; its consumers declare
    /// it and bind their queues) [default: send nothing].
    #[arg(long, env = vars::CREDITS_EXCHANGE)]
    pub(crate) credits_exchange: Option<String>,
    /// Do not relay the outbox from this worker (an `idem relay` does).
    #[arg(long, env = vars::NO_RELAY)]
    pub(crate) no_relay: bool,
    /// Keep the consume records for this long (e.g. 14d), pruning as
    /// `idem prune --older-than` does, every --prune-interval, one pruner
    /// per schema at a time [default: keep them all].
    #[arg(long, env = vars::RETENTION)]
    pub(crate) retention: Option<Wait>,
    /// With --retention: how often to prune.
    #[arg(long, env = vars::PRUNE_INTERVAL, default_value_t = Wait(PruneSettings::DEFAULT_INTERVAL))]
    pub(crate) prune_interval: Wait,
    /// Open the next epoch of the consume records once the current one has
    /// taken this many, so that the index claims insert into stays small
    /// (the closed epochs are looked into through filters); `0`: only the
    /// retention opens epochs, by age.
    #[arg(
        long,
        env = vars::EPOCH_RECORDS,
        default_value_t = EpochSettings::DEFAULT_MAX_RECORDS,
        help_heading = "Retention"
    )]
    pub(crate) epoch_records: u64,
    /// Most memory, in MiB, the filters of the closed epochs may take in
    /// this worker (4 bytes a record); the epochs past it are looked into
    /// for every event, and no epoch is opened by size.
    #[arg(
        long,
        env = vars::FILTER_MEMORY_MIB,
        default_value_t = EpochSettings::DEFAULT_FILTER_MEMORY >> 20,
        help_heading = "Retention"
    )]
    pub(crate) filter_memory_mib: usize,
    #[command(flatten)]
    pub(crate) retention_rules: RetentionArgs,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) route: RouteArgs,
    #[command(flatten)]
    pub(crate) queues: QueueArgs,
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

/// `idem reconcile`.
#[derive(Debug, Args)]
pub(crate) struct ReconcileArgs {
    /// The upstream's events: JSON lines (one body per line) or, for a name
    /// ending in .csv, CSV with a header whose columns are the body's fields.
    #[arg(long)]
    pub(crate) export: PathBuf,
    /// Also write a report here: a JSON line per event (its status, the last
    /// error) and per line that is none (why), then one per order whose
    /// points differ.
    #[arg(long)]
    pub(crate) report: Option<PathBuf>,
    /// Publish the missing events again, with confirms (safe: the worker
    /// applies each once).
    #[arg(long)]
    pub(crate) republish_missing: bool,
    /// Events compared per query.
    #[arg(long, default_value_t = ReconcileConfig::DEFAULT_CHUNK, value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    pub(crate) chunk: usize,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
    #[command(flatten)]
    pub(crate) route: RouteArgs,
}

impl ReconcileArgs {
    /// Settings of `idem reconcile`.
    pub(crate) fn config(&self) -> Result<ReconcileConfig, SettingError> {
        Ok(ReconcileConfig {
            dlq: self.target.config(Filter::default(), None)?,
            topology: Topology::new(
                &self.route.exchange,
                &self.route.routing_key,
                "",
                "",
                &self.target.dead_letters.dead_letter_queue,
            ),
            export: self.export.clone(),
            report: self.report.clone(),
            republish_missing: self.republish_missing,
            chunk: self.chunk,
        })
    }
}

/// How the consume records are kept: the safety rule of a retention, and
/// the epochs.
#[derive(Debug, Args)]
#[command(next_help_heading = "Retention")]
pub(crate) struct RetentionArgs {
    /// Refuse a retention window shorter than this: a message that comes
    /// back (a retry, the broker's redelivery, an operator's replay, a
    /// recovery) after its event's record is removed applies again.
    #[arg(long, env = vars::MIN_RETENTION, default_value_t = Wait(PruneSettings::DEFAULT_MIN_RETENTION))]
    pub(crate) min_retention: Wait,
    /// How long an epoch of the consume records takes claims before the
    /// next is opened: longer means fewer epochs for a claim to look into,
    /// shorter a smaller one to insert into, and a finer removal
    /// [default: half the window].
    #[arg(long, env = vars::EPOCH_LENGTH)]
    pub(crate) epoch_length: Option<Wait>,
}

/// `idem prune`.
#[derive(Debug, Args)]
pub(crate) struct PruneArgs {
    /// Remove what is older than this (e.g. 7d): an epoch once its newest
    /// record is.
    #[arg(long)]
    pub(crate) older_than: Wait,
    #[command(flatten)]
    pub(crate) retention: RetentionArgs,
    /// The group's retry delays (as the worker's --retry-delays): the
    /// window must be longer than a message takes through them all.
    #[arg(
        long,
        env = vars::RETRY_DELAYS,
        default_value_t = Delays(Topology::DEFAULT_RETRY_DELAYS.to_vec())
    )]
    pub(crate) retry_delays: Delays,
    /// The group's work queue: while messages wait there and no worker
    /// consumes it, no epoch is dropped.
    #[arg(long, env = vars::QUEUE, default_value = points::QUEUE, help_heading = "Topology")]
    pub(crate) queue: String,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

impl PruneArgs {
    /// Settings of `idem prune`.
    pub(crate) fn config(&self) -> Result<PruneSettings, SettingError> {
        Ok(self.retention.settings(
            self.target.config(Filter::default(), None)?,
            self.queue.clone(),
            self.older_than.0,
            &self.retry_delays,
        ))
    }
}

impl RetentionArgs {
    /// A prune's settings over `target` and `work_queue`, for a window of
    /// `older_than`.
    fn settings(
        &self,
        target: DlqConfig,
        work_queue: String,
        older_than: Duration,
        retry_delays: &Delays,
    ) -> PruneSettings {
        PruneSettings {
            target,
            work_queue,
            older_than,
            min_retention: self.min_retention.0,
            retry_delays: retry_delays.0.clone(),
            epoch_length: PruneSettings::epoch_length(
                older_than,
                self.epoch_length.as_ref().map(|length| length.0),
            ),
            lock_timeout: PruneSettings::DEFAULT_LOCK_TIMEOUT,
        }
    }
}

/// `idem relay`.
#[derive(Debug, Args)]
pub(crate) struct RelayArgs {
    /// Stop once nothing in the outbox is due, instead of waiting for more.
    #[arg(long)]
    pub(crate) until_empty: bool,
    /// Most messages published per transaction.
    #[arg(long, default_value_t = RelayConfig::DEFAULT_BATCH_SIZE, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub(crate) batch_size: i64,
    /// Batches in flight at once, each on a connection of its own; with more
    /// than one, a destination's messages may go out of id order.
    #[arg(long, default_value_t = RelayConfig::DEFAULT_LANES, value_parser = clap::value_parser!(u32).range(1..=64).map(|n| n as usize))]
    pub(crate) lanes: usize,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

impl RelayArgs {
    /// The relay's settings, and its database (a connection per lane).
    pub(crate) fn config(&self) -> (RelayConfig, DatabaseConfig) {
        let relay = RelayConfig {
            batch_size: self.batch_size,
            until_empty: self.until_empty,
            lanes: self.lanes,
            ..RelayConfig::new(self.amqp.config(), self.wait.startup_timeout.0)
        };
        let database = self.database.config(relay.lanes);
        (relay, database)
    }
}

/// `idem publish`: exactly one of --event-id, --file, --count.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("source").required(true).args(["event_id", "file", "count"]))]
pub(crate) struct PublishArgs {
    /// Publish one event with this id (with --order-id and --points).
    #[arg(long, requires_all = ["order_id", "points"])]
    pub(crate) event_id: Option<String>,
    /// Order of the single event.
    #[arg(long)]
    pub(crate) order_id: Option<String>,
    /// Points of the single event.
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) points: Option<i64>,
    /// Publish each line of this file (`-` for standard input) as one message.
    #[arg(long)]
    pub(crate) file: Option<PathBuf>,
    /// With --file: send lines that are not valid events as they are.
    #[arg(long, requires = "file")]
    pub(crate) allow_invalid: bool,
    /// Publish this many generated events.
    #[arg(long)]
    pub(crate) count: Option<usize>,
    /// With --count: share of messages that repeat an earlier event.
    #[arg(long, default_value_t = 0.1, value_parser = parse_ratio)]
    pub(crate) duplicate_ratio: f64,
    /// With --count: orders the events are spread over.
    #[arg(long, default_value_t = 100)]
    pub(crate) orders: usize,
    /// With --count: seed of the generator (default: the time).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// With --count: start of the generated ids (default: `load-<seed>`).
    #[arg(long)]
    pub(crate) prefix: Option<String>,
    /// Most publishes awaiting their confirm at once.
    #[arg(
        long,
        env = vars::CONFIRM_WINDOW,
        default_value_t = PublishOptions::DEFAULT_WINDOW as u32,
        value_parser = clap::value_parser!(u32).range(1..=65_535)
    )]
    pub(crate) window: u32,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) route: RouteArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

/// The dead-letter queue of a consumer group, and its failure ledger.
#[derive(Debug, Args)]
pub(crate) struct DlqTargetArgs {
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) dead_letters: DeadLetterQueueArgs,
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

/// `idem requeue`.
#[derive(Debug, Args)]
pub(crate) struct RequeueArgs {
    /// Replay at most this many messages.
    #[arg(long)]
    pub(crate) limit: Option<usize>,
    /// List what would be replayed (event, reason, count, time); move nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

/// `idem dlq`.
#[derive(Debug, Args)]
pub(crate) struct DlqArgs {
    #[command(subcommand)]
    pub(crate) action: DlqAction,
}

/// What to do with the dead letters that match.
#[derive(Debug, Subcommand)]
pub(crate) enum DlqAction {
    /// Count them per reason and per last error, oldest and newest; move nothing.
    Summary(FilterArgs),
    /// List them, each with what a replay would do and the ledger's count
    /// and last error; move nothing.
    List(FilterArgs),
    /// Send them back to the queue each died in, with a fresh budget;
    /// bodies the handler cannot decode stay, unless --include-invalid.
    Replay(ReplayArgs),
    /// Remove them, each written first to a JSON-lines file that is synced
    /// before the message is acked.
    Discard(DiscardArgs),
}

/// Which dead letters (every filter given must hold), and where they are.
#[derive(Debug, Args)]
pub(crate) struct FilterArgs {
    /// The reason of the latest death: rejected, delivery_limit, expired…
    #[arg(long)]
    pub(crate) reason: Option<String>,
    /// This event only.
    #[arg(long)]
    pub(crate) event_id: Option<String>,
    /// Part of the failure ledger's last error (or of why the body is invalid).
    #[arg(long)]
    pub(crate) error: Option<String>,
    /// Died longer ago than this (e.g. 1h).
    #[arg(long)]
    pub(crate) older_than: Option<Wait>,
    /// Died within this (e.g. 10m).
    #[arg(long)]
    pub(crate) newer_than: Option<Wait>,
    /// Only bodies the handler cannot decode, which can never apply.
    #[arg(long)]
    pub(crate) invalid: bool,
    /// Act on at most this many of those that match.
    #[arg(long)]
    pub(crate) limit: Option<usize>,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

/// `idem dlq replay`.
#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// At most this many replays per second.
    #[arg(long, value_parser = parse_rate)]
    pub(crate) rate: Option<f64>,
    /// Replay bodies the handler cannot decode too (they die again at once).
    #[arg(long)]
    pub(crate) include_invalid: bool,
    #[command(flatten)]
    pub(crate) filter: FilterArgs,
}

/// `idem dlq discard`.
#[derive(Debug, Args)]
pub(crate) struct DiscardArgs {
    /// The JSON-lines file the discarded messages are appended to.
    #[arg(long)]
    pub(crate) to: PathBuf,
    #[command(flatten)]
    pub(crate) filter: FilterArgs,
}

/// `idem status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) queues: QueueArgs,
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

impl StatusArgs {
    /// Settings of `idem status`.
    pub(crate) fn config(&self) -> Result<StatusConfig, SettingError> {
        let queues = &self.queues;
        Ok(StatusConfig {
            amqp: self.amqp.config(),
            database: self.database.config(2),
            topology: Topology {
                retry_delays: queues.retry_delays.0.clone(),
                // No exchange of the group is looked at.
                ..Topology::new(
                    "",
                    "",
                    &queues.queue,
                    &queues.dead_letter_exchange,
                    &queues.dead_letters.dead_letter_queue,
                )
            },
            consumer_group: self.group.consumer_group()?,
            patience: self.wait.startup_timeout.0,
        })
    }
}

/// `idem demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
}

/// `idem bench`.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Messages per run, duplicates included.
    #[arg(long, default_value_t = 200_000)]
    pub(crate) messages: usize,
    /// Share of duplicates in the load.
    #[arg(long, default_value_t = 0.1, value_parser = parse_ratio)]
    pub(crate) duplicate_ratio: f64,
    /// Orders the events are spread over.
    #[arg(long, default_value_t = 1000)]
    pub(crate) orders: usize,
    /// Random UUIDs as the load's event ids (as many producers use)
    /// instead of sequential ones.
    #[arg(long)]
    pub(crate) uuid_ids: bool,
    /// Consume records already in the table before a worker run (random
    /// UUID ids; loaded, then indexed, then checkpointed); several sizes,
    /// comma-separated, run each worker once per size in every round.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub(crate) prefill: Vec<u64>,
    /// The epochs (days of a retention window) the prefilled records are
    /// spread over, the last of them current: the worker inserts into a
    /// day's records and looks into the others through their filters
    /// [default: as the worker's opening by size leaves them: closed epochs
    /// of --epoch-records each, the current one half full].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefill_epochs: Option<u16>,
    /// The workers' --epoch-records [default: theirs].
    #[arg(long)]
    pub(crate) epoch_records: Option<u64>,
    /// Over each prefill, also a run during which the oldest day of the
    /// prefilled records is removed, as `idem prune` does.
    #[arg(long)]
    pub(crate) prune_during: bool,
    /// Prefetch of every consumer measured.
    #[arg(long, default_value_t = Mode::Batch.tuning().prefetch)]
    pub(crate) prefetch: u16,
    /// Batch mode: deliveries per transaction.
    #[arg(long, default_value_t = Mode::Batch.tuning().batch_size)]
    pub(crate) batch_size: usize,
    /// Batch mode: wait for a batch to fill.
    #[arg(long, default_value_t = Wait(WorkerConfig::DEFAULT_BATCH_WAIT))]
    pub(crate) batch_wait: Wait,
    /// Batch mode: transactions in flight.
    #[arg(long, default_value_t = Mode::Batch.tuning().max_in_flight)]
    pub(crate) batch_in_flight: usize,
    /// Per-message mode: transactions in flight.
    #[arg(long, default_value_t = Mode::PerMessage.tuning().max_in_flight)]
    pub(crate) per_message_in_flight: usize,
    /// Rounds; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// Also run pgbench with per-message mode's transaction at 16 clients.
    #[arg(long)]
    pub(crate) pgbench: bool,
    /// Also run batch mode announcing every credit through the outbox (its
    /// relay in the worker), counted done once every message is sent too.
    #[arg(long)]
    pub(crate) outbox: bool,
    /// What to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ceiling,per-message,batch",
        value_parser = choice(&bench::Mode::ALL, |mode| mode.as_flag())
    )]
    pub(crate) modes: Vec<bench::Mode>,
    /// Another build of idem whose worker is measured beside this one's, in
    /// the same rounds (a build of the main branch, say).
    #[arg(long)]
    pub(crate) baseline: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
}

/// `idem lab`.
#[derive(Debug, Args)]
pub(crate) struct LabArgs {
    /// Events per fault (and per step a consumer is killed after).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) events: u32,
    /// Copies of an event delivered at once, each to its own consumer.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub(crate) copies: u32,
    /// Messages of the fault-free load (10 % duplicates), for the throughput.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub(crate) load: u32,
    /// Consumers of the fault-free load.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) consumers: u32,
    /// Rounds of the fault-free load; the median throughput is shown.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=99))]
    pub(crate) rounds: u32,
    /// Prefetch of each consumer of the fault-free load.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefetch: u16,
    /// Expiry of the Redis strategy's keys, as a team would set it.
    #[arg(long, default_value = "1h")]
    pub(crate) redis_ttl: Wait,
    /// Their expiry when the lab lets a copy come back after it.
    #[arg(long, default_value = "1s")]
    pub(crate) short_ttl: Wait,
    /// The strategies to run, by name; default: all.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = choice(&Strategy::ALL, Strategy::slug)
    )]
    pub(crate) strategies: Vec<Strategy>,
    /// Seed of where the load's duplicates go.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Start of the lab's schemas, queues and Redis keys (replaced at each run).
    #[arg(long, default_value = LabConfig::DEFAULT_NAME)]
    pub(crate) name: String,
    /// Redis URL (a password in it is never printed).
    #[arg(
        long,
        env = vars::REDIS_URL,
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    pub(crate) redis_url: String,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
}

impl LabArgs {
    /// Settings of `idem lab`.
    pub(crate) fn config(&self) -> LabConfig {
        let mut config = LabConfig::new(
            self.amqp.config(),
            self.database.config(1),
            SecretUrl::new(self.redis_url.clone()),
        );
        if !self.strategies.is_empty() {
            config.strategies = self.strategies.clone();
        }
        LabConfig {
            events: self.events as usize,
            copies: self.copies as usize,
            load: self.load as usize,
            consumers: self.consumers as usize,
            rounds: self.rounds as usize,
            prefetch: self.prefetch,
            redis_ttl: self.redis_ttl.0,
            short_ttl: self.short_ttl.0,
            seed: self.seed,
            name: self.name.clone(),
            ..config
        }
    }
}

/// A parser that takes one of `all` by its flag, and lists them in help and
/// errors.
fn choice<T: Copy + Send + Sync + 'static>(
    all: &'static [T],
    flag: fn(T) -> &'static str,
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(all.iter().map(|value| flag(*value))).map(move |text| {
        all.iter()
            .copied()
            .find(|value| flag(*value) == text)
            .unwrap_or(all[0])
    })
}

/// A duration as flags take it (`250ms`, `30s`, `5m`, `1h`), and shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wait(pub(crate) Duration);

impl std::str::FromStr for Wait {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        duration::parse(text).map(Wait)
    }
}

impl fmt::Display for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&duration::format_days(self.0))
    }
}

/// A retry schedule as `--retry-delays` takes it: `1s,10s,1m,5m`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Delays(pub(crate) Vec<Duration>);

impl std::str::FromStr for Delays {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        duration::parse_list(text, Topology::MAX_RETRY_DELAY).map(Delays)
    }
}

impl fmt::Display for Delays {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&duration::format_list(&self.0))
    }
}

/// A setting that parsed but makes no sense.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct SettingError(String);

impl AmqpArgs {
    /// The broker.
    pub(crate) fn config(&self) -> AmqpConfig {
        let config = AmqpConfig::new(SecretUrl::new(self.amqp_url.clone()));
        match &self.amqp_ca_file {
            Some(path) => config.with_ca_file(path.clone()),
            None => config,
        }
    }
}

impl DatabaseArgs {
    /// The database, with a pool of `pool_size`.
    pub(crate) fn config(&self, pool_size: usize) -> DatabaseConfig {
        DatabaseConfig {
            schema: self.schema.clone(),
            pool_size,
            ca_file: self.database_ca_file.clone(),
            lock_timeout: self.lock_timeout.0,
            statement_timeout: self.statement_timeout.0,
            ..DatabaseConfig::new(SecretUrl::new(self.database_url.clone()))
        }
    }
}

impl GroupArgs {
    /// The consumer group, checked against its column.
    pub(crate) fn consumer_group(&self) -> Result<String, SettingError> {
        let group = self.consumer_group.trim();
        if group.is_empty() || group.chars().count() > MAX_CONSUMER_GROUP_CHARS {
            return Err(SettingError(format!(
                "--consumer-group ({}) must be 1 to {MAX_CONSUMER_GROUP_CHARS} characters, got {:?}",
                vars::CONSUMER_GROUP,
                self.consumer_group
            )));
        }
        Ok(group.to_owned())
    }
}

/// The topology of `route` and `queues`.
pub(crate) fn topology(route: &RouteArgs, queues: &QueueArgs) -> Topology {
    Topology {
        delivery_limit: queues.delivery_limit,
        retry_delays: queues.retry_delays.0.clone(),
        quorum_size: queues.quorum_size,
        ..Topology::new(
            &route.exchange,
            &route.routing_key,
            &queues.queue,
            &queues.dead_letter_exchange,
            &queues.dead_letters.dead_letter_queue,
        )
    }
}

impl WorkerArgs {
    /// With --retention, the settings of the worker's pruner, checked
    /// against the safety rule.
    pub(crate) fn pruner(&self) -> Result<Option<(PruneSettings, Duration)>, SettingError> {
        let Some(window) = &self.retention else {
            return Ok(None);
        };
        let target = DlqConfig {
            amqp: self.amqp.config(),
            database: self.database.config(2),
            consumer_group: self.group.consumer_group()?,
            dead_letter_queue: self.queues.dead_letters.dead_letter_queue.clone(),
            filter: Filter::default(),
            limit: None,
            patience: self.wait.startup_timeout.0,
        };
        let settings = self.retention_rules.settings(
            target,
            self.queues.queue.clone(),
            window.0,
            &self.queues.retry_delays,
        );
        settings
            .check_window()
            .map_err(|error| SettingError(format!("--retention: {error}")))?;
        Ok(Some((settings, self.prune_interval.0)))
    }

    /// Settings of `idem worker`: the library's defaults for its mode, and
    /// what the flags say. Warns (once telemetry is up) about a prefetch too
    /// small to keep the batches in flight fed.
    pub(crate) fn config(&self) -> Result<WorkerConfig, SettingError> {
        if self.queues.delivery_limit < self.max_attempts {
            return Err(SettingError(format!(
                "--delivery-limit ({}) must be at least --max-attempts ({}): it is the backstop \
                 above the failure ledger's budget, for messages that crash the worker",
                self.queues.delivery_limit, self.max_attempts
            )));
        }
        if let (Mode::PerMessage, Some(size)) = (self.mode, self.batch_size)
            && size != 1
        {
            return Err(SettingError(format!(
                "--batch-size ({size}) applies to batch mode; per-message mode applies one delivery per transaction"
            )));
        }
        let defaults = WorkerConfig::new(
            self.amqp.config(),
            self.database.config(DatabaseConfig::DEFAULT_POOL_SIZE),
            topology(&self.route, &self.queues),
            self.group.consumer_group()?,
        )
        .with_mode(self.mode);
        let max_in_flight = self
            .max_in_flight
            .map_or(defaults.max_in_flight, |n| n as usize);
        let prefetch = self.prefetch.unwrap_or(defaults.prefetch);
        // The default batch fits the prefetch it is given with; one asked
        // for must fit too.
        let batch_size = self
            .batch_size
            .map_or(defaults.batch_size.min(usize::from(prefetch)), |size| {
                size as usize
            });
        if batch_size > usize::from(prefetch) {
            return Err(SettingError(format!(
                "--batch-size ({batch_size}) is above --prefetch ({prefetch}): a batch could never fill"
            )));
        }
        let fed = batch_size * (max_in_flight + 1);
        if usize::from(prefetch) < fed {
            warn!(
                prefetch,
                batch_size,
                max_in_flight,
                "--prefetch is below --batch-size × (--max-in-flight + 1) = {fed}: \
                 the broker runs out of credit while batches commit, and throughput drops"
            );
        }
        // The extra connections serve the failure ledger while transactions hold the others.
        let pool_size = self.pool_size.map_or(max_in_flight + 2, |n| n as usize);
        Ok(WorkerConfig {
            database: DatabaseConfig {
                pool_size,
                ..defaults.database.clone()
            },
            prefetch,
            batch_size,
            batch_wait: self.batch_wait.0,
            max_in_flight,
            max_attempts: self.max_attempts,
            max_body_bytes: self.max_body_bytes,
            shutdown_timeout: self.shutdown_timeout.0,
            startup_timeout: self.wait.startup_timeout.0,
            http_addr: self.http_addr,
            summary_interval: self.summary_interval.0,
            relay: !self.no_relay,
            epochs: EpochSettings {
                max_records: (self.epoch_records > 0).then_some(self.epoch_records),
                filter_memory: self.filter_memory_mib.saturating_mul(1 << 20),
                ..defaults.epochs
            },
            ..defaults
        })
    }
}

impl PublishArgs {
    /// Settings and source of `idem publish`.
    pub(crate) fn config(&self) -> Result<(PublishConfig, Source), SettingError> {
        let config = PublishConfig {
            amqp: self.amqp.config(),
            exchange: self.route.exchange.clone(),
            routing_key: self.route.routing_key.clone(),
            options: PublishOptions {
                window: self.window as usize,
                patience: self.wait.startup_timeout.0,
            },
        };
        let source = if let (Some(event_id), Some(order_id), Some(points)) =
            (&self.event_id, &self.order_id, self.points)
        {
            let event = PaymentSucceeded {
                event_id: event_id.clone(),
                order_id: order_id.clone(),
                points,
            };
            // The same rules as the worker's, so a flag typo fails here.
            PaymentSucceeded::parse(&event.to_body())
                .map_err(|invalid| SettingError(format!("the event is invalid: {invalid}")))?;
            Source::One(event)
        } else if let Some(path) = &self.file {
            Source::Lines {
                path: path.clone(),
                allow_invalid: self.allow_invalid,
            }
        } else {
            let seed = self.seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
            });
            Source::Generated(LoadSpec {
                count: self.count.unwrap_or(0),
                duplicate_ratio: self.duplicate_ratio,
                orders: self.orders,
                seed,
                prefix: self
                    .prefix
                    .clone()
                    .unwrap_or_else(|| format!("load-{seed}")),
            })
        };
        Ok((config, source))
    }
}

impl BenchArgs {
    /// Settings of `idem bench`.
    pub(crate) fn config(&self) -> Result<BenchConfig, SettingError> {
        let worker_binary = std::env::current_exe().map_err(|e| {
            SettingError(format!("cannot find the idem binary to run workers: {e}"))
        })?;
        if let Some(baseline) = &self.baseline
            && !baseline.is_file()
        {
            return Err(SettingError(format!(
                "--baseline {}: no such file",
                baseline.display()
            )));
        }
        if self.outbox && !self.modes.contains(&bench::Mode::Batch) {
            return Err(SettingError(
                "--outbox measures batch mode: add batch to --modes".into(),
            ));
        }
        // The report takes each size's runs for rounds, one per round.
        if let Some(size) = self
            .prefill
            .iter()
            .enumerate()
            .find_map(|(i, size)| self.prefill[..i].contains(size).then_some(size))
        {
            return Err(SettingError(format!(
                "--prefill gives {size} twice: give each size once, and --rounds to repeat them"
            )));
        }
        Ok(BenchConfig {
            amqp: self.amqp.config(),
            database: self.database.config(2),
            messages: self.messages,
            duplicate_ratio: self.duplicate_ratio,
            orders: self.orders,
            uuid_ids: self.uuid_ids,
            prefill: self.prefill.clone(),
            prefill_epochs: self.prefill_epochs,
            epoch_records: self.epoch_records,
            prune_during: self.prune_during,
            prefetch: self.prefetch,
            batch_size: self.batch_size,
            batch_wait: self.batch_wait.0,
            batch_in_flight: self.batch_in_flight,
            per_message_in_flight: self.per_message_in_flight,
            rounds: self.rounds.max(1),
            pgbench: self.pgbench,
            outbox: self.outbox,
            modes: self.modes.clone(),
            worker_binary,
            baseline_binary: self.baseline.clone(),
        })
    }
}

impl DlqTargetArgs {
    /// The dead-letter queue, with `filter` and `limit`.
    fn config(&self, filter: Filter, limit: Option<usize>) -> Result<DlqConfig, SettingError> {
        Ok(DlqConfig {
            amqp: self.amqp.config(),
            database: self.database.config(2),
            consumer_group: self.group.consumer_group()?,
            dead_letter_queue: self.dead_letters.dead_letter_queue.clone(),
            filter,
            limit,
            patience: self.wait.startup_timeout.0,
        })
    }
}

impl RequeueArgs {
    /// Settings of `idem requeue`: every dead letter, invalid ones too.
    pub(crate) fn config(&self) -> Result<(DlqConfig, Action, View), SettingError> {
        let action = if self.dry_run {
            Action::List
        } else {
            Action::Replay {
                rate: None,
                include_invalid: true,
            }
        };
        let config = self.target.config(Filter::default(), self.limit)?;
        Ok((config, action, View::Listing))
    }
}

impl DlqArgs {
    /// Settings of `idem dlq`.
    pub(crate) fn config(&self) -> Result<(DlqConfig, Action, View), SettingError> {
        let (filter, action, view) = match &self.action {
            DlqAction::Summary(filter) => (filter, Action::List, View::Summary),
            DlqAction::List(filter) => (filter, Action::List, View::Listing),
            DlqAction::Replay(replay) => (
                &replay.filter,
                Action::Replay {
                    rate: replay.rate,
                    include_invalid: replay.include_invalid,
                },
                View::Listing,
            ),
            DlqAction::Discard(discard) => (
                &discard.filter,
                Action::Discard {
                    file: discard.to.clone(),
                },
                View::Listing,
            ),
        };
        let config = filter.target.config(
            Filter {
                reason: filter.reason.clone(),
                event_id: filter.event_id.clone(),
                error: filter.error.clone(),
                older_than: filter.older_than.map(|wait| wait.0),
                newer_than: filter.newer_than.map(|wait| wait.0),
                invalid: filter.invalid,
            },
            filter.limit,
        )?;
        Ok((config, action, view))
    }
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate > 0.0 && rate.is_finite() => Ok(rate),
        _ => Err(format!(
            "'{text}' is not a rate above 0 (messages per second)"
        )),
    }
}

fn parse_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!("'{text}' is not a ratio between 0 and 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn worker(args: &[&str]) -> Result<WorkerConfig, String> {
        let cli = Cli::try_parse_from([&["idem", "worker"][..], args].concat())
            .map_err(|e| e.to_string())?;
        let Command::Worker(args) = &cli.command else {
            return Err("parsed as another command".into());
        };
        args.config().map_err(|e| e.to_string())
    }

    #[test]
    fn verify_cli() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_prefill_size_given_twice_is_refused_by_name() -> Result<(), String> {
        let bench = |prefill: &str| {
            let cli = Cli::try_parse_from(["idem", "bench", "--prefill", prefill])
                .map_err(|e| e.to_string())?;
            let Command::Bench(args) = &cli.command else {
                return Err("parsed as another command".to_owned());
            };
            args.config()
                .map(|config| config.prefill)
                .map_err(|e| e.to_string())
        };
        assert_eq!(bench("0,5000,20000")?, [0, 5000, 20000]);
        assert_eq!(
            bench("0,5000,0"),
            Err("--prefill gives 0 twice: give each size once, and --rounds to repeat them".into())
        );
        Ok(())
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
                config.max_attempts,
                config.shutdown_timeout,
                config.startup_timeout
            ),
            (
                library.batch_wait,
                library.max_attempts,
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

    #[test]
    fn a_batch_larger_than_the_prefetch_is_refused() {
        let refused = worker(&["--prefetch", "100", "--batch-size", "200"]);
        assert!(refused.is_err_and(|e| e.contains("--batch-size (200) is above --prefetch (100)")));
        assert!(worker(&["--prefetch", "300", "--batch-size", "200"]).is_ok());
    }

    /// The help states the per-mode defaults in words; they are the library's.
    #[test]
    fn the_help_states_the_defaults_of_each_mode() {
        let command = Cli::command();
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
        let command = Cli::command();
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
        let publish = flags("publish");
        assert!(
            publish.contains(&"amqp-url".to_owned()) && publish.contains(&"exchange".to_owned())
        );
        assert!(!publish.iter().any(|flag| flag.starts_with("database")));
        assert!(!publish.contains(&"consumer-group".to_owned()));
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
    fn publish_needs_exactly_one_source() {
        assert!(Cli::try_parse_from(["idem", "publish"]).is_err());
        assert!(Cli::try_parse_from(["idem", "publish", "--count", "3", "--file", "x"]).is_err());
        assert!(Cli::try_parse_from(["idem", "publish", "--event-id", "e"]).is_err());
        assert!(Cli::try_parse_from(["idem", "publish", "--count", "3"]).is_ok());
    }

    #[test]
    fn a_consumer_group_longer_than_its_column_is_refused() {
        let long = "g".repeat(65);
        assert!(worker(&["--consumer-group", &long]).is_err());
    }
}
