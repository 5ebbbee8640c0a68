//! `idem bench` over a table that already holds consume records: the run
//! is told apart from the prefilled rows, checked, and its WAL reported;
//! and a run through the outbox, checked for every credit sent.

use std::time::Duration;

use anyhow::Context;
use tokio::process::Command;

use idem::vars;

use crate::support::{amqp_url, database_url, patient};

/// `idem bench` with `args`: what it printed, once it succeeded (it checks
/// every run it makes, and fails otherwise).
async fn bench(args: &[&str]) -> anyhow::Result<String> {
    let bench = Command::new(env!("CARGO_BIN_EXE_idem"))
        .env(vars::AMQP_URL, amqp_url())
        .env(vars::DATABASE_URL, database_url())
        .arg("bench")
        .args(args)
        .output();
    let output = tokio::time::timeout(patient(Duration::from_secs(120)), bench)
        .await
        .context("the bench did not finish")??;
    anyhow::ensure!(output.status.success(), "{output:?}");
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_over_prefilled_records_checks_its_own_run_and_reports_its_wal() -> anyhow::Result<()>
{
    let stdout = bench(&[
        "--messages",
        "2000",
        "--rounds",
        "1",
        "--modes",
        "batch",
        "--uuid-ids",
        "--prefill",
        "0,5000",
        "--outbox",
    ])
    .await?;
    // The bench checks every run (exact totals, one record per event of
    // the load) and fails otherwise: its own records must be told apart
    // from the 5,000 that were there before.
    assert!(
        stdout.contains("exact totals, one record per event"),
        "{stdout}"
    );
    assert!(stdout.contains("random UUID event ids"), "{stdout}");
    let row = stdout
        .lines()
        .find(|line| line.starts_with("batch, 5000 records before "))
        .with_context(|| format!("no row for the prefilled run: {stdout}"))?;
    let fields: Vec<&str> = row.split_whitespace().collect();
    let [.., wal_bytes, full_pages] = fields.as_slice() else {
        anyhow::bail!("short row: {row}");
    };
    let wal_bytes: f64 = wal_bytes.parse().with_context(|| row.to_owned())?;
    let full_pages: f64 = full_pages.parse().with_context(|| row.to_owned())?;
    assert!(wal_bytes > 0.0, "{row}");
    assert!(full_pages >= 0.0, "{row}");
    assert!(
        stdout.contains("batch, 5000 records before / on an empty table: "),
        "{stdout}"
    );
    // And the run through the outbox, checked for a credit sent per event.
    assert!(
        stdout
            .lines()
            .any(|line| line.starts_with("batch, outbox on (applied and sent) ")),
        "{stdout}"
    );
    assert!(stdout.contains("batch, outbox on / off: "), "{stdout}");
    // Beside it, on the same load and checked the same way, the batched
    // consumer a team would write instead.
    assert!(
        stdout
            .lines()
            .any(|line| line.starts_with("batch, straightforward batched consumer ")),
        "{stdout}"
    );
    assert!(
        stdout.contains("batch / straightforward batched consumer: throughput "),
        "{stdout}"
    );
    Ok(())
}

/// Per-message mode beside the textbook consumer: both runs checked (exact
/// totals, a record per event), and their ratio reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_the_textbook_consumer_beside_per_message_mode() -> anyhow::Result<()> {
    let stdout = bench(&[
        "--messages",
        "1000",
        "--rounds",
        "1",
        "--modes",
        "per-message",
    ])
    .await?;
    let row = stdout
        .lines()
        .find(|line| line.starts_with("per-message, textbook consumer "))
        .with_context(|| format!("no row for the textbook consumer: {stdout}"))?;
    let rate: f64 = row
        .trim_start_matches("per-message, textbook consumer")
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .parse()
        .with_context(|| row.to_owned())?;
    assert!(rate > 0.0, "{row}");
    assert!(
        stdout.contains("per-message / textbook consumer: throughput "),
        "{stdout}"
    );
    Ok(())
}
