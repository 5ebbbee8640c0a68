//! The flags of the commands that run idem: `migrate`, `worker`, `relay`
//! and `check`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use clap::builder::TypedValueParser;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{
    AmqpArgs, AttemptsArgs, DatabaseArgs, GroupArgs, QueueArgs, RetentionArgs, RouteArgs,
    ServerArgs, SettingError, Wait, WaitArgs, choice, socket_addr, topology,
};
use crate::broker::Topology;
use crate::check::CheckConfig;
use crate::commands::prune::PruneSettings;
use crate::companions::Companions;
use crate::console::{Console, ConsoleConfig};
use crate::handler::Handler;
use crate::relay::RelayConfig;
use crate::store::DatabaseConfig;
use crate::target::Target;
use crate::vars;
use crate::worker::{EpochSettings, Mode, ParkedBounds, WorkerConfig};

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
    #[command(flatten)]
    pub(crate) attempts: AttemptsArgs,
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
    /// Ack a delivery only once this many standbys have flushed its commit, for a primary whose standbys replicate asynchronously (a failover to one that is behind would lose acked effects); 0: once it commits. Needs the role in pg_read_all_stats.
    #[arg(long, env = vars::ACK_AFTER_STANDBYS, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16))]
    pub(crate) ack_after_standbys: u32,
    /// Bodies larger than this many bytes are invalid (dead-lettered unparsed).
    #[arg(long, env = vars::MAX_BODY_BYTES, default_value_t = WorkerConfig::DEFAULT_MAX_BODY_BYTES)]
    pub(crate) max_body_bytes: usize,
    /// On an ordered queue, most events one parked key holds in PostgreSQL; past it the key's next events wait in the worker, unacked.
    #[arg(long, env = vars::MAX_PARKED_PER_KEY, default_value_t = ParkedBounds::DEFAULT_EVENTS_PER_KEY, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_parked_per_key: u32,
    /// On an ordered queue, most keys parked; past it a failed head waits in the worker, unacked, with its batch.
    #[arg(long, env = vars::MAX_PARKED_KEYS, default_value_t = ParkedBounds::DEFAULT_KEYS, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_parked_keys: u32,
    /// Most bytes of a dead letter's body the dead-letter index keeps, for
    /// the console to show (0: only its size and SHA-256).
    #[arg(long, env = vars::KEPT_BODY_BYTES, default_value_t = crate::store::dead_letters::KEPT_BODY_BYTES)]
    pub(crate) kept_body_bytes: usize,
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
    /// Serve the console (dead letters, replays, the audit) on --http-addr
    /// too, beside /metrics.
    #[arg(long, requires = "http_addr")]
    pub(crate) console: bool,
    #[command(flatten)]
    pub(crate) console_access: super::ConsoleAccessArgs,
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

impl CheckArgs {
    /// The command that runs this check again, the same runs in the same
    /// orders, as `program` (the servers as this one was given them: their
    /// URLs can hold passwords, and are left to the environment).
    pub(crate) fn again(&self, program: &str) -> String {
        let mut words = vec![
            program.to_owned(),
            "check".to_owned(),
            "--events".to_owned(),
            quoted(&self.events.display().to_string()),
        ];
        let mut flag = |name: &str, value: String| {
            words.push(format!("--{name}"));
            words.push(quoted(&value));
        };
        flag("consumer-group", self.group.consumer_group.clone());
        flag("seed", self.seed.to_string());
        if let Some(setup) = &self.setup {
            flag("setup", setup.display().to_string());
        }
        for invariant in &self.invariants {
            flag("invariant", invariant.clone());
        }
        if let Some(witness) = &self.witness {
            flag("witness", witness.clone());
        }
        for column in &self.ignore_columns {
            flag("ignore-column", column.clone());
        }
        if self.copies != CheckConfig::DEFAULT_COPIES {
            flag("copies", self.copies.to_string());
        }
        if self.batch_size != CheckConfig::DEFAULT_BATCH_SIZE {
            flag("batch-size", self.batch_size.to_string());
        }
        if self.max_attempts != CheckConfig::DEFAULT_MAX_ATTEMPTS {
            flag("max-attempts", self.max_attempts.to_string());
        }
        if self.patience.0 != CheckConfig::DEFAULT_PATIENCE {
            flag("patience", self.patience.to_string());
        }
        words.join(" ")
    }
}

/// `text` as one word of a POSIX shell: as it is when it needs no quoting,
/// otherwise in single quotes.
fn quoted(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
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

impl<F: Args> WorkerArgs<F> {
    /// The worker's topology, its retry policy with `--max-attempts`.
    fn topology(&self) -> Topology {
        let topology = topology(&self.route, &self.queues);
        Topology {
            retry: self.attempts.applied(topology.retry.clone()),
            ..topology
        }
    }

    /// What runs beside the worker, as the flags say: the console on
    /// `--http-addr` with `--console`, the pruner with `--retention`.
    pub(crate) async fn companions<H: Handler>(
        &self,
        config: &WorkerConfig,
        handler: &Arc<H>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Companions<H>> {
        let mut companions = Companions::new();
        if let (true, Some(addr)) = (self.console, config.http_addr) {
            let mut target = config.target();
            target.database.pool_size = 4;
            let console = ConsoleConfig::new(target);
            let console = self.console_access.applied(console, addr)?;
            let console = Console::new(console, Arc::clone(handler), shutdown.clone()).await?;
            companions = companions.console(console);
        }
        if let Some((settings, interval)) = self.pruner()? {
            companions = companions.pruning(settings, interval);
        }
        Ok(companions)
    }

    /// With --retention, the settings of the worker's pruner, checked
    /// against the safety rule.
    fn pruner(&self) -> Result<Option<(PruneSettings, Duration)>, SettingError> {
        let Some(window) = &self.retention else {
            return Ok(None);
        };
        let target = Target::new(
            self.amqp.config(),
            self.database.config(2),
            self.topology(),
            self.group.consumer_group()?,
            self.wait.startup_timeout.0,
        );
        let settings = self.retention_rules.settings(target, window.0);
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
            self.topology(),
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
        let in_flight = crate::worker::transactions_in_flight(&defaults.topology, max_in_flight);
        let pool_size = self.pool_size.map_or(in_flight + 2, |n| n as usize);
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
            ack_after_standbys: self.ack_after_standbys,
            max_body_bytes: self.max_body_bytes,
            kept_body_bytes: self.kept_body_bytes,
            shutdown_timeout: self.shutdown_timeout.0,
            startup_timeout: self.wait.startup_timeout.0,
            http_addr: self.http_addr,
            summary_interval: self.summary_interval.0,
            relay: !self.no_relay,
            parked_bounds: ParkedBounds {
                events_per_key: self.max_parked_per_key,
                keys: self.max_parked_keys,
            },
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
