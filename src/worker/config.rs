//! A worker's configuration: its mode and tuning, the settings it runs
//! with, and what makes them unusable together.

use std::time::Duration;

use super::EpochSettings;
use crate::broker::{AmqpConfig, Exchange, Topology};
use crate::store::DatabaseConfig;
use crate::target::Target;

/// How deliveries are grouped into transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Many deliveries per transaction, several transactions in flight: the
    /// default, with every guarantee of per-message mode.
    Batch,
    /// One transaction per delivery.
    PerMessage,
}

/// The settings a mode starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Deliveries per transaction.
    pub batch_size: usize,
    /// Unacknowledged deliveries the broker may send.
    pub prefetch: u16,
    /// Transactions in flight.
    pub max_in_flight: usize,
    /// Connections the claims share, committing without waiting for their
    /// own flush ([`WorkerConfig::lanes`]); 0: none.
    pub lanes: usize,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 2] = [Mode::Batch, Mode::PerMessage];

    /// The value of `--mode` (and `IDEM_MODE`) that selects this mode.
    pub fn as_flag(self) -> &'static str {
        match self {
            Mode::Batch => "batch",
            Mode::PerMessage => "per-message",
        }
    }

    /// Defaults measured with `idem bench` on a 2-core host
    /// (`docs/guide/performance.md`, *Batches of 500*). Batch mode's
    /// prefetch is twice what its batches in flight (3 × 500) and the one
    /// filling hold: the other half keeps arriving while they commit, so
    /// that the next batches are full the moment a slot frees.
    pub fn tuning(self) -> Tuning {
        match self {
            Mode::Batch => Tuning {
                batch_size: 500,
                prefetch: 4000,
                max_in_flight: 3,
                lanes: 0,
            },
            Mode::PerMessage => Tuning {
                batch_size: 1,
                prefetch: 64,
                max_in_flight: 16,
                lanes: 2,
            },
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Mode::ALL
            .into_iter()
            .find(|mode| mode.as_flag() == text)
            .ok_or_else(|| format!("unknown mode '{text}' (batch or per-message)"))
    }
}

/// Everything the worker needs to know. [`WorkerConfig::new`] gives idem's
/// defaults, which `idem worker`'s flags start from too.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WorkerConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The database.
    pub database: DatabaseConfig,
    /// What to declare and consume from.
    pub topology: Topology,
    /// Whose consume records these are; an event is applied once per group.
    pub consumer_group: String,
    /// Most unacknowledged deliveries the broker sends this worker.
    pub prefetch: u16,
    /// Most deliveries applied in one transaction; 1 is per-message mode.
    pub batch_size: usize,
    /// How long a batch waits for more deliveries after its first.
    pub batch_wait: Duration,
    /// Most batches being applied at once.
    pub max_in_flight: usize,
    /// For a handler with a tally: connections its claims share, sending
    /// each without waiting for the answers to the others (tokio-postgres
    /// pipelines them) and committing each without waiting for its WAL
    /// flush; the deliveries are acked once a flush, shared by every claim
    /// before it, has found their consume records (`store::flush`). 0:
    /// each transaction on a connection of its own, waiting for its own
    /// flush. Per-message mode's default; batch mode, whose commits share
    /// a flush among a batch already, has none.
    pub lanes: usize,
    /// Standbys that must have flushed a transaction's commit before its
    /// deliveries are acked ([`crate::store::Standbys`]): for a primary
    /// whose standbys replicate asynchronously, where a failover to one
    /// that is behind loses what the primary committed last. 0: a commit
    /// is enough (right when replication is synchronous, or there is no
    /// standby).
    pub ack_after_standbys: u32,
    /// Bodies above this many bytes are invalid.
    pub max_body_bytes: usize,
    /// Most bytes of a dead letter's body the dead-letter index keeps, for
    /// the console to show; 0: none (its size and SHA-256 only).
    pub kept_body_bytes: usize,
    /// After a shutdown signal, how long in-flight work may take before the
    /// worker closes anyway (the broker then redelivers what was not acked).
    pub shutdown_timeout: Duration,
    /// How long to wait for PostgreSQL and RabbitMQ at start-up.
    pub startup_timeout: Duration,
    /// Where to serve `/metrics`, `/healthz` and `/readyz`; `None`: nowhere.
    pub http_addr: Option<std::net::SocketAddr>,
    /// More routes that address serves beside those (the console's pages,
    /// with `worker --console`), on paths of their own.
    pub routes: Option<axum::Router>,
    /// How often to log a summary of what was done (and a last one with
    /// the totals at the end); zero: only at the end.
    pub summary_interval: Duration,
    /// Whether to run a relay beside the consumer when the handler sends
    /// messages ([`Handler::SENDS_MESSAGES`](crate::handler::Handler::SENDS_MESSAGES)); off when `idem relay` runs
    /// apart.
    pub relay: bool,
    /// How the consume records' epochs are kept: when the next one opens,
    /// and how much memory the closed ones' filters may take.
    pub epochs: EpochSettings,
    /// The exchanges the handler's messages go to, declared with the
    /// topology (by the worker's relay too).
    pub outgoing: Vec<Exchange>,
    /// On an ordered queue, how much PostgreSQL holds for parked keys.
    pub parked_bounds: ParkedBounds,
}

