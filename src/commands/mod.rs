//! One module per subcommand that is more than a call into the library.
//! Each takes typed settings and returns a report for `main` to print.

pub mod bench;
pub mod demo;
pub mod dlq;
pub mod lab;
pub mod prune;
pub mod publish;
pub mod reconcile;
pub mod status;
