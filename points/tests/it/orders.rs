//! The ordered example, `examples/orders`, run as worker processes against
//! the real services: each order's statuses applied in the order they were
//! published, once each, with four workers sharing the slots and two of
//! them killed with SIGKILL while the events flow; and the example's
//! `parked` command over an order whose head fails.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::ensure;
use deadpool_postgres::Pool;
use lapin::types::AMQPValue;

use idem::broker::{AmqpConfig, Outgoing, Topology, connect};
use idem::handler::ORDERING_KEY_HEADER;
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;
use idem::vars;

use crate::support::{
    TEST_RETRY_DELAYS, Vhost, WorkerProcess, clean_up, database_url, drop_schema, example_binary,
    free_port, http_get, publish_messages, sample, unique_name, wait_for,
};

/// The example's topology: eight slots, and the tests' short retry delays,
/// which the example is told.
fn topology() -> Topology {
    Topology {
        retry: idem::RetryPolicy::default().with_delays(TEST_RETRY_DELAYS.to_vec()),
        ..Topology::for_queue("orders.status")
            .bound_to("orders", "order.status")
            .ordered(8)
    }
}

const STATUSES: [&str; 4] = ["created", "paid", "shipped", "delivered"];

/// A vhost and a schema of the test's own, for the example.
struct OrdersEnv {
    name: String,
    binary: PathBuf,
    /// Dropped last: it takes the queues with it.
    vhost: Vhost,
    amqp: AmqpConfig,
    pool: Pool,
}

impl OrdersEnv {
    async fn new() -> anyhow::Result<Self> {
        let vhost = Vhost::add(".*", ".*", ".*")?;
        let name = unique_name();
        let amqp = AmqpConfig::new(SecretUrl::new(vhost.amqp_url()));
        let pool = DatabaseConfig::new(SecretUrl::new(database_url()))
            .with_schema(&name)
            .pool()?;
        let env = Self {
            name,
            binary: example_binary("orders")?,
            vhost,
            amqp,
            pool,
        };
        let connection = connect(&env.amqp, "idem orders test").await?;
        topology().declare(&connection).await?;
        connection.close(200, "OK".into()).await?;
        let migrated = env.example().arg("migrate").output().await?;
        ensure!(
            migrated.status.success(),
            "orders migrate: {}",
            String::from_utf8_lossy(&migrated.stderr)
        );
        Ok(env)
    }

    /// The example's binary, pointed at this vhost and schema only.
    fn example(&self) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env(vars::AMQP_URL, self.vhost.amqp_url())
            .env(vars::DATABASE_URL, database_url())
            .env(vars::SCHEMA, &self.name)
            .env(
                vars::RETRY_DELAYS,
                idem::duration::format_list(topology().retry.delays()),
            )
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// `orders worker`, its metrics on `port`.
    fn worker(&self, port: u16) -> anyhow::Result<WorkerProcess> {
        let mut command = self.example();
        command
            .env(vars::HTTP_ADDR, format!("127.0.0.1:{port}"))
            .arg("worker");
        WorkerProcess::start(command)
    }

    /// Publishes each (order, status) with its ordering key, in order.
    async fn publish(&self, changes: &[(String, &str)]) -> anyhow::Result<()> {
        let messages: Vec<Outgoing> = changes
            .iter()
            .map(|(order, status)| {
                let body = serde_json::json!({
                    "eventId": format!("{order}-{status}"),
                    "order": order,
                    "status": status,
                });
                let mut message = topology().event(body.to_string().into_bytes());
                let mut headers = message.properties.headers().clone().unwrap_or_default();
                headers.insert(
                    ORDERING_KEY_HEADER.into(),
                    AMQPValue::LongString(order.as_str().into()),
                );
                message.properties = message.properties.with_headers(headers);
                message
            })
            .collect();
        publish_messages(&self.amqp, &messages).await?;
        Ok(())
    }

    /// Each order's statuses in the order they were applied.
    async fn transitions(&self) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT order_id::text, array_agg(status ORDER BY applied) \
                 FROM order_transitions GROUP BY order_id",
                &[],
            )
            .await?;
        Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
    }

    async fn count(&self, sql: &str) -> anyhow::Result<i64> {
        Ok(self.pool.get().await?.query_one(sql, &[]).await?.get(0))
    }
}

impl Drop for OrdersEnv {
    fn drop(&mut self) {
        clean_up(drop_schema(self.name.clone()));
    }
}

/// `orders` orders' statuses, published status by status: every order
/// created, then every order paid, …
fn load(orders: usize) -> Vec<(String, &'static str)> {
    STATUSES
        .iter()
        .flat_map(|status| (0..orders).map(move |order| (format!("o-{order}"), *status)))
        .collect()
}

