//! A memory alarm stops every publisher of the broker, so this test runs in
//! a binary of its own: cargo runs test binaries one after another, and no
//! other test publishes while it holds the alarm.

#![allow(unreachable_pub, missing_docs, dead_code)]

#[path = "it/helpers.rs"]
mod helpers;

use std::time::Duration;

use anyhow::Context;

use helpers::{TestEnv, amqp_url, database_url, idem_command, patient, rabbitmqctl, wait_for};

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
        helpers::rabbitmqctl_run(&["set_vm_memory_high_watermark", "0.000001"])?;
        Ok(Self { watermark })
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        let _ = helpers::rabbitmqctl_run(&["set_vm_memory_high_watermark", &self.watermark]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_connection_is_logged_with_the_brokers_reason_and_again_when_unblocked()
-> anyhow::Result<()> {
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

/// A file removed when the test ends.
struct Removed(std::path::PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
