//! Beyond one PostgreSQL server: a primary and its standby watched by
//! pg_auto_failover (synchronous replication, its default), the worker
//! given both hosts with `target_session_attrs=read-write`. The primary's
//! node is lost under load (its keeper and its PostgreSQL killed with
//! SIGKILL) and the standby promoted; the lost node rejoins as a standby,
//! and a planned switchover moves the primary back. Every event is applied
//! once, nothing is dead-lettered, and no retry is spent on the outage.
//!
//! They need the pair of `.ci/pg-failover up DIR`, then
//! `IDEM_TEST_PG_FAILOVER=DIR cargo test --test it -- --ignored failover::`
//! (`IDEM_TEST_PG_FAILOVER_TOOL` names the script when it is not the
//! repository's). Each prints how long its failover took.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use idem::worker::Mode;

use crate::support::{
    GROUP, RunningWorker, TestEnv, WorkerProcess, amqp_url, assert_exact, load, wait_for,
};

/// The pair's nodes and their ports, as `.ci/pg-failover` runs them: the
/// monitor on `PGFAILOVER_PORT` (5440), the nodes above it.
fn nodes() -> [(&'static str, u16); 2] {
    let base = std::env::var("PGFAILOVER_PORT")
        .ok()
        .and_then(|port| port.parse().ok())
        .unwrap_or(5440_u16);
    [("a", base + 1), ("b", base + 2)]
}

/// The pair of `IDEM_TEST_PG_FAILOVER`, driven by `.ci/pg-failover`.
#[derive(Clone)]
struct Pair {
    dir: PathBuf,
    tool: PathBuf,
}

impl Pair {
    fn from_env() -> anyhow::Result<Self> {
        let dir = std::env::var_os("IDEM_TEST_PG_FAILOVER")
            .context("IDEM_TEST_PG_FAILOVER must name the directory of a `pg-failover up`")?;
        let tool = std::env::var_os("IDEM_TEST_PG_FAILOVER_TOOL").map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/pg-failover"),
            PathBuf::from,
        );
        Ok(Self {
            dir: dir.into(),
            tool,
        })
    }

    /// Runs `pg-failover COMMAND DIR ARGS…` off the runtime's threads; its
    /// standard output.
    async fn run(&self, command: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut process = tokio::process::Command::new(&self.tool);
        process.arg(command).arg(&self.dir).args(args);
        let output = process
            .output()
            .await
            .with_context(|| format!("running {}", self.tool.display()))?;
        if !output.status.success() {
            bail!(
                "pg-failover {command} {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    /// The node that is primary now (its reported state the monitor's).
    async fn primary(&self) -> anyhow::Result<Option<&'static str>> {
        let port = match self.run("primary", &[]).await {
            Ok(port) => port,
            Err(_) => return Ok(None),
        };
        Ok(nodes()
            .into_iter()
            .find(|(_, p)| p.to_string() == port)
            .map(|(node, _)| node))
    }

    /// Both hosts, the primary found by trying them: what a team gives idem.
    fn url() -> String {
        let hosts: Vec<String> = nodes()
            .iter()
            .map(|(_, port)| format!("127.0.0.1:{port}"))
            .collect();
        format!(
            "postgres://postgres@{}/postgres?target_session_attrs=read-write",
            hosts.join(",")
        )
    }
}

/// Starts every node that is down, waits for the pair, and makes its
/// replication synchronous again, when a test ends, however it ends.
struct PairBack(Pair);

impl Drop for PairBack {
    fn drop(&mut self) {
        let pair = &self.0;
        for args in [&["up"][..], &["replication", "sync"]] {
            let output = std::process::Command::new(&pair.tool)
                .arg(args[0])
                .arg(&pair.dir)
                .args(&args[1..])
                .output();
            if !output.is_ok_and(|output| output.status.success()) {
                eprintln!("could not bring the failover pair back: {args:?} failed");
            }
        }
    }
}

/// One test at a time takes the primary away.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The pair up, for this test alone, and brought back up (and synchronous)
/// however the test ends, before the next may take it.
async fn the_pair() -> anyhow::Result<(tokio::sync::MutexGuard<'static, ()>, Pair, PairBack)> {
    let alone = ONE_AT_A_TIME.lock().await;
    let pair = Pair::from_env()?;
    pair.run("up", &[]).await?;
    let back = PairBack(pair.clone());
    Ok((alone, pair, back))
}

/// The consume records, or none while no server takes the test's query.
async fn records(env: &TestEnv) -> i64 {
    env.records(GROUP).await.unwrap_or(0)
}

async fn the_primary_lost_under_load_then_switched_back(mode: Mode) -> anyhow::Result<()> {
    let (_alone, pair, _back) = the_pair().await?;
    let first = pair.primary().await?.context("the pair has no primary")?;

    let env = TestEnv::on_database_server(Pair::url()).await?;
    let load = load(&env, 20_000, 0.1, 50);
    let distinct = idem_points::generate::distinct_events(&load) as i64;
    env.publish_events(&load).await?;
    let worker = RunningWorker::start(env.worker_config(mode));

    wait_for(
        "a third of the load applied",
        Duration::from_secs(120),
        || async { Ok(records(&env).await >= distinct / 3) },
    )
    .await?;
    let before = records(&env).await;
    let lost_at = Instant::now();
    pair.run("kill", &[first]).await?;
    // The first commit on the new primary: the records grow again.
    wait_for(
        "a commit on the promoted standby",
        Duration::from_secs(120),
        || async { Ok(records(&env).await > before) },
    )
    .await?;
    let first_commit = lost_at.elapsed();
    // The monitor may say so a moment after the node takes writes.
    wait_for(
        "the monitor to name the other node primary",
        Duration::from_secs(60),
        || async { Ok(pair.primary().await?.is_some_and(|node| node != first)) },
    )
    .await?;
    wait_for(
        "two thirds of the load applied",
        Duration::from_secs(120),
        || async { Ok(records(&env).await >= 2 * distinct / 3) },
    )
    .await?;
    let settled = lost_at.elapsed();

    // The lost node rejoins as a standby; a planned switchover makes it
    // the primary again while the worker commits.
    pair.run("start", &[first]).await?;
    pair.run("up", &[]).await?;
    let switched_at = Instant::now();
    pair.run("switchover", &[]).await?;
    let switched = switched_at.elapsed();
    assert_eq!(pair.primary().await?, Some(first), "switched back");

    wait_for("every event applied", Duration::from_secs(180), || async {
        Ok(records(&env).await >= distinct)
    })
    .await?;
    wait_for(
        "the work queue to drain",
        Duration::from_secs(60),
        || async { Ok(env.ready(&env.topology.queue).await? == 0) },
    )
    .await?;
    let stats = worker.stop().await?;
    eprintln!(
        "{mode:?}: the primary killed at {before} of {distinct} events; first commit on the \
         promoted standby {first_commit:.1?} later, two thirds applied {settled:.1?} later; \
         the switchover back took {switched:.1?}; {} transactions held for the database",
        stats.infrastructure_retries
    );
    assert!(
        stats.infrastructure_retries > 0,
        "it saw the failover: {stats:?}"
    );
    assert_eq!(
        (stats.retried, stats.dead_lettered),
        (0, 0),
        "no retry spent on the failover, nothing dead-lettered: {stats:?}"
    );
    assert_eq!(
        env.count_rows("mq_failure_ledger").await?,
        0,
        "no failure counted against a message"
    );
    assert_exact(&env, &load, &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn the_primary_lost_under_load_then_switched_back_applies_each_event_once_in_batches()
-> anyhow::Result<()> {
    the_primary_lost_under_load_then_switched_back(Mode::Batch).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn the_primary_lost_under_load_then_switched_back_applies_each_event_once_per_message()
-> anyhow::Result<()> {
    the_primary_lost_under_load_then_switched_back(Mode::PerMessage).await
}

/// A connection string that names only the standby (an old primary after
/// a failover, say): the worker says that the server is a standby and
/// what to give it instead, at each attempt, instead of failing every
/// transaction; it gives up at its startup timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn a_worker_given_only_the_standby_says_so_and_what_to_give_it() -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let pair = Pair::from_env()?;
    pair.run("up", &[]).await?;
    let primary = pair.primary().await?.context("the pair has no primary")?;
    let (_, standby_port) = nodes()
        .into_iter()
        .find(|(node, _)| *node != primary)
        .context("two nodes")?;
    let env = TestEnv::on_database_server(Pair::url()).await?;
    let standby = format!("postgres://postgres@127.0.0.1:{standby_port}/postgres");
    // The standby has replayed the schema's migrations.
    wait_for(
        "the standby to hold the schema",
        Duration::from_secs(30),
        || async {
            let (client, connection) =
                tokio_postgres::connect(&standby, tokio_postgres::NoTls).await?;
            tokio::spawn(connection);
            let query = format!("SELECT count(*) FROM {}.idem_schema_migrations", env.schema);
            Ok(client.query_one(&query, &[]).await.is_ok())
        },
    )
    .await?;
    let mut command = crate::support::idem_command(&env, &crate::support::amqp_url(), &standby);
    command
        .env("IDEM_STARTUP_TIMEOUT", "2s")
        .env("RUST_LOG", "warn")
        .arg("worker");
    let output = tokio::time::timeout(Duration::from_secs(60), command.output()).await??;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() >= 2
            && lines.iter().all(|line| {
                line.contains("the server is a standby (in recovery) and takes no writes")
                    && line.contains("target_session_attrs=read-write")
            }),
        "every attempt and the last line say so: {stderr}"
    );
    Ok(())
}

/// The worker says at its start, and `status` says, what a commit
/// promises: on the pair as
/// pg_auto_failover runs it, that it waits for the standby; with the
/// replication made asynchronous, a warning that a failover can lose
/// effects whose messages were acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn a_worker_says_whether_its_commits_survive_a_failover() -> anyhow::Result<()> {
    let (_alone, pair, _back) = the_pair().await?;
    let env = TestEnv::on_database_server(Pair::url()).await?;
    for (replication, level) in [("sync", " INFO "), ("async", " WARN ")] {
        pair.run("replication", &[replication]).await?;
        let promise = match replication {
            "sync" => "commits wait for a synchronous standby",
            _ => {
                "1 standby(s) replicate asynchronously: a failover to one that is behind loses \
                  effects whose messages were acked"
            }
        };
        let worker = WorkerProcess::spawn(&env, Mode::Batch, &amqp_url(), &Pair::url(), &[])?;
        let told = wait_for(
            "the worker to say what a commit promises",
            Duration::from_secs(30),
            || async {
                let log = worker.log();
                Ok(log.lines().any(|line| {
                    line.contains(level)
                        && line.contains("PostgreSQL at ")
                        && line.contains(promise)
                }))
            },
        )
        .await;
        let log = worker.stop().await?;
        told.with_context(|| format!("{replication}: {log}"))?;
        // `status` says it too.
        let status = crate::support::idem_command(&env, &amqp_url(), &Pair::url())
            .arg("status")
            .output()
            .await?;
        let stdout = String::from_utf8_lossy(&status.stdout);
        anyhow::ensure!(
            status.status.success() && stdout.contains(&format!("database           {promise}")),
            "{replication}: {stdout}{}",
            String::from_utf8_lossy(&status.stderr)
        );
    }
    Ok(())
}

/// The outbox through two failovers: the worker applies and relays, and
/// each time the outbox holds messages the relay has not removed, the
/// primary's node is killed, the standby promoted, and the lost node
/// brought back as a standby. Every applied event's credit is downstream
/// under its key, and none for an event that was not applied; what was
/// sent and not removed before a kill goes again under its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn the_outbox_through_two_failovers_loses_no_credit_and_keeps_every_key() -> anyhow::Result<()>
{
    use crate::outbox::{credited_queue, expected, unsent};
    use idem_points::points::Points;

    let (_alone, pair, _back) = the_pair().await?;
    let env = TestEnv::on_database_server(Pair::url()).await?;
    let queue = credited_queue(&env).await?;
    let events = load(&env, 4000, 0.1, 50);
    let want = expected(&events);
    let handler = Points.announcing(env.topology.exchange.as_str());
    let worker = RunningWorker::start_with(env.worker_config(Mode::Batch), handler);
    for (i, part) in events.chunks(2000).enumerate() {
        env.publish_events(part).await?;
        wait_for(
            "messages of the part in the outbox",
            Duration::from_secs(120),
            || async { Ok(unsent(&env).await.unwrap_or(0) > 0) },
        )
        .await?;
        let lost = pair.primary().await?.context("the pair has no primary")?;
        pair.run("kill", &[lost]).await?;
        wait_for(
            &format!("failover {}: the standby promoted", i + 1),
            Duration::from_secs(120),
            || async { Ok(pair.primary().await?.is_some_and(|node| node != lost)) },
        )
        .await?;
        pair.run("start", &[lost]).await?;
        pair.run("up", &[]).await?;
    }
    every_credit_downstream(&env, worker, &queue, &want).await
}

/// Once every event is applied, its credit sent and the work queue
/// drained (the test's own sessions end with a failover too: a count that
/// fails is not there yet): no retry spent, nothing dead-lettered, and
/// every credit downstream under its key.
async fn every_credit_downstream(
    env: &TestEnv,
    worker: RunningWorker,
    queue: &str,
    want: &std::collections::BTreeMap<String, idem_points::points::PointsCredited>,
) -> anyhow::Result<()> {
    wait_for(
        "every event applied and its credit sent",
        Duration::from_secs(120),
        || async {
            Ok(records(env).await == want.len() as i64
                && crate::outbox::unsent(env).await.unwrap_or(1) == 0
                && env.ready(&env.topology.queue).await? == 0)
        },
    )
    .await?;
    let stats = worker.stop().await?;
    assert_eq!(
        (stats.retried, stats.dead_lettered),
        (0, 0),
        "no retry spent on the failovers: {stats:?}"
    );
    crate::outbox::every_credit_received(env, queue, want).await
}

/// The standby held behind under asynchronous replication (the primary's
/// walsender stopped: the standby receives nothing more, and still reads
/// as streaming), half the load applied, the primary killed and the
/// standby promoted.
/// Acking at commit, events whose messages were acked are gone: the test
/// prints how many. With `ack_after_standbys`, no delivery is acked before
/// a standby has its commit: the deliveries wait, unacked, the events run
/// again on the promoted standby once a standby streams from it (the lost
/// node, back), and every event is applied exactly once: in batch mode,
/// whose transactions wait, and in per-message mode, whose shared flush
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn acks_after_the_standby_lose_nothing_when_a_standby_behind_is_promoted()
-> anyhow::Result<()> {
    let (_alone, pair, _back) = the_pair().await?;
    pair.run("replication", &["async"]).await?;

    let lost = lost_to_a_standby_behind(&pair, 0, Mode::Batch).await?;
    eprintln!(
        "acking at commit: {} of {} events lost once the standby behind was promoted",
        lost.lost, lost.distinct
    );
    anyhow::ensure!(
        lost.lost > 0,
        "the standby was held behind and promoted, yet no acked event was lost: the test \
         shows nothing ({lost:?})"
    );

    for mode in Mode::ALL {
        let kept = lost_to_a_standby_behind(&pair, 1, mode).await?;
        eprintln!(
            "{mode:?}, acking after the standby: {} of {} events lost; {} transactions held \
             for the standby",
            kept.lost, kept.distinct, kept.stats.infrastructure_retries
        );
        assert_eq!(kept.lost, 0, "{mode:?}: {kept:?}");
        assert_eq!(
            (kept.stats.retried, kept.stats.dead_lettered),
            (0, 0),
            "{mode:?}: no retry spent waiting for the standby, nothing dead-lettered: {kept:?}"
        );
    }
    Ok(())
}

#[derive(Debug)]
struct Loss {
    distinct: i64,
    lost: i64,
    stats: idem::worker::Snapshot,
}

/// One run of the load on the pair's primary with its standby held
/// behind, a worker acking after `standbys` standbys (0: at commit), the
/// primary killed once part of it is committed and brought back as a
/// standby once the other is promoted. How many events are missing once
/// every delivery was acked.
async fn lost_to_a_standby_behind(pair: &Pair, standbys: u32, mode: Mode) -> anyhow::Result<Loss> {
    let env = TestEnv::on_database_server(Pair::url()).await?;
    let load = load(&env, 20_000, 0.1, 50);
    let distinct = idem_points::generate::distinct_events(&load) as i64;
    env.publish_events(&load).await?;
    let first = pair.primary().await?.context("the pair has no primary")?;
    pair.run("hold", &[first]).await?;
    let mut config = env.worker_config(mode);
    config.ack_after_standbys = standbys;
    let worker = RunningWorker::start(config);
    // Acking after the standby, the first transaction that waits in vain
    // holds the worker (as an outage of the database does): every record
    // on the primary is one the standby does not have.
    let committed = if standbys == 0 { distinct / 2 } else { 1 };
    wait_for(
        "part of the load committed on the primary",
        Duration::from_secs(40),
        || async { Ok(records(&env).await >= committed) },
    )
    .await?;
    // Batch mode counts each wait that ran out; per-message mode's claims
    // that wait in their shared flush run again uncounted.
    if standbys > 0 && mode == Mode::Batch {
        wait_for(
            "a transaction held for the standby",
            Duration::from_secs(30),
            || async { Ok(worker.stats.snapshot().infrastructure_retries > 0) },
        )
        .await?;
    }
    pair.run("kill", &[first]).await?;
    wait_for("the standby promoted", Duration::from_secs(120), || async {
        Ok(pair.primary().await?.is_some_and(|node| node != first))
    })
    .await?;
    pair.run("start", &[first]).await?;
    pair.run("up", &[]).await?;
    worker
        .wait_finished(load.len() as u64, Duration::from_secs(180))
        .await?;
    let stats = worker.stop().await?;
    // The test's own sessions went with the lost primary: the count once
    // a server takes it.
    wait_for(
        "the records counted on the new primary",
        Duration::from_secs(60),
        || async { Ok(env.records(GROUP).await.is_ok()) },
    )
    .await?;
    let lost = distinct - env.records(GROUP).await?;
    if lost == 0 {
        assert_exact(&env, &load, &[]).await?;
    }
    Ok(Loss {
        distinct,
        lost,
        stats,
    })
}

/// A prune cut by a failover, with the worker applying and relaying: two
/// closed epochs past the window, the prune's transaction that drops the
/// first of them held after its `DROP TABLE` (the test's own session
/// holds the epoch's row), and the primary killed then. On the promoted
/// standby each epoch is whole, its row and its partition both there;
/// the next prune drops both; every applied event's credit is downstream
/// under its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn a_prune_cut_by_a_failover_leaves_every_epoch_whole() -> anyhow::Result<()> {
    use crate::outbox::{credited_queue, expected};
    use idem::store::retention::{self, PruneConfig};
    use idem_points::points::Points;

    let (_alone, pair, _back) = the_pair().await?;
    let env = TestEnv::on_database_server(Pair::url()).await?;
    let queue = credited_queue(&env).await?;
    // Two closed epochs and the current one, all opened a month ago: a
    // prune with a week's window drops the closed ones.
    let closed = {
        let client = env.pool.get().await?;
        let first = retention::epochs(&client)
            .await?
            .last()
            .context("no epoch")?
            .epoch;
        let second = retention::open_epoch(&client).await?;
        retention::open_epoch(&client).await?;
        client
            .execute(
                "UPDATE mq_consume_epoch SET opened_at = opened_at - interval '30 days'",
                &[],
            )
            .await?;
        [first, second]
    };
    let events = load(&env, 4000, 0.1, 50);
    let want = expected(&events);
    env.publish_events(&events).await?;
    let handler = Points.announcing(env.topology.exchange.as_str());
    let worker = RunningWorker::start_with(env.worker_config(Mode::Batch), handler);
    wait_for(
        "a tenth of the load applied",
        Duration::from_secs(120),
        || async { Ok(records(&env).await >= want.len() as i64 / 10) },
    )
    .await?;

    // The first epoch's row held, the prune drops its partition and waits.
    let holder = env.pool.get().await?;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM mq_consume_epoch WHERE epoch = {} FOR UPDATE",
            closed[0]
        ))
        .await?;
    let week = Duration::from_secs(7 * 86_400);
    let config = PruneConfig::new(
        week,
        Duration::from_secs(100 * 86_400),
        Duration::from_secs(120),
    );
    let pool = env.pool.clone();
    let pruning = tokio::spawn(async move { retention::prune(&pool, &config).await });
    wait_for(
        "the prune to have dropped a partition and to wait for the epoch's row",
        Duration::from_secs(60),
        || async {
            if pruning.is_finished() {
                bail!("the prune ended without waiting for the epoch's row");
            }
            // Not on the holder's session: within its transaction, the
            // server's activity reads as it was at the first look.
            let waiting: i64 = env
                .pool
                .get()
                .await?
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                     AND query LIKE 'DELETE FROM mq_consume_epoch%'",
                    &[],
                )
                .await?
                .get(0);
            Ok(waiting == 1)
        },
    )
    .await?;
    let lost = pair.primary().await?.context("the pair has no primary")?;
    pair.run("kill", &[lost]).await?;
    let cut = pruning.await?;
    anyhow::ensure!(cut.is_err(), "the prune was cut by the kill: {cut:?}");
    wait_for("the standby promoted", Duration::from_secs(120), || async {
        Ok(pair.primary().await?.is_some_and(|node| node != lost))
    })
    .await?;

    // Each closed epoch whole on the promoted standby: its row and its
    // partition.
    let whole = "SELECT count(*) FROM mq_consume_epoch AS e \
                 WHERE e.epoch = ANY($1) AND to_regclass('mq_consume_record_' || e.epoch) IS NOT NULL";
    wait_for(
        "the epochs read on the promoted standby",
        Duration::from_secs(60),
        || async { Ok(env.records(GROUP).await.is_ok()) },
    )
    .await?;
    let kept: i64 = env
        .pool
        .get()
        .await?
        .query_one(whole, &[&closed.to_vec()])
        .await?
        .get(0);
    assert_eq!(kept, 2, "both closed epochs whole after the failover");
    let pruned = retention::prune(&env.pool, &config)
        .await?
        .context("another pruner held the lock")?;
    assert_eq!(pruned.dropped, closed.to_vec(), "{pruned:?}");
    let client = env.pool.get().await?;
    let left: i64 = client
        .query_one(
            "SELECT count(*) FROM mq_consume_epoch AS e WHERE e.epoch = ANY($1)",
            &[&closed.to_vec()],
        )
        .await?
        .get(0);
    let tables: i64 = client
        .query_one(
            "SELECT count(*) FROM unnest($1::int[]) AS e(epoch) \
             WHERE to_regclass('mq_consume_record_' || e.epoch) IS NOT NULL",
            &[&closed.to_vec()],
        )
        .await?
        .get(0);
    assert_eq!((left, tables), (0, 0), "the next prune removed both whole");

    pair.run("start", &[lost]).await?;
    pair.run("up", &[]).await?;
    every_credit_downstream(&env, worker, &queue, &want).await
}