/// The slots a worker says it consumes, on its metrics page.
async fn slots(port: u16) -> anyhow::Result<Option<f64>> {
    let Ok((200, page)) = http_get(port, "/metrics").await else {
        return Ok(None);
    };
    Ok(sample(&page, "idem_slots", &[]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_keep_each_order_in_order_through_two_sigkills() -> anyhow::Result<()> {
    let env = OrdersEnv::new().await?;
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect::<anyhow::Result<_>>()?;
    let mut workers: Vec<WorkerProcess> = ports
        .iter()
        .map(|port| env.worker(*port))
        .collect::<anyhow::Result<_>>()?;
    wait_for(
        "each worker on two slots",
        Duration::from_secs(60),
        || async {
            for port in &ports {
                if slots(*port).await? != Some(2.0) {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await?;

    let orders = 500;
    let load = load(orders);
    env.publish(&load).await?;
    // Two workers die with events in flight: what they took and did not
    // ack goes back to their slots, which the other two take once the dead
    // are no longer seen.
    wait_for(
        "the first statuses applied",
        Duration::from_secs(60),
        || async { Ok(env.count("SELECT count(*) FROM order_transitions").await? > 0) },
    )
    .await?;
    workers[0].kill().await?;
    workers[1].kill().await?;
    let total = load.len() as i64;
    wait_for("every status applied", Duration::from_secs(180), || async {
        Ok(env.count("SELECT count(*) FROM order_transitions").await? >= total)
    })
    .await?;
    let survivors: Vec<WorkerProcess> = workers.drain(2..).collect();
    for worker in survivors {
        worker.stop().await?;
    }
    let transitions = env.transitions().await?;
    assert_eq!(transitions.len(), orders);
    for (order, statuses) in &transitions {
        assert_eq!(statuses, &STATUSES, "the statuses of {order}, as applied");
    }
    assert_eq!(
        env.count("SELECT count(*) FROM order_transitions").await?,
        total,
        "each status once"
    );
    assert_eq!(env.count("SELECT count(*) FROM mq_parked_key").await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_whose_status_goes_back_is_parked_and_the_example_lists_it() -> anyhow::Result<()>
{
    let env = OrdersEnv::new().await?;
    let worker = env.worker(free_port()?)?;
    let order = "o-back".to_owned();
    env.publish(&[
        (order.clone(), "created"),
        (order.clone(), "shipped"),
        (order.clone(), "paid"),
        (order.clone(), "delivered"),
        ("o-fine".to_owned(), "created"),
    ])
    .await?;
    wait_for("the order parked", Duration::from_secs(60), || async {
        Ok(
            env.count("SELECT count(*) FROM mq_parked_event").await? == 1
                && env.count("SELECT count(*) FROM order_transitions").await? == 3,
        )
    })
    .await?;
    let listed = env.example().args(["parked", "list"]).output().await?;
    let stdout = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.status.success(), "{stdout}");
    assert!(
        stdout.contains("o-back: 1 event(s) behind o-back-paid (dead-lettered"),
        "{stdout}"
    );
    assert!(stdout.contains("is past paid already"), "{stdout}");
    let status = env.example().arg("status").output().await?;
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert!(
        stdout.contains("parked keys        1 key(s) holding 1 event(s)"),
        "{stdout}"
    );
    // The operator gives the late status up, and releases the order.
    let released = env
        .example()
        .args(["parked", "release", "o-back"])
        .output()
        .await?;
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );
    wait_for("the order delivered", Duration::from_secs(60), || async {
        Ok(env
            .transitions()
            .await?
            .get(&order)
            .is_some_and(|s| s.len() == 3))
    })
    .await?;
    assert_eq!(
        env.transitions().await?[&order],
        ["created", "shipped", "delivered"]
    );
    worker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_s_own_publish_sends_each_order_under_its_key_and_refuses_a_bad_file()
-> anyhow::Result<()> {
    let env = OrdersEnv::new().await?;
    let lines: Vec<String> = load(20)
        .iter()
        .map(|(order, status)| {
            serde_json::json!({"eventId": format!("{order}-{status}"), "order": order, "status": status})
                .to_string()
        })
        .collect();
    let file = std::env::temp_dir().join(format!("{}.jsonl", unique_name()));
    // A status no order has: the whole file is refused, naming its line.
    let mut bad = lines.clone();
    bad.insert(
        7,
        r#"{"eventId": "o-1-lost", "order": "o-1", "status": "lost"}"#.into(),
    );
    std::fs::write(&file, bad.join("\n"))?;
    let refused = env
        .example()
        .args(["publish", "--file"])
        .arg(&file)
        .output()
        .await;
    // The good lines, on standard input.
    std::fs::write(&file, lines.join("\n"))?;
    let mut publish = env.example();
    publish
        .args(["publish", "--file", "-"])
        .stdin(std::fs::File::open(&file)?);
    let published = publish.output().await;
    let _ = std::fs::remove_file(&file);
    let (refused, published) = (refused?, published?);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        refused.status.code() == Some(1)
            && stderr.contains(".jsonl:8: ")
            && stderr.contains("nothing was published"),
        "{refused:?}"
    );
    let stdout = String::from_utf8_lossy(&published.stdout);
    ensure!(
        published.status.success()
            && stdout.contains("published 80 messages (80 distinct events): 80 confirmed"),
        "{published:?}"
    );
    // Each under its order's key, through the slots: in order, each once.
    let worker = env.worker(free_port()?)?;
    wait_for("every status applied", Duration::from_secs(60), || async {
        Ok(env.count("SELECT count(*) FROM order_transitions").await? == 80)
    })
    .await?;
    worker.stop().await?;
    let transitions = env.transitions().await?;
    ensure!(transitions.len() == 20, "{transitions:?}");
    for (order, statuses) in &transitions {
        ensure!(statuses == &STATUSES, "{order}: {statuses:?}");
    }
    Ok(())
}
