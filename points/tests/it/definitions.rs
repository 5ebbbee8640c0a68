//! `rabbit-definitions.json` describes exactly what the worker declares.

use anyhow::{Context, bail};
use std::time::Duration;

use serde_json::Value;

use crate::support::{
    GROUP, TestEnv, Vhost, WorkerProcess, amqp_url, database_url, idem_command, load, peek,
    rabbitmqctl_run, wait_for,
};

use idem::broker::{AmqpConfig, Topology, TopologyError, connect};
use idem::secret::SecretUrl;
use idem::vars;
use idem::worker::Mode;

const FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../rabbit-definitions.json");

fn definitions() -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(FILE).context("reading rabbit-definitions.json")?;
    Ok(serde_json::from_str(&text)?)
}

/// The entries of `key`, sorted so that order does not matter.
fn sorted(value: &Value, key: &str) -> Vec<String> {
    let mut entries: Vec<String> = value[key]
        .as_array()
        .map(|a| a.iter().map(Value::to_string).collect())
        .unwrap_or_default();
    entries.sort();
    entries
}

#[test]
fn the_definitions_file_holds_exactly_the_declared_topology() -> anyhow::Result<()> {
    let file = definitions()?;
    let declared = idem_points::points::topology().definitions("/");
    for key in ["exchanges", "queues", "bindings"] {
        assert_eq!(sorted(&file, key), sorted(&declared, key), "{key} differ");
    }
    Ok(())
}

