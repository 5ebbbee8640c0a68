//! What went wrong talking to PostgreSQL, and whose fault that is by
//! idem's classification ([`crate::handler::classify`]).

use deadpool_postgres::PoolError;
use tokio_postgres::error::SqlState;

use crate::handler::{FailureKind, classify};

/// Something went wrong talking to PostgreSQL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No connection could be had from the pool (timeout, refused, closed).
    /// Not a `source`: the message already describes the pool's error, and
    /// printing its chain again repeated it.
    #[error("no database connection: {}", describe_pool(.0))]
    Pool(PoolError),
    /// A statement or the connection failed.
    #[error("{}", describe(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// The server takes no writes: a standby, or a server whose sessions
    /// are read-only. idem writes at every delivery, so it waits for the
    /// primary.
    #[error("{}", read_only(*.standby))]
    ReadOnly {
        /// The server is in recovery: a standby.
        standby: bool,
    },
    /// Fewer standbys than the worker waits for (`--ack-after-standbys`)
    /// flushed a commit within the wait: its deliveries are not acked, and
    /// its transaction runs again.
    #[error(
        "{have} of the {wanted} standby(s) that acks wait for (--ack-after-standbys) \
         flushed idem's commit within {within:?}: the deliveries wait, unacked, and \
         their transaction runs again"
    )]
    StandbysBehind {
        /// Standbys that had it.
        have: u32,
        /// Standbys the worker waits for.
        wanted: u32,
        /// How long it waited.
        within: std::time::Duration,
    },
}

impl From<PoolError> for StoreError {
    fn from(error: PoolError) -> Self {
        StoreError::Pool(error)
    }
}

impl StoreError {
    /// Classifies this failure by SQLSTATE and error kind. An error while
    /// connecting is never the message's fault, whatever its SQLSTATE
    /// (PostgreSQL refusing new connections to a database says 55000).
    pub fn kind(&self) -> FailureKind {
        match self {
            StoreError::Pool(_)
            | StoreError::ReadOnly { .. }
            | StoreError::StandbysBehind { .. } => FailureKind::Infrastructure,
            StoreError::Postgres(error) => classify(error),
        }
    }

    /// The TLS handshake with the server failed for a reason a retry cannot
    /// fix: the certificate does not verify, or the server does not do TLS.
    pub fn tls_refused(&self) -> Option<String> {
        let error = match self {
            StoreError::Pool(PoolError::Backend(error)) | StoreError::Postgres(error) => error,
            StoreError::Pool(_)
            | StoreError::ReadOnly { .. }
            | StoreError::StandbysBehind { .. } => {
                return None;
            }
        };
        // tokio-postgres says so in a plain message, as the cause of its error.
        let declined = std::error::Error::source(error)
            .map(|cause| cause.to_string())
            .filter(|cause| cause == "server does not support TLS");
        declined.or_else(|| crate::tls::refusal(error))
    }

    /// What went wrong, without saying again that there is no connection:
    /// for a message that already says so.
    pub fn cause(&self) -> String {
        match self {
            StoreError::Pool(error) => describe_pool(error),
            StoreError::Postgres(error) => describe(error),
            StoreError::ReadOnly { standby } => read_only(*standby),
            StoreError::StandbysBehind { .. } => self.to_string(),
        }
    }

    /// The SQLSTATE, when the server sent one.
    pub fn code(&self) -> Option<&SqlState> {
        match self {
            StoreError::Pool(PoolError::Backend(error)) | StoreError::Postgres(error) => {
                error.code()
            }
            StoreError::Pool(_) | StoreError::StandbysBehind { .. } => None,
            StoreError::ReadOnly { .. } => Some(&SqlState::READ_ONLY_SQL_TRANSACTION),
        }
    }
}

/// What to do about a server that takes no writes.
const WANT_THE_PRIMARY: &str = "idem writes, so it needs the primary: give it every host of the \
    primary and its standbys with target_session_attrs=read-write, or the service's writer \
    endpoint";

fn read_only(standby: bool) -> String {
    let what = if standby {
        "a standby (in recovery)"
    } else {
        "read-only (default_transaction_read_only)"
    };
    format!("the server is {what} and takes no writes; {WANT_THE_PRIMARY}")
}

fn describe_pool(error: &PoolError) -> String {
    match error {
        PoolError::Backend(error) => describe(error),
        PoolError::Timeout(_) => "timed out waiting for a connection".into(),
        other => other.to_string(),
    }
}

/// The first line of a PostgreSQL error, with its SQLSTATE when there is one.
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        // A primary that became a standby since the session began.
        Some(db) if *db.code() == SqlState::READ_ONLY_SQL_TRANSACTION => format!(
            "{} (SQLSTATE {}): the server takes no writes; {WANT_THE_PRIMARY}",
            db.message(),
            db.code().code()
        ),
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => match std::error::Error::source(error) {
            // target_session_attrs=read-write found no host taking writes.
            Some(source) if source.to_string() == "database does not allow writes" => format!(
                "{error}: no host given takes writes (each is a standby or read-only): a \
                 failover under way, or the primary missing from the hosts"
            ),
            Some(source) => format!("{error}: {source}"),
            None => error.to_string(),
        },
    }
}
