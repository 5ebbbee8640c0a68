//! Flags and environment variables, and their translation into the typed
//! settings the library takes. Every flag has an environment fallback.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::broker::{AmqpConfig, PublishOptions, Topology};
use crate::commands::bench::BenchConfig;
use crate::commands::publish::{PublishConfig, Source};
use crate::commands::requeue::RequeueConfig;
use crate::event::PaymentSucceeded;
use crate::generate::LoadSpec;
use crate::secret::SecretUrl;
use crate::store::DatabaseConfig;
use crate::telemetry::LogFormat;
use crate::worker::{Mode, WorkerConfig};

/// Longest consumer group: `mq_consume_record.consumer_group`.
const MAX_CONSUMER_GROUP_CHARS: usize = 64;

/// idem: exactly-once effects from at-least-once RabbitMQ delivery.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub services: ServiceArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub topology: TopologyArgs,
    /// Consumer group: part of the deduplication key, so each group applies
    /// an event once.
    #[arg(
        long,
        env = "IDEM_CONSUMER_GROUP",
        default_value = "points-consumer-group",
        global = true
    )]
    pub consumer_group: String,
    /// Log format.
    #[arg(
        long,
        env = "IDEM_LOG_FORMAT",
        value_enum,
        default_value_t,
        global = true
    )]
    pub log_format: LogFormat,
    #[command(subcommand)]
    #[allow(missing_docs)]
    pub command: Command,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the embedded SQL migrations (idempotent; safe to run concurrently).
    Migrate,
    /// Consume and apply events until SIGINT/SIGTERM, then drain and exit 0.
    Worker(WorkerArgs),
    /// Publish events with publisher confirms; exits 1 if any is nacked or returned.
    Publish(PublishArgs),
    /// Replay dead-lettered messages to the queue they died in.
    Requeue(RequeueArgs),
    /// Run the whole story on local services, on data of its own, and report.
    Demo,
    /// Measure throughput against the broker's ceiling, on data of its own.
    Bench(BenchArgs),
}

/// Where RabbitMQ and PostgreSQL are.
#[derive(Debug, Args)]
pub struct ServiceArgs {
    /// RabbitMQ URL, vhost included (`%2f` is `/`).
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true
    )]
    pub amqp_url: String,
    /// With an `amqps://` URL: CA certificates (PEM) the broker's certificate
    /// may chain to, besides the system's.
    #[arg(long, env = "IDEM_AMQP_CA_FILE", global = true)]
    pub amqp_ca_file: Option<std::path::PathBuf>,
    /// PostgreSQL URL or key/value connection string.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        global = true,
        hide_env_values = true
    )]
    pub database_url: String,
    /// With `sslmode=require` in the database URL: CA certificates (PEM) the
    /// server's certificate must chain to; default: the system's.
    #[arg(long, env = "IDEM_DATABASE_CA_FILE", global = true)]
    pub database_ca_file: Option<std::path::PathBuf>,
    /// Schema for idem's tables (created by `migrate`); default: the server's search_path.
    #[arg(long, env = "IDEM_SCHEMA", global = true)]
    pub schema: Option<String>,
    /// How long to wait for RabbitMQ to answer, at start and after a connection loss.
    #[arg(long, env = "IDEM_STARTUP_TIMEOUT", default_value = "3m", value_parser = parse_duration, global = true)]
    pub startup_timeout: Duration,
}

/// Names of the exchanges and queues.
#[derive(Debug, Args)]
pub struct TopologyArgs {
    /// Exchange producers publish to (topic).
    #[arg(long, env = "IDEM_EXCHANGE", default_value = "payments", global = true)]
    pub exchange: String,
    /// Routing key of payment events.
    #[arg(
        long,
        env = "IDEM_ROUTING_KEY",
        default_value = "payment.succeeded",
        global = true
    )]
    pub routing_key: String,
    /// Work queue (quorum).
    #[arg(
        long,
        env = "IDEM_QUEUE",
        default_value = "points.payment-succeeded",
        global = true
    )]
    pub queue: String,
    /// Dead-letter exchange.
    #[arg(
        long,
        env = "IDEM_DEAD_LETTER_EXCHANGE",
        default_value = "points.dlx",
        global = true
    )]
    pub dead_letter_exchange: String,
    /// Dead-letter queue (classic).
    #[arg(
        long,
        env = "IDEM_DEAD_LETTER_QUEUE",
        default_value = "points.payment-succeeded.dlq",
        global = true
    )]
    pub dead_letter_queue: String,
    /// The work queue's x-delivery-limit: a backstop above --max-attempts for
    /// a message that crashes the worker itself.
    #[arg(long, env = "IDEM_DELIVERY_LIMIT", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000), global = true)]
    pub delivery_limit: u32,
}

