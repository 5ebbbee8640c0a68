//! `rabbit-definitions.json` describes exactly what the worker declares.

use anyhow::{Context, bail};
use std::time::Duration;

use serde_json::Value;

use crate::helpers::{Vhost, rabbitmqctl_run};

use idem::broker::{AmqpConfig, Topology, TopologyError, connect};
use idem::secret::SecretUrl;

const FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/rabbit-definitions.json");

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
    let declared = idem::points::topology().definitions("/");
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
    let defaults = idem::points::topology();
    crate::helpers::wait_for("the import", Duration::from_secs(30), || async {
        let listed = crate::helpers::rabbitmqctl()
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
        &crate::helpers::amqp_user(),
        ".*",
        ".*",
        ".*",
    ])?;

    let amqp = AmqpConfig::new(SecretUrl::new(vhost.amqp_url()));
    let connection = connect(&amqp, "idem definitions test").await?;
    idem::points::topology().declare(&connection).await?;

    // And a worker configured otherwise is told so in one clear line.
    let other = Topology {
        delivery_limit: idem::points::topology().delivery_limit + 3,
        ..idem::points::topology()
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
