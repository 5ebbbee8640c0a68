//! Beyond one broker node: on a 3-node RabbitMQ cluster, idem rides
//! through the loss of any one node under load, without an operator. Two
//! workers on two nodes and a publisher on the third; one node is killed
//! (the work queue's leader) or stopped (a follower; the dead-letter
//! queue's leader) in the middle, and started again later. Every event is
//! applied once, the dead-letter queue is complete, both workers consume
//! again without a restart, and `publish` exits 0.
//!
//! They need a cluster that they may kill nodes of: `rabbit-cluster up DIR`
//! (see docs/guide/development.md), then
//! `IDEM_TEST_CLUSTER=DIR cargo test --test it -- --ignored cluster::`.
//! `IDEM_TEST_CLUSTER_TOOL` is the `rabbit-cluster` script, if it is not on
//! the PATH. Each prints how long its failover took.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use idem::worker::Mode;
use idem_points::generate::{LoadSpec, distinct_events};
use idem_points::points::PaymentSucceeded;

use crate::support::{
    GROUP, Removed, TestEnv, WorkerProcess, database_url, free_port, http_get, idem_command,
    patient, sample, unique_name, wait_for,
};

/// The cluster's nodes and their AMQP ports, as `rabbit-cluster` runs them.
const NODES: [(&str, u16); 3] = [("ra", 5701), ("rb", 5702), ("rc", 5703)];

/// The cluster of `IDEM_TEST_CLUSTER`, driven by `rabbit-cluster`.
#[derive(Clone)]
struct Cluster {
    dir: PathBuf,
    tool: PathBuf,
}

impl Cluster {
    fn from_env() -> anyhow::Result<Self> {
        let dir = std::env::var_os("IDEM_TEST_CLUSTER")
            .context("IDEM_TEST_CLUSTER must name the directory of a `rabbit-cluster up`")?;
        let tool = std::env::var_os("IDEM_TEST_CLUSTER_TOOL").unwrap_or("rabbit-cluster".into());
        Ok(Self {
            dir: dir.into(),
            tool: tool.into(),
        })
    }

