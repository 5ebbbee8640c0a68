//! The groups of flags idem's commands take, each with its environment
//! fallback ([`crate::vars`]), and their translation into the typed
//! settings the library takes. Every default is the library's; the names
//! of the topology and the consumer group are the service's, set when the
//! command line is built ([`super::Service`]).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Subcommand};
use tracing::warn;

use crate::broker::{AmqpConfig, Topology};
use crate::check::CheckConfig;
use crate::commands::prune::PruneSettings;
use crate::commands::reconcile::ReconcileConfig;
use crate::commands::status::StatusConfig;
use crate::dlq::{Action, DlqConfig, Filter, View};
use crate::duration;
use crate::relay::RelayConfig;
use crate::secret::SecretUrl;
use crate::store::DatabaseConfig;
use crate::vars;
use crate::worker::{ConfigError, EpochSettings, Mode, WorkerConfig, check_consumer_group};

/// Where RabbitMQ is.
#[derive(Debug, Args)]
#[command(next_help_heading = "RabbitMQ")]
pub struct AmqpArgs {
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

/// Where PostgreSQL is.
#[derive(Debug, Args)]
#[command(next_help_heading = "PostgreSQL")]
pub struct ServerArgs {
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
}

/// Where PostgreSQL is, and how idem's sessions behave.
#[derive(Debug, Args)]
#[command(next_help_heading = "PostgreSQL")]
pub struct DatabaseArgs {
    #[command(flatten)]
    pub(crate) server: ServerArgs,
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
pub struct WaitArgs {
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
pub struct RouteArgs {
    /// Exchange producers publish to (topic).
    #[arg(long, env = vars::EXCHANGE)]
    pub(crate) exchange: String,
    /// Routing key of the events the work queue takes.
    #[arg(long, env = vars::ROUTING_KEY)]
    pub(crate) routing_key: String,
}

/// Which dead-letter queue.
#[derive(Debug, Args)]
#[command(next_help_heading = "Topology")]
pub(crate) struct DeadLetterQueueArgs {
    /// Dead-letter queue (quorum).
    #[arg(long, env = vars::DEAD_LETTER_QUEUE)]
    pub(crate) dead_letter_queue: String,
}

/// The queues of a consumer group.
#[derive(Debug, Args)]
#[command(next_help_heading = "Topology")]
pub(crate) struct QueueArgs {
    /// Work queue (quorum).
    #[arg(long, env = vars::QUEUE)]
    pub(crate) queue: String,
    /// Dead-letter exchange.
    #[arg(long, env = vars::DEAD_LETTER_EXCHANGE)]
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
    #[arg(long, env = vars::CONSUMER_GROUP)]
    pub(crate) consumer_group: String,
}

/// `migrate`.
#[derive(Debug, Args)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

/// `worker`, with the handler's own flags `F`.
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs<F: Args> {
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
    /// Most unacknowledged deliveries in this worker [default: 4000 in batch mode, 64 per message].
    #[arg(long, env = vars::PREFETCH, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefetch: Option<u16>,
    /// Batch mode: most deliveries in one transaction [default: 500].
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
    /// Connections a tally handler's claims share, each committed without waiting for its own flush; a shared flush confirms them before their acks; 0: none [default: 2 per message, 0 in batch mode].
    #[arg(long, env = vars::LANES, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub(crate) lanes: Option<u32>,
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
    #[arg(long, env = vars::HTTP_ADDR, value_parser = socket_addr)]
    pub(crate) http_addr: Option<std::net::SocketAddr>,
    /// How often to log what was done (applied, duplicates, dead-lettered,
    /// rate); `0` only logs the totals at the end.
    #[arg(
        long,
        env = vars::SUMMARY_INTERVAL,
        default_value_t = Wait(WorkerConfig::DEFAULT_SUMMARY_INTERVAL)
    )]
    pub(crate) summary_interval: Wait,
    #[command(flatten)]
    pub(crate) own: F,
    /// Do not relay the outbox from this worker (a `relay` does).
    #[arg(long, env = vars::NO_RELAY)]
    pub(crate) no_relay: bool,
    /// Keep the consume records for this long (e.g. 14d), pruning as
    /// `prune --older-than` does, every --prune-interval, one pruner
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

/// `check`.
#[derive(Debug, Args)]
pub(crate) struct CheckArgs {
    /// The events: message bodies, one per line (JSON lines), or the file
    /// `dlq discard --to` writes, so that an incident's letters become a test.
    #[arg(long, value_name = "FILE")]
    pub(crate) events: PathBuf,
    /// SQL run after the migrations in every schema the check makes (seed rows, say).
    #[arg(long, value_name = "FILE")]
    pub(crate) setup: Option<PathBuf>,
    /// A query that must return no row after every run (`SELECT id FROM
    /// accounts WHERE balance < 0`); give it once per invariant.
    #[arg(long = "invariant", value_name = "SQL")]
    pub(crate) invariants: Vec<String>,
    /// A query of an event id ($1) that counts how many times its effect is
    /// there (`SELECT count(*) FROM transfer_log WHERE event_id = $1`): once
    /// for every event idem applied, never for one it did not.
    #[arg(long, value_name = "SQL")]
    pub(crate) witness: Option<String>,
    /// A column left out of the comparisons (a timestamp the team knows to
    /// differ); give it once per column.
    #[arg(long = "ignore-column", value_name = "TABLE.COLUMN")]
    pub(crate) ignore_columns: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// Copies of every message in the runs that send copies at once.
    #[arg(long, default_value_t = CheckConfig::DEFAULT_COPIES, value_parser = clap::value_parser!(u32).range(2..=20).map(|n| n as usize))]
    pub(crate) copies: usize,
    /// Deliveries per batch, in batch mode and in batch equivalence.
    #[arg(long, default_value_t = CheckConfig::DEFAULT_BATCH_SIZE, value_parser = clap::value_parser!(u32).range(2..=8191).map(|n| n as usize))]
    pub(crate) batch_size: usize,
    /// Genuine failures after which a message is dead-lettered (the check
    /// retries at once).
    #[arg(
        long,
        default_value_t = CheckConfig::DEFAULT_MAX_ATTEMPTS,
        value_parser = clap::value_parser!(u32).range(1..=1000)
    )]
    pub(crate) max_attempts: u32,
    /// Seed of the orders the runs draw.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// How long one run may take before it is reported as unfinished.
    #[arg(long, default_value_t = Wait(CheckConfig::DEFAULT_PATIENCE))]
    pub(crate) patience: Wait,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: ServerArgs,
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

impl CheckArgs {
    /// Settings of `check`: the files read, the flags checked.
    pub(crate) fn config(&self) -> Result<CheckConfig, SettingError> {
        let events = crate::check::read_events(&self.events)
            .map_err(|error| SettingError::new(format!("--events: {error}")))?;
        let setup = match &self.setup {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|error| {
                SettingError::new(format!("--setup: cannot read {}: {error}", path.display()))
            })?),
            None => None,
        };
        let mut config = CheckConfig::new(
            self.amqp.config(),
            self.database.config(2),
            self.group.consumer_group()?,
            events,
        );
        config.setup = setup;
        config.invariants.clone_from(&self.invariants);
        config.witness.clone_from(&self.witness);
        config.ignore_columns.clone_from(&self.ignore_columns);
        config.copies = self.copies;
        config.batch_size = self.batch_size;
        config.max_attempts = self.max_attempts;
        config.seed = self.seed;
        config.patience = self.patience.0;
        config.startup_timeout = self.wait.startup_timeout();
        Ok(config)
    }
}

