//! Whether the database answers: while a transaction is held because it
//! does not, the worker holds what it has and takes no new work.
//!
//! The gate is down exactly while some transaction holds it: a hold ends
//! when its transaction gets through, or when its task is dropped (the
//! broker connection was lost and the batch went back to the broker), so a
//! gate can never stay down with nobody left to lift it.

use std::fmt::Display;

use tokio::sync::watch;
use tracing::{info, warn};

/// Shared by the intake (which waits on it) and the transactions (which
/// hold it).
#[derive(Debug, Clone)]
pub(crate) struct DatabaseHealth {
    /// How many transactions are waiting for the database.
    holders: watch::Sender<usize>,
}

/// One transaction waiting for the database; the gate is down while any is.
#[derive(Debug)]
pub(crate) struct Hold<'a> {
    health: &'a DatabaseHealth,
    released: bool,
}

impl DatabaseHealth {
    pub(crate) fn new() -> Self {
        Self {
            holders: watch::Sender::new(0),
        }
    }

    /// A transaction cannot go through because of `error`; logs when it is
    /// the first one.
    pub(crate) fn hold(&self, error: &impl Display) -> Hold<'_> {
        let mut first = false;
        self.holders.send_modify(|holders| {
            first = *holders == 0;
            *holders += 1;
        });
        if first {
            warn!(
                %error,
                "database unavailable: holding in-flight deliveries, taking no new ones, retrying with backoff"
            );
        }
        Hold {
            health: self,
            released: false,
        }
    }

    /// True when no transaction waits for the database.
    pub(crate) fn is_up(&self) -> bool {
        *self.holders.borrow() == 0
    }

    /// Returns once no transaction waits for the database.
    pub(crate) async fn wait_up(&self) {
        let mut holders = self.holders.subscribe();
        // The sender lives in `self`, so the channel cannot close.
        let _ = holders.wait_for(|holders| *holders == 0).await;
    }

    /// Ends one hold; true when it was the last.
    fn end_hold(&self) -> bool {
        let mut last = false;
        self.holders.send_modify(|holders| {
            *holders = holders.saturating_sub(1);
            last = *holders == 0;
        });
        last
    }
}

impl Hold<'_> {
    /// The transaction got through: the database answers again.
    pub(crate) fn release(mut self) {
        self.released = true;
        if self.health.end_hold() {
            info!("database answers again: resuming");
        }
    }
}

impl Drop for Hold<'_> {
    /// A hold dropped unreleased belongs to a task that was stopped: the
    /// next transaction finds out whether the database answers.
    fn drop(&mut self) {
        if !self.released {
            self.health.end_hold();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_is_down_while_any_transaction_holds_it() {
        let health = DatabaseHealth::new();
        let first = health.hold(&"connection refused");
        let second = health.hold(&"connection refused");
        assert!(!health.is_up());
        first.release();
        assert!(!health.is_up(), "the second still waits");
        second.release();
        assert!(health.is_up());
    }

    #[test]
    fn a_hold_dropped_with_its_task_lifts_the_gate() {
        let health = DatabaseHealth::new();
        let hold = health.hold(&"connection refused");
        drop(hold);
        assert!(health.is_up());
    }
}
