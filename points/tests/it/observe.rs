//! A running worker can be observed: its metrics, scraped under load, count
//! what was published; it says it is ready when it consumes and the
//! database answers, and not while it holds deliveries for the database;
//! it logs what it did at an interval and its totals when it stops.

use std::time::Duration;

use idem::worker::Mode;

use crate::proxy::Proxy;
use crate::support::{
    RunningWorker, TestEnv, WorkerProcess, amqp_url, assert_exact, database_url, free_port,
    http_get, load, sample, wait_for,
};

/// Starts a worker with `config` and its endpoints on a free port, and
/// waits until `/readyz` says it is ready.
async fn start_ready(
    mut config: idem::worker::WorkerConfig,
) -> anyhow::Result<(RunningWorker, u16)> {
    let port = free_port()?;
    config.http_addr = Some(([127, 0, 0, 1], port).into());
    let worker = RunningWorker::start(config);
    wait_for("ready", Duration::from_secs(20), || async {
        Ok(http_get(port, "/readyz")
            .await
            .is_ok_and(|(code, _)| code == 200))
    })
    .await?;
    Ok((worker, port))
}

async fn metrics_count_what_was_published_and_the_worker_is_ready(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let (worker, port) = start_ready(env.worker_config(mode)).await?;
    assert_eq!(http_get(port, "/healthz").await?.0, 200);

    let load = load(&env, 3000, 0.2, 20);
    let invalid: Vec<Vec<u8>> = (0..7)
        .map(|i| format!("not json {i}").into_bytes())
        .collect();
    env.publish_events(&load).await?;
    env.publish_bodies(&invalid).await?;
    let published = (load.len() + invalid.len()) as f64;
    // Scraped while it works, and once it is done.
    wait_for(
        "every delivery counted and acked",
        Duration::from_secs(60),
        || async {
            let (code, page) = http_get(port, "/metrics").await?;
            anyhow::ensure!(code == 200, "{code}");
            let counted: f64 = ["applied", "duplicate", "invalid"]
                .iter()
                .map(|outcome| {
                    sample(
                        &page,
                        "idem_deliveries_total",
                        &[&format!("outcome=\"{outcome}\"")],
                    )
                    .unwrap_or(0.0)
                })
                .sum();
            // The last batch is counted at its commit, and leaves the
            // in-flight gauge and the latency histogram at its ack.
            let settled = sample(&page, "idem_batches_in_flight", &[]) == Some(0.0)
                && sample(&page, "idem_end_to_end_latency_seconds_count", &[])
                    >= Some(load.len() as f64);
            Ok(counted == published && settled)
        },
    )
    .await?;
    let (_, page) = http_get(port, "/metrics").await?;
    let queue = format!("queue=\"{}\"", env.topology.queue);
    let outcome = |outcome: &str| {
        sample(
            &page,
            "idem_deliveries_total",
            &[&queue, &format!("outcome=\"{outcome}\"")],
        )
    };
    let distinct = idem_points::generate::distinct_events(&load);
    assert_eq!(outcome("applied"), Some(distinct as f64), "{page}");
    assert_eq!(outcome("duplicate"), Some((load.len() - distinct) as f64));
    assert_eq!(outcome("invalid"), Some(invalid.len() as f64));
    assert_eq!(outcome("dead_lettered"), Some(0.0));
    assert_eq!(
        sample(&page, "idem_received_deliveries_total", &[&queue]),
        Some(published)
    );
    let transactions = sample(&page, "idem_transaction_duration_seconds_count", &[]);
    assert!(transactions.is_some_and(|n| n > 0.0), "{page}");
    let measured = sample(&page, "idem_end_to_end_latency_seconds_count", &[]);
    assert_eq!(
        measured,
        Some((load.len()) as f64),
        "every acked delivery, from its timestamp"
    );
    assert_eq!(sample(&page, "idem_database_up", &[]), Some(1.0));
    assert_eq!(sample(&page, "idem_consuming", &[]), Some(1.0));
    assert_eq!(sample(&page, "idem_batches_in_flight", &[]), Some(0.0));
    assert!(sample(&page, "idem_pool_max_connections", &[]).is_some_and(|n| n > 0.0));
    assert_eq!(
        sample(&page, "idem_pool_connections", &["state=\"max\""]),
        None,
        "the limit is a gauge of its own, so that a sum over the states counts connections"
    );
    assert!(page.trim_end().ends_with("# EOF"));
    worker.stop().await?;
    assert_exact(&env, &load, &invalid).await
}

async fn the_worker_is_not_ready_while_it_holds_deliveries_for_the_database(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let database = Proxy::start(crate::support::postgres_address()).await?;
    let (worker, port) =
        start_ready(env.worker_config_via(mode, None, Some(database.port))).await?;
    database.sever();
    let load = load(&env, 200, 0.1, 5);
    env.publish_events(&load).await?;
    wait_for("not ready", Duration::from_secs(20), || async {
        Ok(http_get(port, "/readyz").await?
            == (
                503,
                "the database is unavailable: deliveries are held\n".to_owned(),
            ))
    })
    .await?;
    let (_, page) = http_get(port, "/metrics").await?;
    assert_eq!(sample(&page, "idem_database_up", &[]), Some(0.0), "{page}");
    assert!(sample(&page, "idem_database_retries_total", &[]).is_some_and(|n| n > 0.0));
    assert_eq!(
        http_get(port, "/healthz").await?.0,
        200,
        "alive all the same"
    );
    database.restore();
    wait_for("ready again", Duration::from_secs(30), || async {
        Ok(http_get(port, "/readyz").await?.0 == 200)
    })
    .await?;
    wait_for("every event", Duration::from_secs(30), || async {
        Ok(worker.stats.snapshot().finished() == load.len() as u64)
    })
    .await?;
    worker.stop().await?;
    assert_exact(&env, &load, &[]).await
}