    /// Runs `rabbit-cluster COMMAND DIR ARGS…`; its standard output.
    fn run(&self, command: &str, args: &[&str]) -> anyhow::Result<String> {
        let output = std::process::Command::new(&self.tool)
            .arg(command)
            .arg(&self.dir)
            .args(args)
            .output()
            .with_context(|| format!("running {}", self.tool.display()))?;
        if !output.status.success() {
            bail!(
                "rabbit-cluster {command} {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// `rabbit-cluster COMMAND DIR NODE`, off the runtime's threads.
    fn on_node(
        &self,
        command: &'static str,
        node: &str,
    ) -> tokio::task::JoinHandle<anyhow::Result<String>> {
        let cluster = self.clone();
        let node = node.to_owned();
        tokio::task::spawn_blocking(move || cluster.run(command, &[&node]))
    }

    /// One URL per node, `first` first: what a client near `first` is given.
    fn urls_from(first: &str) -> String {
        let start = NODES
            .iter()
            .position(|(node, _)| *node == first)
            .unwrap_or(0);
        (0..NODES.len())
            .map(|i| {
                let port = NODES[(start + i) % NODES.len()].1;
                format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `rabbitmqctl list_queues` of the default vhost, as `asking` (a node
    /// that is up) answers, with `columns` (and options).
    fn list_queues(&self, asking: &str, columns: &[&str]) -> anyhow::Result<String> {
        let mut args = vec![asking, "list_queues", "-p", "/"];
        args.extend_from_slice(columns);
        self.run("ctl", &args)
    }

    /// The node that leads `queue` and those that follow it, as `asking`
    /// (a node that is up) sees them.
    fn members(&self, asking: &str, queue: &str) -> anyhow::Result<(String, Vec<String>)> {
        #[derive(serde::Deserialize)]
        struct Row {
            name: String,
            leader: String,
            members: Vec<String>,
        }
        let listing = self.list_queues(
            asking,
            &["name", "leader", "members", "--formatter", "json"],
        )?;
        let rows: Vec<Row> = serde_json::from_str(&listing)
            .with_context(|| format!("reading list_queues: {listing}"))?;
        let row = rows
            .into_iter()
            .find(|row| row.name == queue)
            .with_context(|| format!("no queue {queue} on the cluster"))?;
        let short = |node: &str| node.split('@').next().unwrap_or(node).to_owned();
        let leader = short(&row.leader);
        let followers = row
            .members
            .iter()
            .map(|node| short(node))
            .filter(|node| *node != leader)
            .collect();
        Ok((leader, followers))
    }
}

/// Starts every node that is down when a test ends, however it ends.
struct NodesBack<'a>(&'a Cluster);

impl Drop for NodesBack<'_> {
    fn drop(&mut self) {
        if let Err(error) = self.0.run("up", &[]) {
            eprintln!("could not bring the cluster back up: {error:#}");
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL of the node that leads the work queue.
    KillWorkQueueLeader,
    /// A graceful stop of a node that follows the work queue.
    StopFollower,
    /// A graceful stop of the node that leads the dead-letter queue.
    StopDeadLetterQueueLeader,
}

/// A worker process on the cluster with its endpoints on a port of its own.
struct Observed {
    process: WorkerProcess,
    port: u16,
}

impl Observed {
    fn spawn(env: &TestEnv, near: &str) -> anyhow::Result<Self> {
        let port = free_port()?;
        let http = format!("127.0.0.1:{port}");
        let args = ["--max-attempts", "3", "--http-addr", http.as_str()];
        let process = WorkerProcess::spawn(
            env,
            Mode::Batch,
            &Cluster::urls_from(near),
            &database_url(),
            &args,
        )?;
        Ok(Self { process, port })
    }

    async fn ready(&self) -> bool {
        http_get(self.port, "/readyz")
            .await
            .is_ok_and(|(code, _)| code == 200)
    }

    async fn reconnects(&self) -> anyhow::Result<f64> {
        let (_, page) = http_get(self.port, "/metrics").await?;
        Ok(sample(&page, "idem_reconnects_total", &[]).unwrap_or(0.0))
    }
}

/// One test at a time takes nodes down.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn a_node_lost_under_load(fault: Fault) -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::from_env()?;
    cluster.run("up", &[])?;
    let _back = NodesBack(&cluster);
    // Declared through ra: ra leads the queues (client-local placement).
    let env = TestEnv::on_broker(Cluster::urls_from("ra")).await?;
    let (work_leader, work_followers) = cluster.members("ra", &env.topology.queue)?;
    let (dead_leader, _) = cluster.members("ra", &env.topology.dead_letter_queue)?;
    let target = match fault {
        Fault::KillWorkQueueLeader => work_leader,
        Fault::StopFollower => work_followers
            .first()
            .context("the work queue has no follower")?
            .clone(),
        Fault::StopDeadLetterQueueLeader => dead_leader,
    };
    let others: Vec<&str> = NODES
        .iter()
        .map(|(node, _)| *node)
        .filter(|node| *node != target)
        .collect();
    let asking = others[0];

    // 30,000 messages with duplicates; one order's events fail until they
    // are dead-lettered, and some bodies are not events at all.
    let load = idem_points::generate::events(&LoadSpec {
        count: 30_000,
        duplicate_ratio: 0.1,
        orders: 50,
        seed: fastrand::u64(..),
        prefix: env.name.clone(),
    });
    let poisoned = format!("{}-order-0", env.name);
    env.poison_order(&poisoned).await?;
    let invalid: Vec<Vec<u8>> = (0..100)
        .map(|i| format!(r#"{{"eventId": "{}-invalid-{i}"}}"#, env.name).into_bytes())
        .collect();
    let mut lines = Vec::with_capacity(load.len() + invalid.len());
    for (i, event) in load.iter().enumerate() {
        lines.push(event.to_body());
        if i % 300 == 0 && i / 300 < invalid.len() {
            lines.push(invalid[i / 300].clone());
        }
    }
    let file = std::env::temp_dir().join(format!("{}.jsonl", unique_name()));
    std::fs::write(&file, lines.join(&b'\n'))?;
    let _remove = Removed(file.clone());
    let healthy: Vec<PaymentSucceeded> = load
        .iter()
        .filter(|e| e.order_id != poisoned)
        .cloned()
        .collect();
    let applied = distinct_events(&healthy);
    let mut dead: Vec<Vec<u8>> = load
        .iter()
        .filter(|e| e.order_id == poisoned)
        .map(PaymentSucceeded::to_body)
        .chain(invalid.iter().cloned())
        .collect();
    dead.sort();

    // One worker near the node that goes, one near another; the publisher
    // near the third.
    let near_target = Observed::spawn(&env, &target)?;
    let elsewhere = Observed::spawn(&env, others[0])?;
    for worker in [&near_target, &elsewhere] {
        wait_for("the workers ready", Duration::from_secs(60), || async {
            Ok(worker.ready().await)
        })
        .await?;
    }
    let publisher = idem_command(&env, &Cluster::urls_from(others[1]), &database_url())
        .args(["publish", "--allow-invalid", "--window", "64", "--file"])
        .arg(&file)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let publishing = tokio::spawn(publisher.wait_with_output());

    wait_for(
        "a third of the load applied",
        Duration::from_secs(120),
        || async { Ok(env.records(GROUP).await? as usize >= applied / 3) },
    )
    .await?;
    let reconnects = near_target.reconnects().await?;
    let publishing_then = !publishing.is_finished();
    // The fault runs beside the clock (`stop` returns once the node is
    // down, when clients have long moved on), which watches the consume
    // records for the longest pause and the worker near the node for its
    // reconnect, until the node is gone and a thousand more events are in.
    let command = match fault {
        Fault::KillWorkQueueLeader => "kill",
        Fault::StopFollower | Fault::StopDeadLetterQueueLeader => "stop",
    };
    let lost_at = Instant::now();
    let mut faulting = Some(cluster.on_node(command, &target));
    let mut last = (lost_at, env.records(GROUP).await?);
    let mut longest_pause = Duration::ZERO;
    let (mut reconnected, mut gone) = (None, None);
    let mut at_gone = i64::MAX;
    loop {
        let records = env.records(GROUP).await?;
        let now = Instant::now();
        if records > last.1 {
            longest_pause = longest_pause.max(now - last.0);
            last = (now, records);
        }
        if reconnected.is_none()
            && near_target.reconnects().await? > reconnects
            && near_target.ready().await
        {
            reconnected = Some(lost_at.elapsed());
        }
        if let Some(done) = faulting.take_if(|f| f.is_finished()) {
            done.await??;
            gone = Some(lost_at.elapsed());
            at_gone = records;
        }
        let more = records >= at_gone.saturating_add(1000) || records as usize >= applied;
        if reconnected.is_some() && gone.is_some() && more {
            break;
        }
        if lost_at.elapsed() > patient(Duration::from_secs(180)) {
            bail!(
                "after the {command} of {target}: reconnected {reconnected:?}, node gone \
                 {gone:?}, {records} of {applied} events applied"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (reconnected, gone) = (reconnected.unwrap_or_default(), gone.unwrap_or_default());
    let (leader_now, _) = cluster.members(asking, &env.topology.queue)?;

    // Later, the node comes back, and nothing needs telling.
    cluster.on_node("start", &target).await??;
    let output = tokio::time::timeout(patient(Duration::from_secs(300)), publishing)
        .await
        .context("publish did not end")???;
    let summary = String::from_utf8_lossy(&output.stdout).into_owned();
    assert_eq!(
        output.status.code(),
        Some(0),
        "publish failed: {summary}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    wait_for("every event applied", Duration::from_secs(300), || async {
        Ok(env.records(GROUP).await? as usize >= applied)
    })
    .await?;
    // idem makes the hops to the dead-letter queue and back from a wait
    // queue itself: no letter waits for the broker's
    // dead_letter_worker_publisher_confirm_timeout (180 s by default, once
    // or twice on 3.10 after a leader's node is killed), so the last ones
    // follow the last events within seconds.
    // Each body that had to die, there: a count alone can be reached by
    // extra copies (at-least-once) while the last letters are still on
    // their way, held unacked by a worker.
    let mut wanted: BTreeMap<Vec<u8>, usize> = BTreeMap::new();
    for body in &dead {
        *wanted.entry(body.clone()).or_default() += 1;
    }
    let all_dead = wait_for("the dead letters", Duration::from_secs(30), || async {
        if (env.ready(&env.topology.dead_letter_queue).await? as usize) < dead.len() {
            return Ok(false);
        }
        Ok(missing(&wanted, &dead_letter_bodies(&env).await?).is_empty())
    })
    .await;
    if let Err(error) = all_dead {
        let columns = [
            "name",
            "messages",
            "messages_ready",
            "messages_unacknowledged",
        ];
        return Err(error.context(format!(
            "{} of {} dead letters, missing {:?}; the queues: {}",
            env.ready(&env.topology.dead_letter_queue).await?,
            dead.len(),
            missing(&wanted, &dead_letter_bodies(&env).await?),
            cluster.list_queues(asking, &columns)?
        )));
    }
    let dead_complete = lost_at.elapsed();
    wait_for(
        "the work and wait queues empty",
        Duration::from_secs(60),
        || async {
            let mut empty = env.ready(&env.topology.queue).await? == 0;
            for delay in env.topology.retry.delays() {
                empty &= env.ready(&env.topology.wait_queue(*delay)).await? == 0;
            }
            Ok(empty)
        },
    )
    .await?;
    for worker in [&near_target, &elsewhere] {
        assert!(worker.ready().await, "a worker is not ready");
    }
    assert_eq!(
        env.consumers(&env.topology.queue).await?,
        2,
        "both workers consume"
    );
    near_target.process.stop().await?;
    elsewhere.process.stop().await?;

    // Exactly once, and the dead letters complete: each body that had to
    // die is there (at-least-once dead-lettering may bring a second copy),
    // and nothing else.
    assert_eq!(
        env.doubly_recorded(GROUP).await?,
        0,
        "an event applied twice"
    );
    assert_eq!(env.records(GROUP).await? as usize, applied);
    let expected = idem_points::generate::expected_points(&healthy);
    let points = env.all_points().await?;
    assert_eq!(points, expected, "every order at its total");
    let letters = dead_letter_bodies(&env).await?;
    let short = missing(&wanted, &letters);
    assert!(short.is_empty(), "missing from the dead letters: {short:?}");
    let extra: Vec<_> = letters
        .keys()
        .filter(|body| !wanted.contains_key(*body))
        .map(|body| String::from_utf8_lossy(body).into_owned())
        .collect();
    assert!(
        extra.is_empty(),
        "dead letters that should not be: {extra:?}"
    );
    let copies: usize = letters.values().sum::<usize>() - dead.len();
    eprintln!(
        "{fault:?} of {target}: `{command}` returned after {:.1}s; consumption paused \
         {:.1}s at most; the worker near {target} consumed again {:.1}s after the fault; \
         the work queue is led by {leader_now}; the dead letters were complete {:.1}s \
         after the fault, with {copies} extra copies; publish (running at the fault: \
         {publishing_then}): {}",
        gone.as_secs_f64(),
        longest_pause.as_secs_f64(),
        reconnected.as_secs_f64(),
        dead_complete.as_secs_f64(),
        summary.trim()
    );
    Ok(())
}

/// The bodies in `env`'s dead-letter queue, each with its copies.
async fn dead_letter_bodies(env: &TestEnv) -> anyhow::Result<BTreeMap<Vec<u8>, usize>> {
    let mut letters: BTreeMap<Vec<u8>, usize> = BTreeMap::new();
    for letter in env.dead_letters().await? {
        *letters.entry(letter.body).or_default() += 1;
    }
    Ok(letters)
}

/// The bodies of `wanted` that `letters` has fewer copies of.
fn missing(wanted: &BTreeMap<Vec<u8>, usize>, letters: &BTreeMap<Vec<u8>, usize>) -> Vec<String> {
    wanted
        .iter()
        .filter(|(body, n)| letters.get(*body).copied().unwrap_or(0) < **n)
        .map(|(body, _)| String::from_utf8_lossy(body).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a 3-node cluster: IDEM_TEST_CLUSTER, see docs/guide/development.md"]
async fn killing_the_work_queue_leader_under_load_loses_and_doubles_nothing() -> anyhow::Result<()>
{
    a_node_lost_under_load(Fault::KillWorkQueueLeader).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a 3-node cluster: IDEM_TEST_CLUSTER, see docs/guide/development.md"]
async fn stopping_a_follower_under_load_loses_and_doubles_nothing() -> anyhow::Result<()> {
    a_node_lost_under_load(Fault::StopFollower).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a 3-node cluster: IDEM_TEST_CLUSTER, see docs/guide/development.md"]
async fn stopping_the_dead_letter_queues_node_under_load_loses_and_doubles_nothing()
-> anyhow::Result<()> {
    a_node_lost_under_load(Fault::StopDeadLetterQueueLeader).await
}

/// Each order's events, in the order their transactions started (the
/// consume record's `consumed_at`, the transaction's `now()`): the order
/// they applied, since a key's next transaction starts once the one
/// before has committed. The points effect is a tally (the same in any
/// order), whose events of one key in a batch commit in one transaction:
/// those tie, and are taken in their order in the load.
async fn applied_in_order(env: &TestEnv) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let client = env.pool.get().await?;
    let rows = client
        .query(
            "SELECT event_id FROM mq_consume_record WHERE consumer_group = $1 \
             ORDER BY consumed_at, (regexp_match(event_id, '-e([0-9]+)$'))[1]::int",
            &[&GROUP],
        )
        .await?;
    let mut applied: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for row in rows {
        let event_id: String = row.get(0);
        let (order, _) = event_id
            .rsplit_once("-e")
            .with_context(|| format!("not an event of the load: {event_id}"))?;
        applied.entry(order.to_owned()).or_default().push(event_id);
    }
    Ok(applied)
}

/// The slots a worker holds, on its metrics page.
async fn slots_held(worker: &Observed) -> anyhow::Result<Option<f64>> {
    let Ok((200, page)) = http_get(worker.port, "/metrics").await else {
        return Ok(None);
    };
    Ok(sample(&page, "idem_slots", &[]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a 3-node cluster: IDEM_TEST_CLUSTER, see docs/guide/development.md"]
async fn ordered_keys_keep_their_order_through_two_sigkills_and_a_node_stopped()
-> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::from_env()?;
    cluster.run("up", &[])?;
    let _back = NodesBack(&cluster);
    let env = TestEnv::ordered_on_broker(Cluster::urls_from("ra"), 8).await?;
    // Four workers, near each node in turn: each takes two slots.
    let mut workers: Vec<Observed> = ["ra", "rb", "rc", "ra"]
        .iter()
        .map(|near| Observed::spawn(&env, near))
        .collect::<anyhow::Result<_>>()?;
    wait_for(
        "each worker on two slots",
        Duration::from_secs(90),
        || async {
            for worker in &workers {
                if slots_held(worker).await? != Some(2.0) {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await?;

    // 500 orders, four events each, published event by event: every
    // order's first, then every order's second, …
    let (orders, steps) = (500, 4);
    let order = |o: usize| format!("{}-o{o}", env.name);
    let messages: Vec<idem::broker::Outgoing> = (1..=steps)
        .flat_map(|step| (0..orders).map(move |o| (o, step)))
        .map(|(o, step)| {
            let event = PaymentSucceeded {
                event_id: format!("{}-e{step}", order(o)),
                order_id: order(o),
                points: step as i64,
            };
            env.topology
                .event(event.to_body())
                .with_ordering_key(&event.order_id)
        })
        .collect();
    let total = (orders * steps) as i64;
    // All of it published before the faults: a publish retried after a
    // node went would follow the key's later events, the producer's order
    // broken before idem sees it.
    let amqp =
        idem::broker::AmqpConfig::new(idem::secret::SecretUrl::new(Cluster::urls_from("rc")));
    crate::support::publish_messages(&amqp, &messages).await?;
    wait_for(
        "the first events applied",
        Duration::from_secs(120),
        || async { Ok(env.records(GROUP).await? > 0) },
    )
    .await?;
    // Two workers die with events in flight, and a node goes while the
    // other two take their slots.
    workers[0].process.kill().await?;
    workers[1].process.kill().await?;
    cluster.on_node("stop", "rb").await??;
    wait_for("every event applied", Duration::from_secs(300), || async {
        Ok(env.records(GROUP).await? >= total)
    })
    .await?;
    for worker in workers.drain(2..) {
        worker.process.stop().await?;
    }

    assert_eq!(
        env.doubly_recorded(GROUP).await?,
        0,
        "an event applied twice"
    );
    assert_eq!(env.records(GROUP).await?, total);
    let applied = applied_in_order(&env).await?;
    assert_eq!(applied.len(), orders);
    let out_of_order: Vec<_> = applied
        .iter()
        .filter(|(order, events)| {
            let sent: Vec<String> = (1..=steps).map(|step| format!("{order}-e{step}")).collect();
            **events != sent
        })
        .collect();
    assert!(
        out_of_order.is_empty(),
        "{} orders applied out of order, first {:?}",
        out_of_order.len(),
        out_of_order.first()
    );
    assert_eq!(env.count_rows("mq_parked_key").await?, 0);
    assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 0);
    Ok(())
}
