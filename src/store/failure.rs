//! Which failures are the message's fault and which are the database's.
//!
//! The one place that decides it: a message failure spends the message's retry
//! budget, an infrastructure failure must never do so.

use deadpool_postgres::PoolError;
use tokio_postgres::error::SqlState;

/// Something went wrong talking to PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No connection could be had from the pool (timeout, refused, closed).
    /// Not a `source`: the message already describes the pool's error, and
    /// printing its chain again repeated it.
    #[error("no database connection: {}", describe_pool(.0))]
    Pool(PoolError),
    /// A statement or the connection failed.
    #[error("{}", describe(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

impl From<PoolError> for StoreError {
    fn from(error: PoolError) -> Self {
        StoreError::Pool(error)
    }
}

/// Whose fault a failure is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Retrying this message is unlikely to help soon (a constraint, a
    /// trigger, a value out of range): it counts against its retry budget.
    Message,
    /// The database is unreachable, restarting, overloaded, misconfigured or
    /// lost a race (serialization, deadlock): not the message's fault, so
    /// the worker holds the delivery and retries with backoff.
    Infrastructure,
}

impl StoreError {
    /// Classifies this failure by SQLSTATE and error kind. An error while
    /// connecting is never the message's fault, whatever its SQLSTATE
    /// (PostgreSQL refusing new connections to a database says 55000).
    pub fn kind(&self) -> FailureKind {
        match self {
            StoreError::Pool(_) => FailureKind::Infrastructure,
            StoreError::Postgres(error) => classify(error),
        }
    }

    /// The TLS handshake with the server failed for a reason a retry cannot
    /// fix: the certificate does not verify, or the server does not do TLS.
    pub fn tls_refused(&self) -> Option<String> {
        let error = match self {
            StoreError::Pool(PoolError::Backend(error)) | StoreError::Postgres(error) => error,
            StoreError::Pool(_) => return None,
        };
        // tokio-postgres says so in a plain message, as the cause of its error.
        let declined = std::error::Error::source(error)
            .map(|cause| cause.to_string())
            .filter(|cause| cause == "server does not support TLS");
        declined.or_else(|| crate::tls::refusal(error))
    }

    /// The SQLSTATE, when the server sent one.
    pub fn code(&self) -> Option<&SqlState> {
        match self {
            StoreError::Pool(PoolError::Backend(error)) | StoreError::Postgres(error) => {
                error.code()
            }
            StoreError::Pool(_) => None,
        }
    }
}

/// Classifies a PostgreSQL error by its SQLSTATE; one without (the socket
/// broke, the connection closed) is the infrastructure's.
pub fn classify(error: &tokio_postgres::Error) -> FailureKind {
    match error.code() {
        Some(code) => classify_sqlstate(code),
        // No SQLSTATE: the socket broke, the connection closed, a timeout.
        None => FailureKind::Infrastructure,
    }
}

/// Classifies a SQLSTATE; see the PostgreSQL manual's appendix A.
pub fn classify_sqlstate(code: &SqlState) -> FailureKind {
    let code = code.code();
    let class = &code[..2.min(code.len())];
    let infrastructure = match class {
        // connection exception; insufficient resources (disk full, too many
        // connections); operator intervention (admin shutdown, crash
        // shutdown, cannot connect now, query canceled); system error.
        "08" | "53" | "57" | "58" => true,
        // serialization failure, deadlock, statement completion unknown.
        "40" => code != "40002",
        // undefined table, missing privilege, syntax: the schema or the
        // grants are wrong, which an operator fixes, not a retry budget.
        "42" => true,
        // invalid authorization, database or schema does not exist.
        "28" | "3D" | "3F" => true,
        // lock not available, object in use.
        "55" => code == "55P03" || code == "55006",
        // read-only transaction: we are talking to a standby after failover.
        "25" => code == "25006",
        _ => false,
    };
    if infrastructure {
        FailureKind::Infrastructure
    } else {
        FailureKind::Message
    }
}

fn describe_pool(error: &PoolError) -> String {
    match error {
        PoolError::Backend(error) => describe(error),
        PoolError::Timeout(_) => "timed out waiting for a connection".into(),
        other => other.to_string(),
    }
}

/// The first line of a PostgreSQL error, with its SQLSTATE when there is one.
pub(crate) fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => match std::error::Error::source(error) {
            Some(source) => format!("{error}: {source}"),
            None => error.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use FailureKind::{Infrastructure, Message};

    fn kind(code: &str) -> FailureKind {
        classify_sqlstate(&SqlState::from_code(code))
    }

    #[test]
    fn a_raised_exception_or_broken_constraint_is_the_message_failing() {
        assert_eq!(kind("P0001"), Message, "RAISE EXCEPTION in a trigger");
        assert_eq!(kind("23505"), Message, "unique violation");
        assert_eq!(kind("23514"), Message, "check violation");
        assert_eq!(kind("22003"), Message, "numeric value out of range");
        assert_eq!(kind("22021"), Message, "bad byte sequence for encoding");
        assert_eq!(kind("40002"), Message, "integrity violation at commit");
        assert_eq!(kind("XX000"), Message, "internal error");
    }

    #[test]
    fn an_unreachable_or_restarting_database_is_infrastructure() {
        assert_eq!(kind("08006"), Infrastructure, "connection failure");
        assert_eq!(kind("08001"), Infrastructure, "cannot establish connection");
        assert_eq!(
            kind("57P01"),
            Infrastructure,
            "admin shutdown (pg_terminate_backend)"
        );
        assert_eq!(kind("57P02"), Infrastructure, "crash shutdown");
        assert_eq!(
            kind("57P03"),
            Infrastructure,
            "cannot connect now (starting up)"
        );
        assert_eq!(kind("57014"), Infrastructure, "query canceled");
        assert_eq!(kind("58030"), Infrastructure, "io error");
    }

    #[test]
    fn an_overloaded_database_is_infrastructure() {
        assert_eq!(kind("53300"), Infrastructure, "too many connections");
        assert_eq!(kind("53100"), Infrastructure, "disk full");
        assert_eq!(kind("55P03"), Infrastructure, "lock not available");
    }

    #[test]
    fn lost_races_are_infrastructure() {
        assert_eq!(kind("40001"), Infrastructure, "serialization failure");
        assert_eq!(kind("40P01"), Infrastructure, "deadlock detected");
    }

    #[test]
    fn a_misconfigured_database_is_infrastructure() {
        assert_eq!(
            kind("42P01"),
            Infrastructure,
            "undefined table: not migrated"
        );
        assert_eq!(kind("42501"), Infrastructure, "insufficient privilege");
        assert_eq!(kind("28P01"), Infrastructure, "wrong password");
        assert_eq!(kind("3D000"), Infrastructure, "database does not exist");
        assert_eq!(kind("25006"), Infrastructure, "read-only: a standby");
    }
}