/// The environment that points a child `idem` at `topology`, for the bench
/// and the tests: the variables `TopologyArgs` reads.
pub fn topology_environment(topology: &Topology) -> Vec<(&'static str, String)> {
    vec![
        ("IDEM_EXCHANGE", topology.exchange.clone()),
        ("IDEM_ROUTING_KEY", topology.routing_key.clone()),
        ("IDEM_QUEUE", topology.queue.clone()),
        (
            "IDEM_DEAD_LETTER_EXCHANGE",
            topology.dead_letter_exchange.clone(),
        ),
        ("IDEM_DEAD_LETTER_QUEUE", topology.dead_letter_queue.clone()),
        ("IDEM_DELIVERY_LIMIT", topology.delivery_limit.to_string()),
    ]
}

/// `idem worker`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Genuine failures (counted in the failure ledger) after which a message is dead-lettered.
    #[arg(long, env = "IDEM_MAX_ATTEMPTS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_attempts: u32,
    /// `batch`: many deliveries per transaction; `per-message`: one transaction per delivery.
    #[arg(long, env = "IDEM_MODE", value_enum, default_value_t = Mode::Batch)]
    pub mode: Mode,
    /// Most unacknowledged deliveries in this worker [default: 1000 in batch mode, 64 per message].
    #[arg(long, env = "IDEM_PREFETCH", value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: Option<u16>,
    /// Batch mode: most deliveries in one transaction [default: 200].
    #[arg(long, env = "IDEM_BATCH_SIZE", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_size: Option<u32>,
    /// Batch mode: how long a batch waits for more deliveries after its first.
    #[arg(long, env = "IDEM_BATCH_WAIT", default_value = "5ms", value_parser = parse_duration)]
    pub batch_wait: Duration,
    /// Most transactions in flight at once [default: 3 in batch mode, 16 per message].
    #[arg(long, env = "IDEM_MAX_IN_FLIGHT", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_in_flight: Option<u32>,
    /// Most PostgreSQL connections [default: transactions in flight + 2].
    #[arg(long, env = "IDEM_POOL_SIZE", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub pool_size: Option<u32>,
    /// Bodies larger than this many bytes are invalid (dead-lettered unparsed).
    #[arg(long, env = "IDEM_MAX_BODY_BYTES", default_value_t = 64 * 1024)]
    pub max_body_bytes: usize,
    /// After SIGINT/SIGTERM, how long in-flight work may take before the worker closes anyway.
    #[arg(long, env = "IDEM_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
}

/// `idem publish`: exactly one of --event-id, --file, --count.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("source").required(true).args(["event_id", "file", "count"]))]
pub struct PublishArgs {
    /// Publish one event with this id (with --order-id and --points).
    #[arg(long, requires_all = ["order_id", "points"])]
    pub event_id: Option<String>,
    /// Order of the single event.
    #[arg(long)]
    pub order_id: Option<String>,
    /// Points of the single event.
    #[arg(long, allow_negative_numbers = true)]
    pub points: Option<i64>,
    /// Publish each line of this file (`-` for standard input) as one message.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// With --file: send lines that are not valid events as they are.
    #[arg(long, requires = "file")]
    pub allow_invalid: bool,
    /// Publish this many generated events.
    #[arg(long)]
    pub count: Option<usize>,
    /// With --count: share of messages that repeat an earlier event.
    #[arg(long, default_value_t = 0.1, value_parser = parse_ratio)]
    pub duplicate_ratio: f64,
    /// With --count: orders the events are spread over.
    #[arg(long, default_value_t = 100)]
    pub orders: usize,
    /// With --count: seed of the generator (default: the time).
    #[arg(long)]
    pub seed: Option<u64>,
    /// With --count: start of the generated ids (default: `load-<seed>`).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Most publishes awaiting their confirm at once.
    #[arg(long, env = "IDEM_CONFIRM_WINDOW", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_535))]
    pub window: u32,
}

