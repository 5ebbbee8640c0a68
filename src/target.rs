//! What an operator command works on: the broker, the database, the
//! consumer group and its queues, and how long to wait for the servers.
//! `status`, `dlq`, `prune` and the console take one, and open through it
//! what they need.

use std::time::Duration;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::broker::{AmqpConfig, ConnectError, Topology, connect_with_retry};
use crate::handler::Handler;
use crate::store::{ConfigError, DatabaseConfig, ReadyError, Store};

/// The servers, the consumer group and its queues a command works on.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Target {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The database holding the group's records, ledger and index.
    pub database: DatabaseConfig,
    /// The group's queues: its work queue, wait queues and dead-letter
    /// queue, and its retry policy.
    pub topology: Topology,
    /// Whose records, ledger and dead letters.
    pub consumer_group: String,
    /// How long to wait for the servers to answer.
    pub patience: Duration,
}

impl Target {
    /// `consumer_group` on `topology`'s queues, on these servers, waiting
    /// at most `patience` for them.
    pub fn new(
        amqp: AmqpConfig,
        database: DatabaseConfig,
        topology: Topology,
        consumer_group: impl Into<String>,
        patience: Duration,
    ) -> Self {
        Self {
            amqp,
            database,
            topology,
            consumer_group: consumer_group.into(),
            patience,
        }
    }

    /// The group's store, once the database answers and holds every
    /// migration of idem's and `H`'s (waiting at most the patience);
    /// [`ReadyError::Interrupted`] when `shutdown` fires first.
    pub async fn ready_store<H: Handler>(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Store, OpenError> {
        let store = Store::new(self.database.pool()?, self.consumer_group.clone());
        store
            .wait_until_ready::<H>(&self.database.describe(), self.patience, shutdown)
            .await?;
        Ok(store)
    }

    /// A connection to the broker named `name`, tried again for at most the
    /// patience.
    pub async fn connect(
        &self,
        name: &str,
        shutdown: &CancellationToken,
    ) -> Result<Connection, ConnectError> {
        connect_with_retry(&self.amqp, name, self.patience, shutdown).await
    }
}

/// Why a command could not open its store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The database's settings cannot make a pool.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The database did not answer, refused, or is not migrated.
    #[error(transparent)]
    Ready(#[from] ReadyError),
}