async fn the_worker_logs_what_it_did_at_an_interval_and_its_totals_when_it_stops(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let load = load(&env, 500, 0.2, 5);
    let invalid = [b"not json".to_vec(), b"{}".to_vec(), b"[1]".to_vec()];
    env.publish_bodies(&invalid).await?;
    env.publish_events(&load).await?;
    let worker = WorkerProcess::spawn(
        &env,
        mode,
        &amqp_url(),
        &database_url(),
        &["--summary-interval", "1s"],
    )?;
    // The invalid messages are counted as such in the summaries, as in the
    // totals and the metrics, and not as dead-lettered after their attempts.
    let summed = |log: &str, what: &str| -> u64 {
        log.lines()
            .filter_map(|line| line.split("in the last 1s: ").nth(1))
            .filter_map(|summary| {
                summary
                    .split(", ")
                    .find_map(|part| part.strip_prefix(what))
                    .and_then(|n| n.split_whitespace().next()?.parse::<u64>().ok())
            })
            .sum()
    };
    wait_for(
        "the invalid ones in a summary",
        Duration::from_secs(30),
        || async { Ok(summed(&worker.log(), "invalid ") == 3) },
    )
    .await?;
    assert_eq!(
        summed(&worker.log(), "dead-lettered "),
        0,
        "{}",
        worker.log()
    );
    wait_for("every event", Duration::from_secs(30), || async {
        Ok(env.records(crate::support::GROUP).await?
            == idem_points::generate::distinct_events(&load) as i64)
    })
    .await?;
    let log = worker.stop().await?;
    let distinct = idem_points::generate::distinct_events(&load);
    assert!(
        log.contains(&format!(
            "worker stopped: applied {distinct}, duplicates {}, invalid 3, retried 0, dead-lettered 0",
            load.len() - distinct
        )),
        "{log}"
    );
    Ok(())
}

in_both_modes!(
    metrics_count_what_was_published_and_the_worker_is_ready,
    the_worker_is_not_ready_while_it_holds_deliveries_for_the_database,
    the_worker_logs_what_it_did_at_an_interval_and_its_totals_when_it_stops,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_queues_records_ledger_and_dead_letters_at_a_glance() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    // A wait long enough to see the failing message in its wait queue.
    let topology = idem::broker::Topology {
        retry: idem::RetryPolicy::default().with_delays(vec![Duration::from_secs(60)]),
        ..env.topology.clone()
    };
    env.declare(&topology).await?;
    let load = load(&env, 100, 0.1, 5);
    let poison = idem_points::points::PaymentSucceeded {
        event_id: format!("{}-poison", env.name),
        order_id: "poison-order".into(),
        points: 1,
    };
    env.publish_events(&load).await?;
    env.publish_events(std::slice::from_ref(&poison)).await?;
    env.publish_bodies(&[b"not json".to_vec(), b"nor this".to_vec()])
        .await?;
    let mut config = env.worker_config(Mode::Batch);
    config.topology = topology.clone();
    let worker = RunningWorker::start(config);
    let wait_queue = topology.wait_queue(Duration::from_secs(60));
    // The worker holds the waiting message until it is due, and gives it
    // back to its wait queue when it stops.
    wait_for(
        "the poison message waiting",
        Duration::from_secs(30),
        || async {
            Ok(env.messages(&wait_queue)? == 1
                && env.consumers(&wait_queue).await? == 1
                && env.ready(&env.topology.dead_letter_queue).await? == 2)
        },
    )
    .await?;
    worker.stop().await?;
    wait_for(
        "the poison message given back to its wait queue",
        Duration::from_secs(10),
        || async { Ok(env.ready(&wait_queue).await? == 1) },
    )
    .await?;

    let output = crate::support::idem_command(&env, &amqp_url(), &database_url())
        .args(["status", "--retry-delays", "60s"])
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let row = |queue: &str| {
        stdout
            .lines()
            .find(|line| line.split_whitespace().next() == Some(queue))
            .map(|line| {
                line.split_whitespace()
                    .skip(1)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
    };
    assert_eq!(row(&env.topology.queue).as_deref(), Some("0 0"), "{stdout}");
    assert_eq!(row(&wait_queue).as_deref(), Some("1 0"), "{stdout}");
    assert_eq!(
        row(&env.topology.dead_letter_queue).as_deref(),
        Some("2 0"),
        "{stdout}"
    );
    let distinct = idem_points::generate::distinct_events(&load);
    assert!(
        stdout.contains(&format!("consume records    {distinct} (oldest 20")),
        "{stdout}"
    );
    assert!(
        stdout.contains("database           no standby streams from the server"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "epochs             1 (0 closed with a filter; the current one has handed out about "
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("failure ledger     1 event(s) failing"),
        "{stdout}"
    );
    assert!(stdout.contains("dead letters       rejected 2"), "{stdout}");
    Ok(())
}
