//! One module per subcommand that is more than a call into the library.
//! Each takes typed settings and returns a report for `main` to print; the
//! dead letters they read are [`crate::dlq`]'s, and none imports another.

pub mod parked;
pub mod prune;
pub mod publish;
#[cfg(feature = "cli")]
pub mod reconcile;
pub mod status;