/// `idem requeue`.
#[derive(Debug, Args)]
pub struct RequeueArgs {
    /// Replay at most this many messages.
    #[arg(long)]
    pub limit: Option<usize>,
    /// List what would be replayed (event, reason, count, time); move nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// `idem bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Messages per run, duplicates included.
    #[arg(long, default_value_t = 200_000)]
    pub messages: usize,
    /// Share of duplicates in the load.
    #[arg(long, default_value_t = 0.1, value_parser = parse_ratio)]
    pub duplicate_ratio: f64,
    /// Orders the events are spread over.
    #[arg(long, default_value_t = 1000)]
    pub orders: usize,
    /// Prefetch of every consumer measured.
    #[arg(long, default_value_t = Mode::Batch.tuning().prefetch)]
    pub prefetch: u16,
    /// Batch mode: deliveries per transaction.
    #[arg(long, default_value_t = Mode::Batch.tuning().batch_size)]
    pub batch_size: usize,
    /// Batch mode: wait for a batch to fill.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub batch_wait: Duration,
    /// Batch mode: transactions in flight.
    #[arg(long, default_value_t = Mode::Batch.tuning().max_in_flight)]
    pub batch_in_flight: usize,
    /// Per-message mode: transactions in flight.
    #[arg(long, default_value_t = Mode::PerMessage.tuning().max_in_flight)]
    pub per_message_in_flight: usize,
    /// Rounds; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Also run pgbench with per-message mode's transaction at 16 clients.
    #[arg(long)]
    pub pgbench: bool,
    /// What to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "ceiling,per-message,batch"
    )]
    pub modes: Vec<crate::commands::bench::Mode>,
}

/// A setting that parsed but makes no sense.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SettingError(String);

impl Cli {
    /// The broker.
    pub fn amqp(&self) -> AmqpConfig {
        AmqpConfig {
            url: SecretUrl::new(self.services.amqp_url.clone()),
            ca_file: self.services.amqp_ca_file.clone(),
        }
    }

    /// The database, with a pool of `pool_size`.
    pub fn database(&self, pool_size: usize) -> DatabaseConfig {
        DatabaseConfig {
            url: SecretUrl::new(self.services.database_url.clone()),
            schema: self.services.schema.clone(),
            pool_size,
            connect_timeout: Duration::from_secs(5),
            ca_file: self.services.database_ca_file.clone(),
        }
    }

    /// The topology.
    pub fn topology(&self) -> Topology {
        let names = &self.topology;
        Topology {
            exchange: names.exchange.clone(),
            routing_key: names.routing_key.clone(),
            queue: names.queue.clone(),
            dead_letter_exchange: names.dead_letter_exchange.clone(),
            dead_letter_queue: names.dead_letter_queue.clone(),
            delivery_limit: names.delivery_limit,
        }
    }

    /// The consumer group, checked against its column.
    pub fn consumer_group(&self) -> Result<String, SettingError> {
        let group = self.consumer_group.trim();
        if group.is_empty() || group.chars().count() > MAX_CONSUMER_GROUP_CHARS {
            return Err(SettingError(format!(
                "--consumer-group (IDEM_CONSUMER_GROUP) must be 1 to {MAX_CONSUMER_GROUP_CHARS} characters, got {:?}",
                self.consumer_group
            )));
        }
        Ok(group.to_owned())
    }

    /// Settings of `idem worker`.
    pub fn worker(&self, args: &WorkerArgs) -> Result<WorkerConfig, SettingError> {
        if self.topology.delivery_limit < args.max_attempts {
            return Err(SettingError(format!(
                "--delivery-limit ({}) must be at least --max-attempts ({}): it is the backstop \
                 above the failure ledger's budget, for messages that crash the worker",
                self.topology.delivery_limit, args.max_attempts
            )));
        }
        let tuning = args.mode.tuning();
        let batch_size = match (args.mode, args.batch_size) {
            (Mode::PerMessage, Some(size)) if size != 1 => {
                return Err(SettingError(format!(
                    "--batch-size ({size}) applies to batch mode; per-message mode applies one delivery per transaction"
                )));
            }
            (_, size) => size.map_or(tuning.batch_size, |size| size as usize),
        };
        let max_in_flight = args
            .max_in_flight
            .map_or(tuning.max_in_flight, |n| n as usize);
        // The extra connections serve the failure ledger while transactions hold the others.
        let pool_size = args.pool_size.map_or(max_in_flight + 2, |n| n as usize);
        Ok(WorkerConfig {
            amqp: self.amqp(),
            database: self.database(pool_size),
            topology: self.topology(),
            consumer_group: self.consumer_group()?,
            prefetch: args.prefetch.unwrap_or(tuning.prefetch),
            batch_size,
            batch_wait: args.batch_wait,
            max_in_flight,
            max_attempts: args.max_attempts,
            max_body_bytes: args.max_body_bytes,
            shutdown_timeout: args.shutdown_timeout,
            startup_timeout: self.services.startup_timeout,
        })
    }

