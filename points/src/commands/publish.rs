//! The points service's own sources for `publish` (one event from flags,
//! a generated load), beside the file every service's `publish` reads.

use crate::generate::{self, LoadSpec};
use crate::points::PaymentSucceeded;

/// Where the events come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// One event.
    One(PaymentSucceeded),
    /// A generated load.
    Generated(LoadSpec),
}

impl Source {
    /// The bodies to publish, in order.
    pub fn bodies(&self) -> Vec<Vec<u8>> {
        match self {
            Source::One(event) => vec![event.to_body()],
            Source::Generated(spec) => generate::events(spec)
                .iter()
                .map(PaymentSucceeded::to_body)
                .collect(),
        }
    }
}
