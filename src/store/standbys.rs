//! Acks after standbys: for a primary whose standbys replicate
//! asynchronously, where a commit returns before any standby has it and a
//! failover to a standby that is behind loses it. With
//! `--ack-after-standbys N`, each transaction whose deliveries are to be
//! acked waits, on the connection that committed, until `N` standbys have
//! flushed the server's WAL up to where it stood after the commit
//! (`mq_standbys_have`). A later position stands for every commit before
//! it, so a transaction that found only duplicates waits too: the records
//! it found, committed by an earlier transaction whose wait may have
//! failed, lie before it.
//!
//! The wait is asked of the server that committed, on the same
//! connection: another connection may reach another server after a
//! failover (the promoted standby, whose own standbys may well have all
//! of its WAL), and its answer would say nothing of the commit. A wait
//! that fails (no standby caught up in time, the connection broke) is the
//! infrastructure's failure: the deliveries are not acked, their
//! transaction runs again, and finds its events applied or not on
//! whichever server is primary then.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::{info, warn};

use super::StoreError;

/// The standbys a commit waits for, and how long one wait may take.
#[derive(Debug)]
pub struct Standbys {
    wanted: i32,
    within: Duration,
    /// A wait ran out: said once, until a wait succeeds again.
    behind: AtomicBool,
}

/// A wait shorter than the sessions' statement timeout, by this much at
/// least, so that the wait answers before the server cancels it.
const MARGIN: Duration = Duration::from_millis(500);

impl Standbys {
    /// Longest one wait takes, by default: past it the transaction runs
    /// again, after the worker's pause for a database that is not there.
    pub const DEFAULT_WITHIN: Duration = Duration::from_secs(5);

    /// Waits for `wanted` standbys (at least one), each wait at most
    /// [`Standbys::DEFAULT_WITHIN`], or less when the sessions'
    /// `statement_timeout` is shorter (zero: none).
    pub fn new(wanted: u32, statement_timeout: Duration) -> Self {
        let within = if statement_timeout.is_zero() {
            Self::DEFAULT_WITHIN
        } else {
            Self::DEFAULT_WITHIN.min(statement_timeout.saturating_sub(MARGIN))
        };
        Self {
            wanted: i32::try_from(wanted.max(1)).unwrap_or(i32::MAX),
            within: within.max(Duration::from_millis(100)),
            behind: AtomicBool::new(false),
        }
    }

    /// How many standbys a commit waits for.
    pub fn wanted(&self) -> u32 {
        self.wanted.unsigned_abs()
    }

    /// Returns once the standbys have the server's WAL up to where it
    /// stands now on `client`'s session, which has just committed. An
    /// error when they did not within the wait, or the server did not
    /// answer: the commit must be taken as not acked.
    pub(crate) async fn have_commits_of(
        &self,
        client: &deadpool_postgres::ClientWrapper,
    ) -> Result<(), StoreError> {
        let statement = client
            .prepare_cached(
                "SELECT mq_standbys_have(pg_current_wal_insert_lsn(), $1, \
                 make_interval(secs => $2::float8))",
            )
            .await?;
        let row = client
            .query_one(&statement, &[&self.wanted, &self.within.as_secs_f64()])
            .await?;
        let have: i32 = row.try_get(0)?;
        if have >= self.wanted {
            if self.behind.swap(false, Ordering::Relaxed) {
                info!(
                    "{} standby(s) have idem's commits again: acks go on",
                    self.wanted
                );
            }
            return Ok(());
        }
        let error = StoreError::StandbysBehind {
            have: have.unsigned_abs(),
            wanted: self.wanted(),
            within: self.within,
        };
        if !self.behind.swap(true, Ordering::Relaxed) {
            warn!("{error}");
        }
        Err(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_before_the_statement_timeout_and_takes_none_as_none() {
        let within = |timeout| Standbys::new(1, timeout).within;
        assert_eq!(within(Duration::ZERO), Standbys::DEFAULT_WITHIN);
        assert_eq!(within(Duration::from_secs(60)), Standbys::DEFAULT_WITHIN);
        assert_eq!(within(Duration::from_secs(2)), Duration::from_millis(1500));
        assert_eq!(
            within(Duration::from_millis(300)),
            Duration::from_millis(100)
        );
        assert_eq!(Standbys::new(0, Duration::ZERO).wanted(), 1);
    }
}
