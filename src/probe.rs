//! Points in a worker's transactions where a check ([`crate::check`]) may
//! stop it, cut its connections, or fail a transaction on purpose.
//!
//! A worker reaches these points only when a check armed it, through
//! [`Worker::probed`](crate::worker::Worker::probed), in the check's own
//! process: nothing in the environment arms them, so that no production
//! worker can be made to crash by a stray variable.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::handler::FailureKind;

/// Where in a transaction a worker asks its probe what to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Point {
    /// The transaction's statements ran, the handler's among them, and its
    /// commit is next. For a handler whose effect is a tally (claimed and
    /// applied in one statement, which commits on its own), just before
    /// that statement: the last moment at which nothing is committed.
    BeforeCommit,
    /// The transaction committed (and, on a lane, a flush found its
    /// records); its deliveries are not settled with the broker yet.
    AfterCommit,
    /// A batch's transaction failed, for a reason of its messages: they are
    /// about to be applied one by one.
    BatchFailed,
    /// The dead-letter index (and what the handler sends when it gives up
    /// on a message) recorded the batch's dead letters; they are not yet
    /// in the dead-letter queue. `events`: the letters' keys.
    DeadLettered,
}

/// What the worker does once its probe answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Carry on.
    Go,
    /// Before the commit only: fail the transaction (it rolls back) as if
    /// it had failed for `reason`, a failure of `kind`.
    Fail {
        /// Whose fault the worker takes it for.
        kind: FailureKind,
        /// What the failure ledger keeps.
        reason: String,
    },
}

/// Decides, at each [`Point`], what happens to the transaction of `events`
/// (its distinct event ids). An answer may take as long as it likes (a
/// probe that never answers holds the transaction where it is).
pub trait Probe: Send + Sync + fmt::Debug {
    /// The worker reached `point` in the transaction of `events`.
    fn reached<'a>(
        &'a self,
        point: Point,
        events: &'a [&'a str],
    ) -> Pin<Box<dyn Future<Output = Verdict> + Send + 'a>>;
}

/// A worker's probe, when a check armed one.
pub(crate) type Armed = Option<Arc<dyn Probe>>;

/// What `probe` says at `point` for `events`; carry on when none is armed.
pub(crate) async fn reach(probe: &Armed, point: Point, events: &[&str]) -> Verdict {
    match probe {
        Some(probe) => probe.reached(point, events).await,
        None => Verdict::Go,
    }
}
