//! One module per subcommand that is more than a call into the library.
//! Each takes typed settings and returns a report for `main` to print.

#[cfg(feature = "tools")]
pub mod bench;
#[cfg(feature = "tools")]
pub mod demo;
pub mod dlq;
#[cfg(feature = "tools")]
pub mod lab;
pub mod prune;
#[cfg(feature = "tools")]
pub mod publish;
#[cfg(feature = "cli")]
pub mod reconcile;
pub mod status;