/// How much an ordered queue's parked keys may hold in PostgreSQL. Past a
/// bound an event is not parked: it waits in the worker, unacked, and is
/// parked once the bound allows (its key's head applied and the key's
/// events drained, or an operator released or discarded a key); the
/// worker logs it and counts it (`idem_parked_bound_waits_total`). A
/// batch that holds such an event waits with it, and the keys it holds
/// with it; the slot's other keys go on while the prefetch lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParkedBounds {
    /// Events one key holds (its head among them while it waits for its
    /// next attempt).
    pub events_per_key: u32,
    /// Keys parked in the consumer group.
    pub keys: u32,
}

impl ParkedBounds {
    /// Events one key holds at most, by default.
    pub const DEFAULT_EVENTS_PER_KEY: u32 = 10_000;
    /// Keys parked at most, by default.
    pub const DEFAULT_KEYS: u32 = 10_000;
}

impl Default for ParkedBounds {
    fn default() -> Self {
        Self {
            events_per_key: Self::DEFAULT_EVENTS_PER_KEY,
            keys: Self::DEFAULT_KEYS,
        }
    }
}

impl WorkerConfig {
    /// How long a batch waits for more deliveries, by default.
    pub const DEFAULT_BATCH_WAIT: Duration = Duration::from_millis(5);
    /// Largest body decoded, by default.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024;
    /// How long in-flight work may take after a shutdown signal, by default.
    pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
    /// How long to wait for the services at start-up, by default.
    pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(180);
    /// How often the worker logs what it did, by default.
    pub const DEFAULT_SUMMARY_INTERVAL: Duration = Duration::from_secs(60);

    /// A worker of `consumer_group` on `topology`, in batch mode, with
    /// idem's defaults for everything else; see [`WorkerConfig::in_mode`].
    pub fn new(
        amqp: AmqpConfig,
        database: DatabaseConfig,
        topology: Topology,
        consumer_group: impl Into<String>,
    ) -> Self {
        Self::in_mode(Mode::Batch, amqp, database, topology, consumer_group)
    }

    /// A worker of `consumer_group` on `topology` in `mode`: that mode's
    /// [`Tuning`], and a pool of two connections more than the transactions
    /// in flight (the extra ones serve the failure ledger while
    /// transactions hold the others), whatever `database` said. Change any
    /// field after; [`WorkerConfig::check`] (which [`Worker::run`](super::Worker::run) calls)
    /// refuses a combination that would not work.
    pub fn in_mode(
        mode: Mode,
        amqp: AmqpConfig,
        database: DatabaseConfig,
        topology: Topology,
        consumer_group: impl Into<String>,
    ) -> Self {
        let tuning = mode.tuning();
        let transactions = in_flight(&topology, tuning.max_in_flight);
        Self {
            amqp,
            database: DatabaseConfig {
                pool_size: transactions + 2,
                ..database
            },
            topology,
            consumer_group: consumer_group.into(),
            prefetch: tuning.prefetch,
            batch_size: tuning.batch_size,
            batch_wait: Self::DEFAULT_BATCH_WAIT,
            max_in_flight: tuning.max_in_flight,
            lanes: tuning.lanes,
            ack_after_standbys: 0,
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            kept_body_bytes: crate::store::dead_letters::KEPT_BODY_BYTES,
            shutdown_timeout: Self::DEFAULT_SHUTDOWN_TIMEOUT,
            startup_timeout: Self::DEFAULT_STARTUP_TIMEOUT,
            http_addr: None,
            routes: None,
            summary_interval: Self::DEFAULT_SUMMARY_INTERVAL,
            relay: true,
            epochs: EpochSettings::default(),
            parked_bounds: ParkedBounds::default(),
            outgoing: Vec::new(),
        }
    }

    /// What the worker works on, for an operator command or the console
    /// beside it: its servers, group and queues, waiting for the servers as
    /// long as the worker does at start-up.
    pub fn target(&self) -> Target {
        Target::new(
            self.amqp.clone(),
            self.database.clone(),
            self.topology.clone(),
            self.consumer_group.clone(),
            self.startup_timeout,
        )
    }

