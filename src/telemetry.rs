//! Logging: one subscriber, to standard error, filtered by `RUST_LOG` when
//! it is set; panics logged as one line like the rest.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

impl LogFormat {
    /// Every format.
    pub const ALL: [LogFormat; 2] = [LogFormat::Text, LogFormat::Json];

    /// The value of `--log-format` that selects this format.
    pub fn as_flag(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// Prints the line a command ends with when it fails: `idem: …` as text,
/// one JSON object (as the subscriber writes them) with `--log-format json`.
/// Written directly, so that no filter can hide it.
pub fn fatal(format: LogFormat, message: &str) {
    fatal_as("idem", format, message);
}

/// [`fatal`] for the binary `name` (a service built on idem).
pub fn fatal_as(name: &str, format: LogFormat, message: &str) {
    let message = message.replace('\n', " ");
    match format {
        LogFormat::Text => eprintln!("{name}: {message}"),
        LogFormat::Json => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            let line = serde_json::json!({
                "timestamp": crate::duration::rfc3339(now.as_secs()),
                "level": "ERROR",
                "fields": {"message": format!("{name}: {message}")},
                "target": "idem",
            });
            eprintln!("{line}");
        }
    }
}

/// Installs the global subscriber, and a panic hook that logs through it.
/// `default_filter` applies unless `RUST_LOG` is set (e.g.
/// `RUST_LOG=idem=debug`).
pub fn init(default_filter: &str, format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    // A second call (tests) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    crate::caught::install_hook();
}