#[test]
fn the_definitions_file_defines_the_user_vhost_and_permissions_the_worker_needs()
-> anyhow::Result<()> {
    // Loaded at boot, definitions replace the default guest user and vhost.
    let file = definitions()?;
    let user = file["users"][0]["name"].as_str().context("no user")?;
    assert!(
        file["vhosts"]
            .as_array()
            .is_some_and(|v| v.iter().any(|v| v["name"] == "/"))
    );
    let permission = file["permissions"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["user"] == user && p["vhost"] == "/"))
        .context("no permission for the user on /")?;
    for access in ["configure", "write", "read"] {
        assert_eq!(permission[access], ".*");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_accepts_the_worker_topology_over_the_imported_definitions() -> anyhow::Result<()>
{
    // Import the file into a vhost of this test's own (users left out: this
    // is a shared broker) and let the worker's declarations meet it there.
    let vhost = Vhost::named();
    let mut file = definitions()?;
    let object = file.as_object_mut().context("not an object")?;
    object.remove("users");
    object.remove("permissions");
    object.insert("vhosts".into(), serde_json::json!([{"name": vhost.0}]));
    for key in ["exchanges", "queues", "bindings"] {
        for entry in object[key].as_array_mut().context("not an array")? {
            entry["vhost"] = Value::String(vhost.0.clone());
        }
    }
    // The CLI reads the file; IDEM_TEST_RABBITMQ_ROOT says where its
    // filesystem starts when it runs in a chroot (the rabbit4 tool's).
    let root = std::env::var("IDEM_TEST_RABBITMQ_ROOT").unwrap_or_else(|_| "/".into());
    let inside = format!("/tmp/{}.json", vhost.0);
    let outside = std::path::Path::new(&root).join(inside.trim_start_matches('/'));
    std::fs::write(&outside, serde_json::to_vec(&file)?)?;
    let imported = rabbitmqctl_run(&["import_definitions", &inside]);
    let _ = std::fs::remove_file(&outside);
    imported?;
    // The import finishes in the background: wait until its queues exist,
    // or the worker would declare them first and meet nothing.
    let defaults = idem_points::points::topology();
    crate::support::wait_for("the import", Duration::from_secs(30), || async {
        let listed = crate::support::rabbitmqctl()
            .args([
                "list_queues",
                "-q",
                "--no-table-headers",
                "-p",
                &vhost.0,
                "name",
            ])
            .output()?;
        let names = String::from_utf8_lossy(&listed.stdout);
        Ok([&defaults.queue, &defaults.dead_letter_queue]
            .iter()
            .all(|queue| names.lines().any(|line| line.trim() == queue.as_str())))
    })
    .await?;
    rabbitmqctl_run(&[
        "set_permissions",
        "-p",
        &vhost.0,
        &crate::support::amqp_user(),
        ".*",
        ".*",
        ".*",
    ])?;

    let amqp = AmqpConfig::new(SecretUrl::new(vhost.amqp_url()));
    let connection = connect(&amqp, "idem definitions test").await?;
    idem_points::points::topology().declare(&connection).await?;

    // And a worker configured otherwise is told so in one clear line.
    let other = Topology {
        delivery_limit: idem_points::points::topology().delivery_limit + 3,
        ..idem_points::points::topology()
    };
    match other.declare(&connection).await {
        Err(error @ TopologyError::Mismatch { .. }) => {
            let line = error.to_string();
            assert!(
                line.contains("x-delivery-limit") && line.contains("already exists"),
                "{line}"
            );
            assert!(!line.contains('\n'));
        }
        other => bail!("expected a mismatch, got {other:?}"),
    }
    connection.close(200, "OK".into()).await?;
    Ok(())
}

/// Declares `topology` as idem did before its queues were replicated: a
/// classic dead-letter queue, quorum queues without
/// `x-quorum-initial-group-size`.
async fn declare_as_before(
    connection: &lapin::Connection,
    topology: &Topology,
) -> anyhow::Result<()> {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let table = |pairs: &[(&str, AMQPValue)]| {
        let mut table = FieldTable::default();
        for (key, value) in pairs {
            table.insert((*key).into(), value.clone());
        }
        table
    };
    let text = |s: &str| AMQPValue::LongString(s.into());
    let at_least_once = [
        ("x-queue-type", text("quorum")),
        ("x-dead-letter-strategy", text("at-least-once")),
        ("x-overflow", text("reject-publish")),
    ];
    let mut work = at_least_once.to_vec();
    work.extend([
        (
            "x-dead-letter-exchange",
            text(&topology.dead_letter_exchange),
        ),
        ("x-dead-letter-routing-key", text(&topology.queue)),
        (
            "x-delivery-limit",
            AMQPValue::LongLongInt(topology.delivery_limit.into()),
        ),
    ]);
    let mut queues = vec![
        (topology.queue.clone(), table(&work)),
        (topology.dead_letter_queue.clone(), FieldTable::default()),
    ];
    for delay in topology.retry.waits() {
        let mut wait = at_least_once.to_vec();
        wait.extend([
            (
                "x-message-ttl",
                AMQPValue::LongLongInt(delay.as_millis() as i64),
            ),
            ("x-dead-letter-exchange", text("")),
            ("x-dead-letter-routing-key", text(&topology.queue)),
        ]);
        queues.push((topology.wait_queue(delay), table(&wait)));
    }
    let channel = connection.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    for (name, arguments) in queues {
        channel
            .queue_declare(name.as_str().into(), durable, arguments)
            .await?;
    }
    for (queue, exchange, key) in [
        (&topology.queue, &topology.exchange, &topology.routing_key),
        (
            &topology.dead_letter_queue,
            &topology.dead_letter_exchange,
            &topology.queue,
        ),
    ] {
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    channel.close(200, "OK".into()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topology_an_older_idem_declared_keeps_working_and_a_real_difference_is_still_refused()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // The test's exchanges, queues of their own.
    let old = Topology {
        queue: format!("{}.old", env.topology.queue),
        dead_letter_queue: format!("{}.old.dlq", env.topology.queue),
        ..env.topology.clone()
    };
    env.remove_on_drop(&old.queues())?;
    let connection = env.connect().await?;
    declare_as_before(&connection, &old).await?;

    let load = load(&env, 200, 0.1, 5);
    let invalid = vec![b"not an event".to_vec()];
    let mut command = idem_command(&env, &amqp_url(), &database_url());
    command
        .envs(vars::topology(&old))
        .args(["worker", "--mode", Mode::Batch.as_flag()]);
    let worker = WorkerProcess::start(command)?;
    // The worker declares the topology before it consumes: a queue can
    // only count consumers once it has taken the old layout.
    wait_for("the worker consuming", Duration::from_secs(30), || async {
        Ok(env.consumers(&old.queue).await? == 1)
    })
    .await?;
    env.publish_events(&load).await?;
    env.publish_bodies(&invalid).await?;
    let distinct = idem_points::generate::distinct_events(&load) as i64;
    let applied = wait_for("every event applied", Duration::from_secs(30), || async {
        Ok(env.records(GROUP).await? == distinct && env.ready(&old.dead_letter_queue).await? == 1)
    })
    .await;
    if let Err(error) = applied {
        // Which half is missing, and what the worker saw (CI keeps no log).
        bail!(
            "{error:#}: {} of {distinct} events recorded, {} of 1 dead letter ready, \
             {} in the work queue; the worker's log:\n{}",
            env.records(GROUP).await?,
            env.ready(&old.dead_letter_queue).await?,
            env.ready(&old.queue).await?,
            worker.log()
        );
    }
    let log = worker.stop().await?;
    // The channels the broker closed while the worker compared arguments
    // are no lost connection: one session consumed it all.
    assert!(!log.contains("lost the connection"), "{log}");
    assert!(
        log.contains("is a classic queue, as idem declared it before"),
        "{log}"
    );
    assert!(log.contains("keeps them"), "{log}");
    assert!(
        log.contains("expires its messages after their delay, as idem declared it before"),
        "{log}"
    );
    let letters = peek(&env.amqp, &old.dead_letter_queue).await?;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].body, invalid[0]);

    // What the worker would not take: another delivery limit.
    let other = Topology {
        delivery_limit: old.delivery_limit + 1,
        ..old.clone()
    };
    match other.declare(&connection).await {
        Err(TopologyError::Mismatch { broker, .. }) => {
            assert!(broker.contains("x-delivery-limit"), "{broker}")
        }
        other => bail!("expected a mismatch, got {other:?}"),
    }
    connection.close(200, "OK".into()).await?;
    Ok(())
}
