//! Whose fault a failure is: the message's, which spends its retry budget,
//! or the infrastructure's, which must never do so. The one place that
//! decides it for PostgreSQL's errors, by SQLSTATE; a handler may refine it
//! ([`Handler::classify`](super::Handler::classify)).

use tokio_postgres::error::SqlState;

/// Whose fault a failure is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Retrying this message is unlikely to help soon (a constraint, a
    /// trigger, a value out of range): it counts against its retry budget.
    Message,
    /// This message can never apply, by a rule of the business (an unknown
    /// SKU, an order that was cancelled): it is dead-lettered after this one
    /// failure (the ledger counts it, with the reason as its last error),
    /// without the retries of its other attempts. idem's own classification
    /// never says it; a handler's may.
    Permanent,
    /// The database is unreachable, restarting, overloaded, misconfigured or
    /// lost a race (serialization, deadlock): not the message's fault, so
    /// the worker holds the delivery and retries with backoff.
    Infrastructure,
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
