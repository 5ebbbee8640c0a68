//! `idem reconcile`: the upstream's export against what idem recorded.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use idem::dlq::{self, Action};
use idem::worker::Mode;
use idem_points::points::{PaymentSucceeded, Points};

use crate::support::{
    GROUP, RunningWorker, TestEnv, amqp_url, database_url, idem_command, load, patient,
    unique_name, wait_for,
};

/// A file of the test's own, removed when dropped.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn named(extension: &str) -> Self {
        Self(std::env::temp_dir().join(format!("{}.{extension}", unique_name())))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `idem reconcile` over `export`, writing `report`, with `args`: its exit
/// code and what it printed.
async fn reconcile(
    env: &TestEnv,
    export: &TempFile,
    report: &TempFile,
    args: &[&str],
) -> anyhow::Result<(Option<i32>, String)> {
    let mut command = idem_command(env, &amqp_url(), &database_url());
    command
        .arg("reconcile")
        .arg("--export")
        .arg(&export.0)
        .arg("--report")
        .arg(&report.0)
        .args(args);
    let output = tokio::time::timeout(patient(Duration::from_secs(60)), command.output())
        .await
        .context("reconcile did not finish")??;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((output.status.code(), said))
}

/// The report's event lines: event id → (status, last error).
fn statuses(report: &TempFile) -> anyhow::Result<BTreeMap<String, (String, Option<String>)>> {
    let text = std::fs::read_to_string(&report.0)?;
    let mut statuses = BTreeMap::new();
    for line in text.lines() {
        let line: Value = serde_json::from_str(line)?;
        if let Some(id) = line["eventId"].as_str() {
            statuses.insert(
                id.to_owned(),
                (
                    line["status"].as_str().unwrap_or_default().to_owned(),
                    line["lastError"].as_str().map(str::to_owned),
                ),
            );
        }
    }
    Ok(statuses)
}

/// The ids of the report's events in `status`.
fn having(statuses: &BTreeMap<String, (String, Option<String>)>, status: &str) -> BTreeSet<String> {
    statuses
        .iter()
        .filter(|(_, (s, _))| s == status)
        .map(|(id, _)| id.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_finds_exactly_the_dropped_and_the_poisoned_and_republishing_repairs_them()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut events = load(&env, 1200, 0.0, 30);
    events.sort_by(|a, b| a.event_id.cmp(&b.event_id));
    events.dedup_by(|a, b| a.event_id == b.event_id);
    let poisoned_order = events[0].order_id.clone();
    env.poison_order(&poisoned_order).await?;
    let poisoned: BTreeSet<String> = events
        .iter()
        .filter(|e| e.order_id == poisoned_order)
        .map(|e| e.event_id.clone())
        .collect();
    // Every 40th of the others never reaches the broker.
    let dropped: BTreeSet<String> = events
        .iter()
        .filter(|e| e.order_id != poisoned_order)
        .step_by(40)
        .map(|e| e.event_id.clone())
        .collect();
    let export = TempFile::named("jsonl");
    let lines: Vec<String> = events
        .iter()
        .map(|e| String::from_utf8_lossy(&e.to_body()).into_owned())
        .collect();
    std::fs::write(&export.0, lines.join("\n") + "\n")?;
    let sent: Vec<PaymentSucceeded> = events
        .iter()
        .filter(|e| !dropped.contains(&e.event_id))
        .cloned()
        .collect();

    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    env.publish_events(&sent).await?;
    let applied = (sent.len() - poisoned.len()) as i64;
    wait_for(
        "the load applied, the poisoned dead-lettered",
        Duration::from_secs(90),
        || async {
            Ok(env.records(GROUP).await? == applied
                && env.ready(&env.topology.dead_letter_queue).await? as usize == poisoned.len())
        },
    )
    .await?;
    worker.stop().await?;

    let report = TempFile::named("report.jsonl");
    let (code, said) = reconcile(&env, &export, &report, &[]).await?;
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains(&format!(
            "{} events in the export: {applied} applied, {} dead-lettered, 0 failing, {} missing",
            events.len(),
            poisoned.len(),
            dropped.len()
        )),
        "{said}"
    );
    let found = statuses(&report)?;
    assert_eq!(found.len(), events.len());
    assert_eq!(having(&found, "missing"), dropped);
    assert_eq!(having(&found, "dead_lettered"), poisoned);
    for id in &poisoned {
        let error = found[id].1.as_deref().unwrap_or_default();
        assert!(error.contains("is poisoned"), "{id}: {error}");
    }
    // The orders whose points fall short: the poisoned one, and those of
    // the dropped events.
    let short: BTreeSet<&str> = events
        .iter()
        .filter(|e| dropped.contains(&e.event_id) || poisoned.contains(&e.event_id))
        .map(|e| e.order_id.as_str())
        .collect();
    assert!(said.contains(&format!("{} not", short.len())), "{said}");

    // Republished, the missing are applied once; the poisoned, once their
    // order is mended, by a replay.
    let (code, said) = reconcile(&env, &export, &report, &["--republish-missing"]).await?;
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains(&format!("republished {} missing events", dropped.len())),
        "{said}"
    );
    env.sql("DROP TRIGGER poison ON user_points").await?;
    let dlq_config = env.dlq_config();
    let replay = Action::Replay {
        rate: None,
        include_invalid: false,
    };
    dlq::run(&dlq_config, &replay, &Points, &CancellationToken::new()).await?;
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_for("everything applied", Duration::from_secs(60), || async {
        Ok(env.records(GROUP).await? == events.len() as i64)
    })
    .await?;
    worker.stop().await?;

    // The same export as CSV, now matching throughout.
    let csv = TempFile::named("csv");
    let mut text = String::from("eventId,orderId,points\n");
    for e in &events {
        text.push_str(&format!("{},{},{}\n", e.event_id, e.order_id, e.points));
    }
    std::fs::write(&csv.0, text)?;
    let (code, said) = reconcile(&env, &csv, &report, &[]).await?;
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("everything matches"), "{said}");
    assert_eq!(having(&statuses(&report)?, "applied").len(), events.len());
    Ok(())
}
