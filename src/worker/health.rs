//! Whether the database answers: while it does not, the worker holds what it
//! has and takes no new work.

use tokio::sync::watch;
use tracing::{info, warn};

use crate::store::StoreError;

/// Shared by the intake (which waits on it) and the transactions (which
/// report to it).
#[derive(Debug, Clone)]
pub(crate) struct DatabaseHealth {
    up: watch::Sender<bool>,
}

impl DatabaseHealth {
    pub(crate) fn new() -> Self {
        Self {
            up: watch::Sender::new(true),
        }
    }

    /// Records that the database did not answer; logs the first time.
    pub(crate) fn set_down(&self, error: &StoreError) {
        if self.up.send_if_modified(|up| std::mem::replace(up, false)) {
            warn!(
                error = %error,
                "database unavailable: holding in-flight deliveries, taking no new ones, retrying with backoff"
            );
        }
    }

    /// Records that the database answered; logs when it had not before.
    pub(crate) fn set_up(&self) {
        if self.up.send_if_modified(|up| !std::mem::replace(up, true)) {
            info!("database answers again: resuming");
        }
    }

    /// Returns once the database is believed to answer.
    pub(crate) async fn wait_up(&self) {
        let mut up = self.up.subscribe();
        // The sender lives in `self`, so the channel cannot close.
        let _ = up.wait_for(|up| *up).await;
    }
}