    /// Refuses settings with which the worker could not keep its
    /// guarantees or could not work at all: checked before it connects to
    /// anything, so that a mistake is one error at start-up rather than
    /// deliveries held for ever.
    pub fn check(&self) -> Result<(), ConfigError> {
        check_consumer_group(&self.consumer_group)?;
        if self.topology.exchange.is_empty() || self.topology.routing_key.is_empty() {
            return Err(ConfigError::Unbound {
                queue: self.topology.queue.clone(),
            });
        }
        self.topology.retry.check()?;
        if self.prefetch == 0 {
            return Err(ConfigError::Zero("prefetch"));
        }
        if self.batch_size == 0 {
            return Err(ConfigError::Zero("batch_size"));
        }
        if self.max_in_flight == 0 {
            return Err(ConfigError::Zero("max_in_flight"));
        }
        if self.topology.delivery_limit < self.topology.retry.attempts() {
            return Err(ConfigError::DeliveryLimitBelowAttempts {
                delivery_limit: self.topology.delivery_limit,
                max_attempts: self.topology.retry.attempts(),
            });
        }
        if self.batch_size > usize::from(self.prefetch) {
            return Err(ConfigError::BatchAbovePrefetch {
                batch_size: self.batch_size,
                prefetch: self.prefetch,
            });
        }
        let transactions = in_flight(&self.topology, self.max_in_flight);
        if self.database.pool_size < transactions + 2 {
            return Err(ConfigError::PoolTooSmall {
                pool_size: self.database.pool_size,
                max_in_flight: transactions,
            });
        }
        Ok(())
    }
}

/// The transactions a worker has in flight at most: `max_in_flight` on an
/// unordered queue; on an ordered one, as many but at least one per slot,
/// and one applying its parked keys.
pub(crate) fn in_flight(topology: &Topology, max_in_flight: usize) -> usize {
    if topology.is_ordered() {
        max_in_flight.max(usize::from(topology.slots)) + 1
    } else {
        max_in_flight
    }
}

/// Longest consumer group, in characters: `mq_consume_record.consumer_group`.
pub const MAX_CONSUMER_GROUP_CHARS: usize = 64;

/// Refuses a consumer group that idem's tables cannot hold: empty, blank,
/// or longer than [`MAX_CONSUMER_GROUP_CHARS`].
#[doc(hidden)]
pub fn check_consumer_group(group: &str) -> Result<(), ConfigError> {
    if group.trim().is_empty() || group.chars().count() > MAX_CONSUMER_GROUP_CHARS {
        return Err(ConfigError::ConsumerGroup {
            group: group.to_owned(),
        });
    }
    Ok(())
}

/// A worker's settings that cannot work together, found before it starts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The consumer group is part of every consume record's key.
    #[error("the consumer group must be 1 to {MAX_CONSUMER_GROUP_CHARS} characters, got {group:?}")]
    ConsumerGroup {
        /// The group given.
        group: String,
    },
    /// The work queue is bound to no exchange.
    #[error(
        "the topology of {queue} names no exchange or routing key to bind it to (Topology::bound_to)"
    )]
    Unbound {
        /// The work queue.
        queue: String,
    },
    /// A setting that must be at least 1.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// The retry policy cannot work.
    #[error(transparent)]
    Retry(#[from] crate::retry::RetryError),
    /// The broker's backstop would dead-letter before idem's budget is spent.
    #[error(
        "the delivery limit ({delivery_limit}) must be at least max_attempts ({max_attempts}): \
         it is the backstop above the failure ledger's budget, for messages that crash the worker"
    )]
    DeliveryLimitBelowAttempts {
        /// The work queue's `x-delivery-limit`.
        delivery_limit: u32,
        /// The failure ledger's budget.
        max_attempts: u32,
    },
    /// A batch that could never fill.
    #[error("batch_size ({batch_size}) is above prefetch ({prefetch}): a batch could never fill")]
    BatchAbovePrefetch {
        /// Deliveries per transaction.
        batch_size: usize,
        /// Unacknowledged deliveries the broker sends.
        prefetch: u16,
    },
    /// Transactions in flight would starve the failure ledger of connections.
    #[error(
        "the pool ({pool_size} connections) must hold the transactions in flight ({max_in_flight}: \
         max_in_flight, or an ordered queue's slots and one) + 2: the extra two serve the \
         failure ledger while transactions hold the others"
    )]
    PoolTooSmall {
        /// Connections in the pool.
        pool_size: usize,
        /// Transactions in flight.
        max_in_flight: usize,
    },
}
