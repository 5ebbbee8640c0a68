//! What only the points binary has, one module per subcommand: each takes
//! typed settings and returns a report for `main` to print.

pub mod bench;
pub mod contender;
pub mod demo;
pub mod lab;
pub mod publish;