    /// Settings and source of `idem publish`.
    pub fn publish(&self, args: &PublishArgs) -> Result<(PublishConfig, Source), SettingError> {
        let config = PublishConfig {
            amqp: self.amqp(),
            exchange: self.topology.exchange.clone(),
            routing_key: self.topology.routing_key.clone(),
            options: PublishOptions {
                window: args.window as usize,
                patience: self.services.startup_timeout,
            },
        };
        let source = if let (Some(event_id), Some(order_id), Some(points)) =
            (&args.event_id, &args.order_id, args.points)
        {
            let event = PaymentSucceeded {
                event_id: event_id.clone(),
                order_id: order_id.clone(),
                points,
            };
            // The same rules as the worker's, so a flag typo fails here.
            PaymentSucceeded::parse(&event.to_body(), usize::MAX)
                .map_err(|invalid| SettingError(format!("the event is invalid: {invalid}")))?;
            Source::One(event)
        } else if let Some(path) = &args.file {
            Source::Lines {
                path: path.clone(),
                allow_invalid: args.allow_invalid,
            }
        } else {
            let seed = args.seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
            });
            Source::Generated(LoadSpec {
                count: args.count.unwrap_or(0),
                duplicate_ratio: args.duplicate_ratio,
                orders: args.orders,
                seed,
                prefix: args
                    .prefix
                    .clone()
                    .unwrap_or_else(|| format!("load-{seed}")),
            })
        };
        Ok((config, source))
    }

    /// Settings of `idem bench`.
    pub fn bench(&self, args: &BenchArgs) -> Result<BenchConfig, SettingError> {
        let worker_binary = std::env::current_exe().map_err(|e| {
            SettingError(format!("cannot find the idem binary to run workers: {e}"))
        })?;
        Ok(BenchConfig {
            amqp: self.amqp(),
            database: self.database(2),
            messages: args.messages,
            duplicate_ratio: args.duplicate_ratio,
            orders: args.orders,
            prefetch: args.prefetch,
            batch_size: args.batch_size,
            batch_wait: args.batch_wait,
            batch_in_flight: args.batch_in_flight,
            per_message_in_flight: args.per_message_in_flight,
            rounds: args.rounds.max(1),
            pgbench: args.pgbench,
            modes: args.modes.clone(),
            worker_binary,
        })
    }

    /// Settings of `idem requeue`.
    pub fn requeue(&self, args: &RequeueArgs) -> Result<RequeueConfig, SettingError> {
        Ok(RequeueConfig {
            amqp: self.amqp(),
            database: self.database(2),
            consumer_group: self.consumer_group()?,
            dead_letter_queue: self.topology.dead_letter_queue.clone(),
            limit: args.limit,
            dry_run: args.dry_run,
            patience: self.services.startup_timeout,
        })
    }
}

/// `250ms`, `30s`, `5m`, `1h`, or a plain number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a duration (e.g. 250ms, 30s, 5m)"))?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        other => {
            return Err(format!(
                "unknown unit '{other}' in '{text}' (use ms, s, m or h)"
            ));
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("'{text}': {e}"))
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

    #[test]
    fn verify_cli() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 weeks").is_err());
    }

    #[test]
    fn defaults_reach_the_local_services_and_the_design_topology() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from(["idem", "worker"])?;
        assert_eq!(
            cli.amqp().url.expose(),
            "amqp://guest:guest@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            cli.database(1).url.expose(),
            "postgres://postgres@127.0.0.1:5432/postgres"
        );
        assert_eq!(cli.consumer_group, "points-consumer-group");
        let Command::Worker(args) = &cli.command else {
            panic!("parsed as another command");
        };
        let config = cli
            .worker(args)
            .map_err(|e| clap::Error::raw(clap::error::ErrorKind::InvalidValue, e))?;
        assert_eq!(config.topology, Topology::default());
        Ok(())
    }

    #[test]
    fn publish_needs_exactly_one_source() {
        assert!(Cli::try_parse_from(["idem", "publish"]).is_err());
        assert!(Cli::try_parse_from(["idem", "publish", "--count", "3", "--file", "x"]).is_err());
        assert!(Cli::try_parse_from(["idem", "publish", "--event-id", "e"]).is_err());
        assert!(Cli::try_parse_from(["idem", "publish", "--count", "3"]).is_ok());
    }

    #[test]
    fn a_consumer_group_longer_than_its_column_is_refused() -> Result<(), clap::Error> {
        let long = "g".repeat(65);
        let cli = Cli::try_parse_from(["idem", "--consumer-group", &long, "migrate"])?;
        assert!(cli.consumer_group().is_err());
        Ok(())
    }
}