/// `reconcile`.
#[derive(Debug, Args)]
pub(crate) struct ReconcileArgs {
    /// The upstream's events: JSON lines (one body per line) or, for a name
    /// ending in .csv, CSV with a header whose columns are the body's fields.
    #[arg(long)]
    pub(crate) export: PathBuf,
    /// Also write a report here: a JSON line per event (its status, the last
    /// error) and per line that is none (why), then one per key whose
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
    /// Settings of `reconcile`.
    pub(crate) fn config(&self) -> Result<ReconcileConfig, SettingError> {
        Ok(ReconcileConfig {
            dlq: self.target.config(Filter::default(), None)?,
            // Where the missing events are published again, and where the
            // dead letters are; no queue of the group is looked at.
            topology: Topology {
                dead_letter_queue: self.target.dead_letters.dead_letter_queue.clone(),
                ..Topology::for_queue("").bound_to(&self.route.exchange, &self.route.routing_key)
            },
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

/// `prune`.
#[derive(Debug, Args)]
pub(crate) struct PruneArgs {
    /// Remove what is older than this (e.g. 7d): a closed epoch of consume
    /// records once even its newest record is older, and the ledger and
    /// sent outbox rows last written before it.
    #[arg(long)]
    pub(crate) older_than: Wait,
    /// Change nothing: say what would be removed, and what is kept and why.
    #[arg(long)]
    pub(crate) dry_run: bool,
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
    #[arg(long, env = vars::QUEUE, help_heading = "Topology")]
    pub(crate) queue: String,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

impl PruneArgs {
    /// Settings of `prune`.
    pub(crate) fn config(&self) -> Result<PruneSettings, SettingError> {
        Ok(PruneSettings {
            dry_run: self.dry_run,
            ..self.retention.settings(
                self.target.config(Filter::default(), None)?,
                self.queue.clone(),
                self.older_than.0,
                &self.retry_delays,
            )
        })
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
            dry_run: false,
        }
    }
}

/// `relay`.
#[derive(Debug, Args)]
pub(crate) struct RelayArgs {
    /// Stop once nothing in the outbox is due, instead of waiting for more.
    #[arg(long)]
    pub(crate) until_empty: bool,
    /// Most messages published per transaction.
    #[arg(long, default_value_t = RelayConfig::DEFAULT_BATCH_SIZE, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub(crate) batch_size: i64,
    /// Lanes relaying at once, each on a channel and two connections of its
    /// own; with more than one, a destination's messages may go out of id
    /// order.
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
    /// The relay's settings, and its database (two connections per lane).
    pub(crate) fn config(&self) -> (RelayConfig, DatabaseConfig) {
        let relay = RelayConfig {
            batch_size: self.batch_size,
            until_empty: self.until_empty,
            lanes: self.lanes,
            ..RelayConfig::new(self.amqp.config(), self.wait.startup_timeout.0)
        };
        let database = self.database.config(relay.connections());
        (relay, database)
    }
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

/// `requeue`.
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

/// `dlq`.
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
    /// Set the dead-letter index to what the queue holds (browsing every
    /// letter and giving it back): for letters that came by other ways than
    /// idem's worker, or after an upgrade; summary, status and prune say
    /// when the queue holds letters the index does not count, and name this.
    Sync(DlqTargetArgs),
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
    /// Look at every letter in the queue; by default a pass stops once it
    /// found as many matches as the dead-letter index counts, when the
    /// index counts every letter in the queue.
    #[arg(long)]
    pub(crate) every_letter: bool,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

/// `dlq replay`.
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

/// `dlq discard`.
#[derive(Debug, Args)]
pub(crate) struct DiscardArgs {
    /// The JSON-lines file the discarded messages are appended to.
    #[arg(long)]
    pub(crate) to: PathBuf,
    #[command(flatten)]
    pub(crate) filter: FilterArgs,
}

/// `status`.
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
    /// Settings of `status`.
    pub(crate) fn config(&self) -> Result<StatusConfig, SettingError> {
        let queues = &self.queues;
        Ok(StatusConfig {
            amqp: self.amqp.config(),
            database: self.database.config(2),
            topology: Topology {
                retry_delays: queues.retry_delays.0.clone(),
                dead_letter_exchange: queues.dead_letter_exchange.clone(),
                dead_letter_queue: queues.dead_letters.dead_letter_queue.clone(),
                // No exchange of the group is looked at.
                ..Topology::for_queue(&queues.queue)
            },
            consumer_group: self.group.consumer_group()?,
            patience: self.wait.startup_timeout.0,
        })
    }
}

/// A parser that takes one of `all` by its flag, and lists them in help and
/// errors.
#[doc(hidden)]
pub fn choice<T: Copy + Send + Sync + 'static>(
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
pub struct Wait(pub Duration);

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
pub struct Delays(pub Vec<Duration>);

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

/// An address to listen on, `HOST:PORT`; a port alone is told so.
fn socket_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    text.parse().map_err(|_| {
        if text.parse::<u16>().is_ok() {
            format!(
                "say HOST:PORT, such as 127.0.0.1:{text} (or 0.0.0.0:{text} for every interface)"
            )
        } else {
            "say HOST:PORT with an IP address, such as 127.0.0.1:9475".to_owned()
        }
    })
}

/// A setting that parsed but makes no sense, said in terms of its flags.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SettingError(String);

impl SettingError {
    /// What is wrong, naming the flags.
    pub fn new(why: impl Into<String>) -> Self {
        Self(why.into())
    }

    /// The library's refusal of a worker's settings, in terms of the
    /// flags that set them.
    pub(crate) fn of_worker(error: &ConfigError) -> Self {
        Self(match error {
            ConfigError::ConsumerGroup { group } => format!(
                "--consumer-group ({}) must be 1 to {} characters, got {group:?}",
                vars::CONSUMER_GROUP,
                crate::worker::MAX_CONSUMER_GROUP_CHARS
            ),
            ConfigError::Unbound { queue } => format!(
                "--exchange ({}) and --routing-key ({}) must name where the events of {queue} come from",
                vars::EXCHANGE,
                vars::ROUTING_KEY
            ),
            ConfigError::DeliveryLimitBelowAttempts {
                delivery_limit,
                max_attempts,
            } => format!(
                "--delivery-limit ({delivery_limit}) must be at least --max-attempts ({max_attempts}): \
                 it is the backstop above the failure ledger's budget, for messages that crash the worker"
            ),
            ConfigError::BatchAbovePrefetch {
                batch_size,
                prefetch,
            } => format!(
                "--batch-size ({batch_size}) is above --prefetch ({prefetch}): a batch could never fill"
            ),
            ConfigError::PoolTooSmall {
                pool_size,
                max_in_flight,
            } => format!(
                "--pool-size ({pool_size}) must be at least --max-in-flight ({max_in_flight}) + 2: \
                 the extra two serve the failure ledger while transactions hold the others"
            ),
            ConfigError::Zero(field) => format!("--{} must be at least 1", field.replace('_', "-")),
        })
    }
}

impl AmqpArgs {
    /// The broker.
    pub fn config(&self) -> AmqpConfig {
        let config = AmqpConfig::new(SecretUrl::new(self.amqp_url.clone()));
        match &self.amqp_ca_file {
            Some(path) => config.with_ca_file(path.clone()),
            None => config,
        }
    }
}

impl ServerArgs {
    /// The database, with a pool of `pool_size` and idem's defaults.
    pub fn config(&self, pool_size: usize) -> DatabaseConfig {
        DatabaseConfig {
            pool_size,
            ca_file: self.database_ca_file.clone(),
            ..DatabaseConfig::new(SecretUrl::new(self.database_url.clone()))
        }
    }
}

impl DatabaseArgs {
    /// The database, with a pool of `pool_size`.
    pub fn config(&self, pool_size: usize) -> DatabaseConfig {
        DatabaseConfig {
            schema: self.schema.clone(),
            lock_timeout: self.lock_timeout.0,
            statement_timeout: self.statement_timeout.0,
            ..self.server.config(pool_size)
        }
    }
}

impl WaitArgs {
    /// How long to wait for the services.
    pub fn startup_timeout(&self) -> Duration {
        self.startup_timeout.0
    }
}

impl RouteArgs {
    /// The exchange producers publish to.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key of the events.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }
}

impl GroupArgs {
    /// The consumer group, checked against its column.
    pub(crate) fn consumer_group(&self) -> Result<String, SettingError> {
        let group = self.consumer_group.trim();
        check_consumer_group(group).map_err(|_| {
            SettingError::of_worker(&ConfigError::ConsumerGroup {
                group: self.consumer_group.clone(),
            })
        })?;
        Ok(group.to_owned())
    }
}

/// The topology of `route` and `queues`.
pub(crate) fn topology(route: &RouteArgs, queues: &QueueArgs) -> Topology {
    Topology {
        delivery_limit: queues.delivery_limit,
        retry_delays: queues.retry_delays.0.clone(),
        quorum_size: queues.quorum_size,
        dead_letter_exchange: queues.dead_letter_exchange.clone(),
        dead_letter_queue: queues.dead_letters.dead_letter_queue.clone(),
        ..Topology::for_queue(&queues.queue).bound_to(&route.exchange, &route.routing_key)
    }
}

impl<F: Args> WorkerArgs<F> {
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
            every_letter: false,
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

    /// Settings of `worker`: the library's defaults for its mode, and
    /// what the flags say. Warns (once telemetry is up) about a prefetch too
    /// small to keep the batches in flight fed.
    pub(crate) fn config(&self) -> Result<WorkerConfig, SettingError> {
        if let (Mode::PerMessage, Some(size)) = (self.mode, self.batch_size)
            && size != 1
        {
            return Err(SettingError(format!(
                "--batch-size ({size}) applies to batch mode; per-message mode applies one delivery per transaction"
            )));
        }
        let defaults = WorkerConfig::in_mode(
            self.mode,
            self.amqp.config(),
            self.database.config(DatabaseConfig::DEFAULT_POOL_SIZE),
            topology(&self.route, &self.queues),
            self.group.consumer_group()?,
        );
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
        // The extra connections serve the failure ledger while transactions hold the others.
        let pool_size = self.pool_size.map_or(max_in_flight + 2, |n| n as usize);
        let config = WorkerConfig {
            database: DatabaseConfig {
                pool_size,
                ..defaults.database.clone()
            },
            prefetch,
            batch_size,
            batch_wait: self.batch_wait.0,
            max_in_flight,
            lanes: self.lanes.map_or(defaults.lanes, |n| n as usize),
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
        };
        config
            .check()
            .map_err(|error| SettingError::of_worker(&error))?;
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
        Ok(config)
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
            every_letter: false,
            patience: self.wait.startup_timeout.0,
        })
    }
}

impl RequeueArgs {
    /// Settings of `requeue`: every dead letter, invalid ones too.
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
    /// Settings of `dlq`.
    pub(crate) fn config(&self) -> Result<(DlqConfig, Action, View), SettingError> {
        let (filter, action, view) = match &self.action {
            DlqAction::Sync(target) => {
                return Ok((
                    target.config(Filter::default(), None)?,
                    Action::Sync,
                    View::Listing,
                ));
            }
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
        let config = DlqConfig {
            every_letter: filter.every_letter,
            ..filter.target.config(
                Filter {
                    reason: filter.reason.clone(),
                    event_id: filter.event_id.clone(),
                    error: filter.error.clone(),
                    older_than: filter.older_than.map(|wait| wait.0),
                    newer_than: filter.newer_than.map(|wait| wait.0),
                    invalid: filter.invalid,
                },
                filter.limit,
            )?
        };
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
