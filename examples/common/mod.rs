//! What the examples share: their settings, read as `idem` reads them, and
//! a `main` that runs a command until SIGINT/SIGTERM.

use std::future::Future;
use std::process::ExitCode;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use idem::broker::{AmqpConfig, Topology};
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;
use idem::vars;
use idem::worker::{Mode, WorkerConfig};

/// Environment variable `name`, or `default`.
pub(crate) fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// A worker of `consumer_group` on `topology`, on the services `AMQP_URL`,
/// `DATABASE_URL` and `IDEM_SCHEMA` name, in the mode `IDEM_MODE` names;
/// idem's defaults for everything else.
pub(crate) fn worker_config(
    topology: Topology,
    consumer_group: &str,
) -> anyhow::Result<WorkerConfig> {
    let amqp = AmqpConfig::new(SecretUrl::new(setting(
        vars::AMQP_URL,
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    )));
    let mut database = DatabaseConfig::new(SecretUrl::new(setting(
        vars::DATABASE_URL,
        "postgres://postgres@127.0.0.1:5432/postgres",
    )));
    if let Ok(schema) = std::env::var(vars::SCHEMA) {
        database = database.with_schema(schema);
    }
    let mode: Mode = setting(vars::MODE, Mode::Batch.as_flag())
        .parse()
        .map_err(anyhow::Error::msg)
        .context(vars::MODE)?;
    Ok(WorkerConfig::new(amqp, database, topology, consumer_group).with_mode(mode))
}

/// Runs `run` with the first argument and a token that SIGINT or SIGTERM
/// cancels; an error is one line prefixed with `name`.
pub(crate) fn main<F, Fut>(name: &str, run: F) -> ExitCode
where
    F: FnOnce(String, CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    idem::telemetry::init("info,lapin=off", idem::telemetry::LogFormat::Text);
    let command = std::env::args().nth(1).unwrap_or_default();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{name}: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        let cancel = shutdown.clone();
        tokio::spawn(async move {
            let Ok(mut terminate) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            else {
                return;
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
            cancel.cancel();
        });
        match run(command, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("{name}: {error:#}");
                ExitCode::FAILURE
            }
        }
    })
}
