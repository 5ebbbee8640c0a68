//! Running code under faults on the real servers, as `idem lab` and
//! [`check`](crate::check) do: loads that repeat their events, published
//! with confirms; the tally of what a run doubled and lost; a TCP proxy to
//! cut connections with.

mod load;
pub mod proxy;
mod tally;

pub use load::{Load, Repeats, publish, publish_keyed};
pub use tally::Exactness;