/// `idem dlq VERB` on `env`'s letters against the pair, which must succeed.
async fn dlq_on_the_pair(env: &TestEnv, verb: &str) -> anyhow::Result<()> {
    let ran = crate::support::idem_command(env, &amqp_url(), &Pair::url())
        .args(["dlq", verb])
        .output()
        .await?;
    anyhow::ensure!(
        ran.status.success(),
        "dlq {verb}: {}{}",
        String::from_utf8_lossy(&ran.stdout),
        String::from_utf8_lossy(&ran.stderr)
    );
    Ok(())
}

/// A replay of dead letters through a failover: 600 letters replayed at
/// 100 a second, the primary killed once 100 are back in the work queue.
/// The replay stops with a line naming the database (or goes on, once its
/// connection finds the promoted standby), never with a panic; what it
/// had not acked is a dead letter still, and a second replay takes it;
/// `dlq sync` leaves the index empty with the queue; every event is then
/// applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a failover pair: IDEM_TEST_PG_FAILOVER, see docs/guide/development.md"]
async fn a_replay_through_a_failover_loses_no_letter_and_applies_nothing_twice()
-> anyhow::Result<()> {
    let (_alone, pair, _back) = the_pair().await?;
    let env = TestEnv::on_database_server(Pair::url()).await?;
    let events = env
        .failed_events(&["failover-a", "failover-b"], 300)
        .await?;
    let dead_letters = &env.topology.dead_letter_queue;
    let mut replay = crate::support::replay_under_way(&env, &Pair::url()).await?;
    let lost = pair.primary().await?.context("the pair has no primary")?;
    pair.run("kill", &[lost]).await?;
    let code = replay.wait(Duration::from_secs(180)).await?;
    let log = replay.log();
    anyhow::ensure!(!log.contains("panicked"), "the replay panicked:\n{log}");
    let last = log.lines().last().unwrap_or_default();
    eprintln!("the replay through the failover: exit {code:?}; its last line: {last}");
    if code != Some(0) {
        anyhow::ensure!(
            last.contains("PostgreSQL") || last.contains("database"),
            "the replay stopped with {code:?}, its last line naming no database:\n{log}"
        );
    }
    wait_for("the standby promoted", Duration::from_secs(120), || async {
        Ok(pair.primary().await?.is_some_and(|node| node != lost))
    })
    .await?;
    // What the first replay had not acked is back in the queue once the
    // broker has seen its connection go.
    wait_for(
        "the replay's letters back in the queue",
        Duration::from_secs(60),
        || async {
            let ready = env.ready(dead_letters).await?;
            Ok(u64::from(ready) == env.messages(dead_letters)?)
        },
    )
    .await?;
    dlq_on_the_pair(&env, "replay").await?;
    wait_for(
        "the dead-letter queue empty",
        Duration::from_secs(60),
        || async { Ok(env.ready(dead_letters).await? == 0 && env.messages(dead_letters)? == 0) },
    )
    .await?;
    dlq_on_the_pair(&env, "sync").await?;
    assert_eq!(
        env.count_rows("mq_dead_letter").await?,
        0,
        "the index holds what the queue holds: nothing"
    );
    pair.run("start", &[lost]).await?;
    pair.run("up", &[]).await?;
    // Nothing twice: a letter replayed by both runs is absorbed by its
    // consume record.
    let distinct = idem_points::generate::distinct_events(&events) as i64;
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_for("every event applied", Duration::from_secs(120), || async {
        Ok(records(&env).await >= distinct && env.ready(&env.topology.queue).await? == 0)
    })
    .await?;
    worker.stop().await?;
    assert_exact(&env, &events, &[]).await
}
