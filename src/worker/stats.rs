//! Counters of what the worker did, cheap to bump from any task and ready to
//! be exported.

use std::sync::atomic::{AtomicU64, Ordering};

/// Running totals since the worker started.
#[derive(Debug, Default)]
pub struct Stats {
    received: AtomicU64,
    applied: AtomicU64,
    duplicates: AtomicU64,
    invalid: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    infrastructure_retries: AtomicU64,
    sessions: AtomicU64,
    reconnects: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Deliveries taken from the broker.
    pub received: u64,
    /// Events whose effect this worker applied.
    pub applied: u64,
    /// Deliveries of events applied before: acked without effect.
    pub duplicates: u64,
    /// Deliveries that broke the message contract: dead-lettered at once.
    pub invalid: u64,
    /// Failed deliveries given back to the queue for another attempt.
    pub retried: u64,
    /// Failed deliveries that used up their attempts: dead-lettered.
    pub dead_lettered: u64,
    /// Transactions retried because the database was unavailable.
    pub infrastructure_retries: u64,
    /// Consuming sessions started (one per broker connection).
    pub sessions: u64,
    /// Broker connections reopened after a loss.
    pub reconnects: u64,
}

impl Snapshot {
    /// Deliveries settled for good: acked or dead-lettered.
    pub fn finished(&self) -> u64 {
        self.applied + self.duplicates + self.invalid + self.dead_lettered
    }
}

macro_rules! counters {
    ($($name:ident),*) => {
        impl Stats {
            $(
                #[doc = concat!("Adds `n` to `", stringify!($name), "`.")]
                pub(crate) fn $name(&self, n: u64) {
                    self.$name.fetch_add(n, Ordering::Relaxed);
                }
            )*

            /// The counters now.
            pub fn snapshot(&self) -> Snapshot {
                Snapshot { $($name: self.$name.load(Ordering::Relaxed)),* }
            }
        }
    };
}

counters!(
    received,
    applied,
    duplicates,
    invalid,
    retried,
    dead_lettered,
    infrastructure_retries,
    sessions,
    reconnects
);
