//! What a check runs, on what, and how it judges; and why it could not be
//! run to the end.

use std::time::Duration;

use crate::broker::{AmqpConfig, Exchange};
use crate::handler::BoxError;
use crate::store::DatabaseConfig;
use crate::worker::WorkerConfig;

/// What a check runs, on what, and how it judges.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CheckConfig {
    /// The broker: the runs make queues of their own on the URL's vhost.
    pub amqp: AmqpConfig,
    /// The database: the runs make schemas of their own in it (its schema
    /// setting is not used).
    pub database: DatabaseConfig,
    /// The consumer group the events are recorded under.
    pub consumer_group: String,
    /// Message bodies, in order ([`read_events`](super::read_events) reads a file of them).
    pub events: Vec<Vec<u8>>,
    /// SQL run after the migrations in every schema the check makes (seed
    /// rows, say).
    pub setup: Option<String>,
    /// Queries that must return no row, after every run.
    pub invariants: Vec<String>,
    /// A query taking an event id (`$1`) and returning how many times its
    /// effect is present: once for an event idem applied, never for one it
    /// did not.
    pub witness: Option<String>,
    /// `table.column`s left out of the comparisons (a timestamp the team
    /// knows to differ).
    pub ignore_columns: Vec<String>,
    /// Copies of every message in the copies runs, at least 2.
    pub copies: usize,
    /// Deliveries per batch in batch mode, and per cut of batch
    /// equivalence.
    pub batch_size: usize,
    /// Genuine failures after which a message is dead-lettered.
    pub max_attempts: u32,
    /// Seed of the orders drawn.
    pub seed: u64,
    /// How long one run may take.
    pub patience: Duration,
    /// How long to wait for PostgreSQL and RabbitMQ to answer at the start.
    pub startup_timeout: Duration,
    /// The service's outgoing exchanges (its topology's, as the worker
    /// declares them): what reaches them while the check runs is watched,
    /// since a check relays nothing, whatever arrives was sent outside
    /// idem's outbox.
    pub outgoing: Vec<Exchange>,
}

impl CheckConfig {
    /// Copies of every message in the copies runs, unless said otherwise.
    pub const DEFAULT_COPIES: usize = 3;
    /// Deliveries per batch, unless said otherwise: small enough that a
    /// few hundred events make several batches.
    pub const DEFAULT_BATCH_SIZE: usize = 100;
    /// How long one run may take, unless said otherwise.
    pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(300);
    /// Genuine failures after which a message is dead-lettered, unless said
    /// otherwise: the check retries at once, where the worker's retries
    /// wait, so more attempts would find what the first two found, and a
    /// failing message makes each batch it lands in go one by one.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 2;

    /// A check of `events` (message bodies) on these servers, under the
    /// consumer group `consumer_group`, with idem's defaults for the rest.
    pub fn new(
        amqp: AmqpConfig,
        database: DatabaseConfig,
        consumer_group: impl Into<String>,
        events: Vec<Vec<u8>>,
    ) -> Self {
        Self {
            amqp,
            database,
            consumer_group: consumer_group.into(),
            events,
            setup: None,
            invariants: Vec::new(),
            witness: None,
            ignore_columns: Vec::new(),
            copies: Self::DEFAULT_COPIES,
            batch_size: Self::DEFAULT_BATCH_SIZE,
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            seed: 1,
            patience: Self::DEFAULT_PATIENCE,
            startup_timeout: WorkerConfig::DEFAULT_STARTUP_TIMEOUT,
            outgoing: Vec::new(),
        }
    }

    /// The same check, running `sql` after the migrations in every schema.
    pub fn setup(self, sql: impl Into<String>) -> Self {
        Self {
            setup: Some(sql.into()),
            ..self
        }
    }

    /// The same check, with one more query that must return no row.
    pub fn invariant(mut self, sql: impl Into<String>) -> Self {
        self.invariants.push(sql.into());
        self
    }

    /// The same check, counting each event's effect with `sql` (`$1`: the
    /// event id).
    pub fn witness(self, sql: impl Into<String>) -> Self {
        Self {
            witness: Some(sql.into()),
            ..self
        }
    }

    /// The same check, watching the outgoing exchange `exchange` for
    /// messages the handler sends outside idem's outbox.
    pub fn outgoing(mut self, exchange: Exchange) -> Self {
        self.outgoing.push(exchange);
        self
    }

    /// The same check, leaving `table.column` out of the comparisons.
    pub fn ignore_column(mut self, column: impl Into<String>) -> Self {
        self.ignore_columns.push(column.into());
        self
    }

    pub(super) fn validate(&self) -> Result<(), CheckError> {
        crate::worker::check_consumer_group(&self.consumer_group)
            .map_err(|error| CheckError::Usage(error.to_string()))?;
        if self.events.is_empty() {
            return Err(CheckError::Usage("no event to check".into()));
        }
        if self.copies < 2 {
            return Err(CheckError::Usage(
                "copies must be at least 2: one copy is no duplicate".into(),
            ));
        }
        if self.batch_size < 2 || self.batch_size * 8 > usize::from(u16::MAX) {
            return Err(CheckError::Usage(
                "the batch size must be 2 to 8191: a batch of one is per-message mode".into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(CheckError::Usage("max attempts must be at least 1".into()));
        }
        for column in &self.ignore_columns {
            if column.split('.').count() != 2 || column.split('.').any(str::is_empty) {
                return Err(CheckError::Usage(format!(
                    "--ignore-column {column}: give it as TABLE.COLUMN"
                )));
            }
        }
        Ok(())
    }
}

/// Why a check could not be run to the end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// What it was given cannot work: a file, a query, a column, a setting.
    #[error("{0}")]
    Usage(String),
    /// A server failed it.
    #[error("{0}")]
    Failed(#[source] BoxError),
    /// Shutdown was asked for.
    #[error("interrupted")]
    Interrupted,
}

impl CheckError {
    pub(super) fn database(doing: &str, error: &tokio_postgres::Error) -> Self {
        Self::Failed(format!("{doing}: {}", crate::store::describe(error)).into())
    }
}
