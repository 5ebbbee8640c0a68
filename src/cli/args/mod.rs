//! The groups of flags idem's commands take, each with its environment
//! fallback ([`crate::vars`]), and their translation into the typed
//! settings the library takes. Every default is the library's; the names
//! of the topology and the consumer group are the service's, set when the
//! command line is built ([`super::Service`]).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use clap::builder::{PossibleValuesParser, TypedValueParser};

use crate::broker::{AmqpConfig, Topology};
use crate::duration;
use crate::retry::{RetryError, RetryPolicy};
use crate::secret::SecretUrl;
use crate::store::DatabaseConfig;
use crate::vars;
use crate::worker::{ConfigError, WorkerConfig, check_consumer_group};

mod console;
mod operator;
mod publish;
mod worker;

pub(crate) use console::*;
pub(crate) use operator::*;
pub(crate) use publish::*;
pub(crate) use worker::*;

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
        default_value_t = Delays(RetryPolicy::DEFAULT_DELAYS.to_vec())
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
    /// Slot queues of an ordered queue (0: unordered): a key's events apply
    /// in order, each key in one slot by RabbitMQ's consistent-hash exchange
    /// on the idem-ordering-key header. Change it only as the guide says.
    #[arg(
        long,
        env = vars::SLOTS,
        default_value_t = 0,
        value_parser = clap::value_parser!(u16).range(0..=1024)
    )]
    pub(crate) slots: u16,
}

impl QueueArgs {
    /// The group's queues as `status` and `console` look at them: the work
    /// queue, its wait queues and its dead-letter queue (no exchange of the
    /// group is looked at).
    pub(crate) fn looked_at(&self) -> Topology {
        Topology {
            retry: RetryPolicy::default().with_delays(self.retry_delays.0.clone()),
            dead_letter_exchange: self.dead_letter_exchange.clone(),
            dead_letter_queue: self.dead_letters.dead_letter_queue.clone(),
            ..Topology::for_queue(&self.queue).ordered(self.slots)
        }
    }
}

/// The group's attempts, which the worker spends and `prune` waits out.
#[derive(Debug, Args)]
pub(crate) struct AttemptsArgs {
    /// Genuine failures (counted in the failure ledger) after which a message is dead-lettered.
    #[arg(
        long,
        env = vars::MAX_ATTEMPTS,
        default_value_t = RetryPolicy::DEFAULT_ATTEMPTS,
        value_parser = clap::value_parser!(u32).range(1..=1000)
    )]
    pub(crate) max_attempts: u32,
}

impl AttemptsArgs {
    /// `policy` with these attempts.
    pub(crate) fn applied(&self, policy: RetryPolicy) -> RetryPolicy {
        policy.with_attempts(self.max_attempts)
    }
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
        duration::parse_list(text, RetryPolicy::MAX_DELAY).map(Delays)
    }
}

impl fmt::Display for Delays {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&duration::format_list(&self.0))
    }
}

/// An address to listen on, `HOST:PORT`; a port alone is told so.
pub(super) fn socket_addr(text: &str) -> Result<std::net::SocketAddr, String> {
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
                "--pool-size ({pool_size}) must be at least the transactions in flight \
                 ({max_in_flight}: --max-in-flight, or --slots + 1 on an ordered queue) + 2: \
                 the extra two serve the failure ledger while transactions hold the others"
            ),
            ConfigError::Zero(field) => format!("--{} must be at least 1", field.replace('_', "-")),
            ConfigError::Retry(RetryError::NoAttempt) => "--max-attempts must be at least 1".into(),
            ConfigError::Retry(error) => format!("--retry-delays: {error}"),
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
        retry: RetryPolicy::default().with_delays(queues.retry_delays.0.clone()),
        quorum_size: queues.quorum_size,
        dead_letter_exchange: queues.dead_letter_exchange.clone(),
        dead_letter_queue: queues.dead_letters.dead_letter_queue.clone(),
        ..Topology::for_queue(&queues.queue)
            .bound_to(&route.exchange, &route.routing_key)
            .ordered(queues.slots)
    }
}
