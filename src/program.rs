//! The name the running binary goes by, for the commands idem's messages
//! suggest (`` `wallet dlq sync` ``): set once by [`crate::cli::Service`]
//! (the binary's file name, unless the service names itself); `idem`
//! until then, and in a process that runs no service's command line.

use std::sync::OnceLock;

static NAME: OnceLock<String> = OnceLock::new();

/// The binary's name, in the hints of idem's messages.
pub(crate) fn name() -> &'static str {
    NAME.get().map_or("idem", String::as_str)
}

/// Names the binary; the first name given stays.
#[cfg(feature = "cli")]
pub(crate) fn set(name: &str) {
    let _ = NAME.set(name.to_owned());
}
