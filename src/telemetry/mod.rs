//! Logging and traces: one subscriber, logging to standard error (filtered
//! by `RUST_LOG` when it is set; panics logged as one line like the rest)
//! and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, exporting spans over
//! OTLP ([`trace`]).

use std::io::IsTerminal;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

#[cfg(feature = "otlp")]
mod otlp;
pub mod trace;

#[cfg(feature = "otlp")]
pub use otlp::ExportError;

/// Without the `otlp` feature, no setting can be wrong.
#[cfg(not(feature = "otlp"))]
#[derive(Debug, thiserror::Error)]
#[error("cannot export traces")]
pub struct ExportError(());

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
#[doc(hidden)]
pub fn fatal(format: LogFormat, message: &str) {
    fatal_as("idem", format, message);
}

/// [`fatal`] for the binary `name` (a service built on idem).
#[doc(hidden)]
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
/// `RUST_LOG=idem=debug`). Logs only: [`install`] also exports traces.
pub fn init(default_filter: &str, format: LogFormat) {
    // A second call (tests) keeps the first subscriber.
    let _ = Registry::default()
        .with(log_layer(default_filter, format))
        .try_init();
    crate::caught::install_hook();
}

/// What keeps exporting spans until it is dropped, when it flushes those
/// not yet sent. Hold it until the process ends.
#[derive(Debug, Default)]
#[must_use = "spans stop being exported when it is dropped"]
pub struct Telemetry {
    #[cfg(feature = "otlp")]
    exporting: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exports_traces(&self) -> bool {
        #[cfg(feature = "otlp")]
        return self.exporting.is_some();
        #[cfg(not(feature = "otlp"))]
        false
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(Err(error)) = self.exporting.take().map(|provider| provider.shutdown()) {
            tracing::warn!(%error, "the last spans could not be exported");
        }
    }
}

/// [`init`]: this build cannot export spans (the `otlp` feature).
#[cfg(not(feature = "otlp"))]
#[doc(hidden)]
pub fn install(
    _name: &str,
    default_filter: &str,
    format: LogFormat,
) -> Result<Telemetry, ExportError> {
    init(default_filter, format);
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
        tracing::warn!("built without the otlp feature: OTEL_EXPORTER_OTLP_ENDPOINT is ignored");
    }
    Ok(Telemetry::default())
}

/// [`init`], and spans exported over OTLP as the OpenTelemetry SDK's
/// variables say when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, as the service `name`
/// unless `OTEL_SERVICE_NAME` names it. Fails only on a setting the
/// exporter cannot use.
#[cfg(feature = "otlp")]
#[doc(hidden)]
pub fn install(
    name: &str,
    default_filter: &str,
    format: LogFormat,
) -> Result<Telemetry, ExportError> {
    let Some(provider) = otlp::provider(name)? else {
        init(default_filter, format);
        return Ok(Telemetry::default());
    };
    use opentelemetry::trace::TracerProvider;
    let tracer = provider.tracer("idem");
    let _ = Registry::default()
        .with(log_layer(default_filter, format))
        .with(trace::layer(tracer))
        .try_init();
    crate::caught::install_hook();
    Ok(Telemetry {
        exporting: Some(provider),
    })
}

/// Log lines to standard error, filtered by `RUST_LOG` or `default_filter`.
fn log_layer(default_filter: &str, format: LogFormat) -> Box<dyn Layer<Registry> + Send + Sync> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    match format {
        LogFormat::Text => layer.with_filter(filter).boxed(),
        LogFormat::Json => layer.json().with_filter(filter).boxed(),
    }
}
