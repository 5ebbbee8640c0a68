//! A memory alarm stops every publisher of the broker, so these tests run
//! in a binary of their own (cargo runs test binaries one after another),
//! one at a time: no other test publishes while one holds the alarm.

#![allow(unreachable_pub, missing_docs, dead_code)]

#[path = "it/support/mod.rs"]
mod support;

use std::time::Duration;

use anyhow::Context;

use idem::worker::Mode;
use support::{
    RunningWorker, TestEnv, amqp_url, database_url, idem_command, patient, rabbitmqctl, wait_for,
};

/// Held by the test that raises the broker's alarm, from its first publish
/// to its last.
static BROKER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The broker's memory watermark, restored on drop however the test ends.
struct Alarm {
    watermark: String,
}

impl Alarm {
    /// Raises a memory alarm: a watermark far below what the broker uses.
    fn raise() -> anyhow::Result<Self> {
        let output = rabbitmqctl()
            .args(["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."])
            .output()?;
        let watermark = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        // A run that died while it held the alarm left a tiny one behind.
        let watermark = match watermark.parse::<f64>() {
            Ok(fraction) if fraction >= 0.05 => watermark,
            _ => "0.4".to_owned(),
        };
        support::rabbitmqctl_run(&["set_vm_memory_high_watermark", "0.000001"])?;
        Ok(Self { watermark })
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        let _ = support::rabbitmqctl_run(&["set_vm_memory_high_watermark", &self.watermark]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_connection_is_logged_with_the_brokers_reason_and_again_when_unblocked()
-> anyhow::Result<()> {
    let _broker = BROKER.lock().await;
    let env = TestEnv::new().await?;
    let log = std::env::temp_dir().join(format!("{}-publish.log", env.name));
    let _remove = Removed(log.clone());
    let alarm = Alarm::raise()?;
    let mut publish = idem_command(&env, &amqp_url(), &database_url())
        .env("RUST_LOG", "info")
        .args(["publish", "--count", "50", "--seed", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    wait_for(
        "the block to be logged",
        Duration::from_secs(30),
        || async { Ok(std::fs::read_to_string(&log)?.contains("RabbitMQ blocked the connection")) },
    )
    .await?;
    let said = std::fs::read_to_string(&log)?;
    assert!(
        said.contains("low on memory"),
        "the broker's reason: {said}"
    );
    assert_eq!(
        env.ready(&env.topology.queue).await?,
        0,
        "blocked, nothing went in"
    );
    drop(alarm);
    let status = tokio::time::timeout(patient(Duration::from_secs(60)), publish.wait())
        .await
        .context("publish did not finish once unblocked")??;
    let said = std::fs::read_to_string(&log)?;
    assert!(status.success(), "{said}");
    assert!(
        said.contains("RabbitMQ unblocked the connection: publishing goes on"),
        "{said}"
    );
    assert_eq!(env.ready(&env.topology.queue).await?, 50);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_under_a_memory_alarm_leaves_exactly_the_letters_it_did_not_replay()
-> anyhow::Result<()> {
    let _broker = BROKER.lock().await;
    let env = TestEnv::new().await?;
    let events = env
        .failed_events(&["alarm-kept", "alarm-replayed"], 1000)
        .await?;
    let (replayed, kept): (Vec<_>, Vec<_>) = events
        .iter()
        .partition(|event| event.order_id == "alarm-replayed");
    let log = std::env::temp_dir().join(format!("{}-replay.log", env.name));
    let _remove = Removed(log.clone());
    let replay = idem_command(&env, &amqp_url(), &database_url())
        .env("RUST_LOG", "info")
        .args([
            "dlq",
            "replay",
            "--error",
            "order alarm-replayed failed",
            "--rate",
            "100",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    wait_for(
        "the replay to be under way",
        Duration::from_secs(60),
        || async { Ok(env.ready(&env.topology.queue).await? >= 50) },
    )
    .await?;
    let alarm = Alarm::raise()?;
    wait_for(
        "the replay to be blocked",
        Duration::from_secs(30),
        || async { Ok(std::fs::read_to_string(&log)?.contains("RabbitMQ blocked the connection")) },
    )
    .await?;
    let blocked_at = u64::from(env.ready(&env.topology.queue).await?);
    drop(alarm);
    let output = tokio::time::timeout(patient(Duration::from_secs(120)), replay.wait_with_output())
        .await
        .context("the replay did not finish once unblocked")??;
    let said = std::fs::read_to_string(&log)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{said}");
    assert!(
        blocked_at < replayed.len() as u64,
        "blocked mid-way, not after {blocked_at} replays"
    );
    assert!(stdout.contains("replayed 1000 message(s)"), "{stdout}");
    // The dead-letter queue holds exactly the letters not replayed, and
    // the work queue each replayed one once.
    let ids = |bodies: Vec<Vec<u8>>| {
        let mut ids: Vec<String> = bodies
            .iter()
            .map(|body| idem_points::points::PaymentSucceeded::parse(body))
            .map(|event| event.map(|event| event.event_id))
            .collect::<Result<_, _>>()?;
        ids.sort();
        anyhow::Ok(ids)
    };
    let expected = |events: &[&idem_points::points::PaymentSucceeded]| {
        let mut ids: Vec<String> = events.iter().map(|event| event.event_id.clone()).collect();
        ids.sort();
        ids
    };
    // The broker's statistics lag seconds behind: the queue is counted
    // once they agree with its own count of ready letters (a letter whose
    // ack was lost would be counted by both, once given back).
    let dead_letters = &env.topology.dead_letter_queue;
    wait_for(
        "the dead-letter queue's statistics to agree with it",
        Duration::from_secs(30),
        || async {
            let ready = u64::from(env.ready(dead_letters).await?);
            Ok(ready == env.messages(dead_letters)? && ready == 1000)
        },
    )
    .await?;
    let letters = env.dead_letters().await?;
    assert_eq!(
        ids(letters.into_iter().map(|letter| letter.body).collect())?,
        expected(&kept)
    );
    assert_eq!(env.ready(&env.topology.queue).await?, 1000);
    let work = env.peek(&env.topology.queue).await?;
    assert_eq!(
        ids(work.into_iter().map(|letter| letter.body).collect())?,
        expected(&replayed)
    );
    assert_eq!(env.count_rows("mq_dead_letter").await?, 1000, "the index");
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_for("the replays applied", Duration::from_secs(60), || async {
        Ok(env.points("alarm-replayed").await? == 1000)
    })
    .await?;
    worker.stop().await?;
    assert_eq!(env.points("alarm-kept").await?, 0);
    Ok(())
}

/// A file removed when the test ends.
struct Removed(std::path::PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
