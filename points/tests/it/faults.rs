//! Real faults, injected: killed workers, severed connections, a database
//! that goes away. After each, every order holds exactly what was published,
//! each distinct event has one consume record, and the dead-letter queue
//! holds exactly what it should.
//!
//! Over 700 lines: one scenario per test, every fault of the worker's in one
//! place.

use std::time::Duration;

use idem_points::points::PaymentSucceeded;

use crate::proxy::Proxy;
use crate::support::{
    GROUP, RunningWorker, TestEnv, WorkerProcess, admin, amqp_address, amqp_host_port, amqp_url,
    amqp_url_at, amqp_user, assert_exact, database_url, free_port, load, patient, postgres_address,
    postgres_host_port, run_idem, wait_for,
};
use idem::worker::Mode;

/// Messages for a load that lasts while faults are injected: batch mode
/// goes through a load several times faster than per-message mode.
fn sized(mode: Mode, per_message: usize) -> usize {
    match mode {
        Mode::PerMessage => per_message,
        Mode::Batch => per_message * 5,
    }
}

/// Waits until `n` consume records exist.
async fn wait_records(env: &TestEnv, n: i64, timeout: Duration) -> anyhow::Result<()> {
    wait_for(&format!("{n} consume records"), timeout, || async {
        Ok(env.records(GROUP).await? >= n)
    })
    .await
}

/// Waits until every distinct event of `load` is recorded and the work queue
/// is empty.
async fn wait_applied(
    env: &TestEnv,
    load: &[PaymentSucceeded],
    timeout: Duration,
) -> anyhow::Result<()> {
    let distinct = idem_points::generate::distinct_events(load) as i64;
    wait_records(env, distinct, timeout).await?;
    wait_for("the work queue to drain", timeout, || async {
        Ok(env.ready(&env.topology.queue).await? == 0)
    })
    .await
}

async fn killing_a_worker_mid_load_loses_nothing_and_applies_nothing_twice(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let load = load(&env, 5000, 0.2, 50);
    env.publish_events(&load).await?;

    let mut first = WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &[])?;
    wait_records(&env, 500, Duration::from_secs(60)).await?;
    first.kill().await?;
    let at_kill = env.records(GROUP).await?;
    assert!(
        at_kill < idem_points::generate::distinct_events(&load) as i64,
        "killed after the end"
    );

    let second = WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &[])?;
    wait_applied(&env, &load, Duration::from_secs(90)).await?;
    second.stop().await?;
    assert_exact(&env, &load, &[]).await
}

async fn severing_the_broker_connection_three_times_loses_nothing(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let broker = Proxy::start(amqp_address()).await?;
    let load = load(&env, sized(mode, 4000), 0.2, 40);
    env.publish_events(&load).await?;
    let step = (load.len() / 5) as i64;

    let worker = RunningWorker::start(env.worker_config_via(mode, Some(broker.port), None));
    for cut in 1..=3u64 {
        wait_records(&env, step * cut as i64, Duration::from_secs(60)).await?;
        broker.sever();
        wait_for("the worker to notice", Duration::from_secs(20), || async {
            Ok(worker.stats.snapshot().reconnects >= cut)
        })
        .await?;
        broker.restore();
        wait_for(
            "the worker to consume again",
            Duration::from_secs(20),
            || async { Ok(worker.stats.snapshot().sessions > cut) },
        )
        .await?;
    }
    wait_applied(&env, &load, Duration::from_secs(90)).await?;
    let stats = worker.stop().await?;
    assert_eq!(
        stats.reconnects, 3,
        "recovered by itself each time: {stats:?}"
    );
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0));
    assert_exact(&env, &load, &[]).await
}

async fn a_thirty_second_database_outage_dead_letters_nothing_and_the_worker_resumes(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let database = Proxy::start(postgres_address()).await?;
    let load = load(&env, sized(mode, 3000), 0.2, 30);
    env.publish_events(&load).await?;

    let worker = RunningWorker::start(env.worker_config_via(mode, None, Some(database.port)));
    wait_records(&env, (load.len() / 6) as i64, Duration::from_secs(60)).await?;
    database.sever();
    wait_for("the worker to notice", Duration::from_secs(20), || async {
        Ok(worker.stats.snapshot().infrastructure_retries > 0)
    })
    .await?;
    // A commit PostgreSQL received before the cut still completes; the
    // worker's sessions end once theirs is done and they find the socket closed.
    wait_for(
        "the worker's severed sessions to end",
        Duration::from_secs(20),
        || async { Ok(env.sessions_named(&env.name).await? == 0) },
    )
    .await?;
    let during = env.records(GROUP).await?;
    // The outage itself is what is under test: thirty seconds of it.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let stats = worker.stats.snapshot();
    assert_eq!(
        env.records(GROUP).await?,
        during,
        "nothing can commit during the outage"
    );
    assert_eq!(
        env.ready(&env.topology.dead_letter_queue).await?,
        0,
        "nothing dead-lettered"
    );
    assert!(
        stats.infrastructure_retries > 0,
        "the worker kept retrying: {stats:?}"
    );
    database.restore();

    wait_applied(&env, &load, Duration::from_secs(90)).await?;
    let stats = worker.stop().await?;
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "{stats:?}");
    assert_exact(&env, &load, &[]).await
}

async fn terminating_the_workers_database_sessions_loses_nothing(mode: Mode) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // Through a proxy only to give the sessions this test's application_name.
    let database = Proxy::start(postgres_address()).await?;
    let load = load(&env, sized(mode, 3000), 0.2, 30);
    env.publish_events(&load).await?;
    let step = (load.len() / 8) as i64;

    let worker = RunningWorker::start(env.worker_config_via(mode, None, Some(database.port)));
    let mut terminated = 0;
    for round in 1..=5 {
        wait_records(&env, step * round, Duration::from_secs(60)).await?;
        let client = env.pool.get().await?;
        terminated += client
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&env.name],
            )
            .await?
            .len();
    }
    wait_applied(&env, &load, Duration::from_secs(90)).await?;
    let stats = worker.stop().await?;
    assert!(terminated >= 5, "sessions were terminated: {terminated}");
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "{stats:?}");
    assert_exact(&env, &load, &[]).await
}

async fn a_poison_message_is_dead_lettered_after_exactly_its_attempts_though_workers_are_killed(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    let mut messages = load(&env, 2000, 0.1, 20);
    let poison = PaymentSucceeded {
        event_id: format!("{}-poison", env.name),
        order_id: "poison-order".into(),
        points: 1,
    };
    messages.insert(700, poison.clone());
    env.publish_events(&messages).await?;
    let good: Vec<PaymentSucceeded> = messages.iter().filter(|e| **e != poison).cloned().collect();

    for kill_at in [400, 1000] {
        let mut worker = WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &[])?;
        wait_records(&env, kill_at, Duration::from_secs(60)).await?;
        worker.kill().await?;
    }
    let worker = WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &[])?;
    wait_applied(&env, &good, Duration::from_secs(90)).await?;
    wait_for(
        "the poison message in the dead-letter queue",
        Duration::from_secs(30),
        || async { Ok(env.ready(&env.topology.dead_letter_queue).await? == 1) },
    )
    .await?;
    worker.stop().await?;
    assert_exact(&env, &good, &[poison.to_body()]).await?;

    let client = env.pool.get().await?;
    let row = client
        .query_one(
            "SELECT failures, last_error FROM mq_failure_ledger WHERE event_id = $1",
            &[&poison.event_id],
        )
        .await?;
    let (failures, last_error): (i32, String) = (row.get(0), row.get(1));
    assert_eq!(
        failures, 5,
        "dead-lettered after exactly the configured attempts"
    );
    assert!(last_error.contains("poisoned"), "{last_error}");
    // A kill can land between a failed transaction and its count: that
    // attempt ran but is not counted, so the trigger may have run once more
    // per kill, never less than the budget.
    // In batch mode each batch the message arrived in also ran it once,
    // uncounted, before falling back to one by one.
    let ran = env.poisoned_attempts().await?;
    let most = match mode {
        Mode::PerMessage => 7,
        Mode::Batch => 2 * 5 + 2,
    };
    assert!(
        (5..=most).contains(&ran),
        "the failing transaction ran {ran} times"
    );

    let listing = crate::support::idem_command(&env, &amqp_url(), &database_url())
        .args(["requeue", "--dry-run"])
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&listing.stdout);
    assert!(listing.status.success(), "{stdout}");
    assert!(stdout.contains(&poison.event_id), "{stdout}");
    assert!(
        stdout.contains("failed 5 time(s), last error: order poison-order is poisoned"),
        "{stdout}"
    );
    assert_eq!(
        env.ready(&env.topology.dead_letter_queue).await?,
        1,
        "a dry run moves nothing"
    );
    Ok(())
}

async fn three_workers_killed_and_restarted_at_random_apply_twenty_thousand_events_exactly(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let load = load(&env, 20_000, 0.2, 200);
    env.publish_events(&load).await?;
    let distinct = idem_points::generate::distinct_events(&load) as i64;

    let mut workers: Vec<WorkerProcess> = (0..3)
        .map(|_| WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &[]))
        .collect::<anyhow::Result<_>>()?;
    let mut kills = 0;
    let mut next = distinct / 8;
    while next < distinct * 7 / 8 {
        wait_records(&env, next, Duration::from_secs(90)).await?;
        let victim = fastrand::usize(..workers.len());
        workers[victim].kill().await?;
        workers[victim] = WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &[])?;
        kills += 1;
        next += distinct / 8 + fastrand::i64(0..distinct / 16);
    }
    wait_applied(&env, &load, Duration::from_secs(120)).await?;
    for worker in workers {
        worker.stop().await?;
    }
    assert!(kills >= 4, "{kills} kills");
    assert_exact(&env, &load, &[]).await
}

async fn a_worker_started_before_its_services_answer_connects_once_they_do(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let broker = Proxy::start_closed(amqp_address()).await?;
    let database = Proxy::start_closed(postgres_address()).await?;
    let worker =
        RunningWorker::start(env.worker_config_via(mode, Some(broker.port), Some(database.port)));

    // The worker keeps trying each service while it is down (PostgreSQL
    // first: it waits for the database before the broker).
    wait_for(
        "attempts on PostgreSQL",
        Duration::from_secs(20),
        || async { Ok(database.turned_away() >= 3) },
    )
    .await?;
    assert_eq!(
        broker.turned_away(),
        0,
        "the broker is tried after the database answers"
    );
    database.restore();
    wait_for("attempts on RabbitMQ", Duration::from_secs(20), || async {
        Ok(broker.turned_away() >= 3)
    })
    .await?;
    broker.restore();

    let load = load(&env, 200, 0.2, 5);
    env.publish_events(&load).await?;
    wait_applied(&env, &load, Duration::from_secs(30)).await?;
    worker.stop().await?;
    assert_exact(&env, &load, &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_cut_off_mid_way_resends_what_was_not_confirmed() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let broker = Proxy::start(amqp_address()).await?;
    let load = load(&env, 20_000, 0.1, 100);
    let messages: Vec<idem::broker::Outgoing> = load
        .iter()
        .map(|event| env.topology.event(event.to_body()))
        .collect();
    let amqp =
        idem::broker::AmqpConfig::new(idem::secret::SecretUrl::new(env.amqp_url_via(broker.port)));
    let options = idem::broker::PublishOptions {
        window: 256,
        patience: patient(Duration::from_secs(20)),
    };
    let publishing = tokio::spawn(async move {
        idem::broker::publish_all(
            &amqp,
            &messages,
            &options,
            &tokio_util::sync::CancellationToken::new(),
        )
        .await
    });
    wait_for(
        "publishing to be under way",
        Duration::from_secs(30),
        || async { Ok(env.ready(&env.topology.queue).await? >= 4000) },
    )
    .await?;
    broker.cut();
    let report = publishing.await??;
    assert!(report.reconnects >= 1, "{report:?}");
    assert!(report.all_confirmed(), "{report:?}");
    assert_eq!(report.confirmed, load.len());
    // At least everything arrived; what was resent may have arrived twice.
    let queued = env.ready(&env.topology.queue).await? as usize;
    assert!(
        (load.len()..=load.len() + report.resent).contains(&queued),
        "{queued} queued, {report:?}"
    );

    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_applied(&env, &load, Duration::from_secs(90)).await?;
    worker.stop().await?;
    assert_exact(&env, &load, &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_requeue_cut_off_mid_way_loses_no_dead_letter() -> anyhow::Result<()> {
    requeue_cut_off_mid_way(Proxy::cut).await
}

/// The broker gives back what a lost connection held only once it notices
/// the loss (at once when the socket closes; after a missed heartbeat when
/// the network went): the replay, on its new connection, waits for those
/// letters instead of ending without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_requeue_whose_lost_connection_the_broker_notices_late_loses_no_dead_letter()
-> anyhow::Result<()> {
    requeue_cut_off_mid_way(|broker| broker.cut_noticed_late(Duration::from_secs(3))).await
}

/// Dead-letters 800 invalid messages, replays them all through a proxy of
/// the broker that `cut` cuts mid-way, and checks that every one is back in
/// the work queue and none is left.
async fn requeue_cut_off_mid_way(cut: impl FnOnce(&Proxy)) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let bodies: Vec<Vec<u8>> = (0..800)
        .map(|i| format!("invalid message {i}").into_bytes())
        .collect();
    env.publish_bodies(&bodies).await?;
    // The worker runs until every copy is in the dead-letter queue: under
    // load the broker may hold back its rejections past the worker's
    // shutdown deadline, and those come back to the work queue. (Dead-lettering
    // is at least once: a copy may even arrive twice.)
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    let waited = wait_for("the dead letters", Duration::from_secs(90), || async {
        Ok(env.ready(&env.topology.dead_letter_queue).await? as usize >= bodies.len())
    })
    .await;
    if let Err(error) = waited {
        let (dead, work) = (
            env.ready(&env.topology.dead_letter_queue).await?,
            env.ready(&env.topology.queue).await?,
        );
        return Err(error.context(format!("{dead} dead-lettered, {work} in the work queue")));
    }
    worker.stop().await?;

    // Paced (two seconds for the 800), so that the cut lands while the
    // replay is under way: unpaced, a quick one could end between the wait
    // for the first 300 and the cut.
    let replay_all = idem::dlq::Action::Replay {
        rate: Some(400.0),
        include_invalid: true,
    };
    let report =
        replay_cut_off_mid_way(&env, idem::dlq::Filter::default(), replay_all, 300, cut).await?;
    // A replay confirmed but whose ack the cut lost is replayed again.
    assert!(
        report.replayed.len() >= 800,
        "{} replayed",
        report.replayed.len()
    );
    assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 0);

    // Every dead letter is back in its work queue, some perhaps twice.
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    let mut replayed = Vec::new();
    while let Some(message) = channel
        .basic_get(
            env.topology.queue.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await?
    {
        replayed.push(message.delivery.data);
    }
    channel.close(200, "OK".into()).await?;
    connection.close(200, "OK".into()).await?;
    replayed.sort();
    replayed.dedup();
    let mut expected = bodies;
    expected.sort();
    assert_eq!(replayed, expected);
    Ok(())
}

/// Runs `action` on `env`'s dead letters that match `filter`, through a
/// proxy of the broker whose connections `cut` cuts once `under_way`
/// messages are ready in the work queue; the run must connect again once
/// and end well. Returns its report.
async fn replay_cut_off_mid_way(
    env: &TestEnv,
    filter: idem::dlq::Filter,
    action: idem::dlq::Action,
    under_way: u32,
    cut: impl FnOnce(&Proxy),
) -> anyhow::Result<idem::dlq::Report> {
    let broker = Proxy::start(amqp_address()).await?;
    let mut config = env.dlq_config();
    config.target.amqp =
        idem::broker::AmqpConfig::new(idem::secret::SecretUrl::new(env.amqp_url_via(broker.port)));
    config.filter = filter;
    config.target.patience = patient(Duration::from_secs(20));
    let replaying = tokio::spawn(async move {
        let never = tokio_util::sync::CancellationToken::new();
        idem::dlq::run(&config, &action, &idem_points::points::Points, &never).await
    });
    wait_for(
        "replaying to be under way",
        Duration::from_secs(30),
        || async { Ok(env.ready(&env.topology.queue).await? >= under_way) },
    )
    .await?;
    cut(&broker);
    let report = replaying.await??;
    assert!(report.succeeded(), "{report:?}");
    assert_eq!(report.reconnects, 1, "the cut landed mid-way");
    Ok(report)
}

/// A filtered replay whose connection is cut mid-way connects again and
/// goes on; it ends with the dead-letter queue holding exactly the letters
/// that did not match, once each, and the work queue every one that did.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_filtered_replay_cut_off_mid_way_leaves_exactly_the_letters_it_did_not_replay()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let events = env
        .failed_events(&["cut-kept", "cut-replayed"], 400)
        .await?;
    let ids = |events: &mut dyn Iterator<Item = String>| {
        let mut ids: Vec<String> = events.collect();
        ids.sort();
        ids
    };
    let of_order = |order: &str| {
        ids(&mut events
            .iter()
            .filter(|event| event.order_id == order)
            .map(|event| event.event_id.clone()))
    };
    let (kept, replayed) = (of_order("cut-kept"), of_order("cut-replayed"));

    let filter = idem::dlq::Filter {
        error: Some("order cut-replayed failed".into()),
        ..idem::dlq::Filter::default()
    };
    // Paced (four seconds for the 400 that match) so that the cut, once
    // 100 are in the work queue, lands before the replay ends on a loaded
    // machine too: at twice the rate the margin was a second and a half.
    let replay = idem::dlq::Action::Replay {
        rate: Some(100.0),
        include_invalid: false,
    };
    let report = replay_cut_off_mid_way(&env, filter, replay, 100, Proxy::cut).await?;

    // The broker's statistics lag seconds behind: the queue is read once
    // they agree with its own count of ready letters.
    let dead_letters = &env.topology.dead_letter_queue;
    let agreed = wait_for(
        "the dead-letter queue's statistics to agree with it",
        Duration::from_secs(30),
        || async {
            let ready = u64::from(env.ready(dead_letters).await?);
            Ok(ready == env.messages(dead_letters)? && ready == kept.len() as u64)
        },
    )
    .await;
    if let Err(error) = agreed {
        let left: Vec<String> = env
            .dead_letters()
            .await?
            .iter()
            .filter_map(|letter| PaymentSucceeded::parse(&letter.body).ok())
            .map(|event| event.event_id)
            .filter(|id| !kept.contains(id))
            .collect();
        return Err(error.context(format!(
            "{} ready, {} in all, {} kept; seen {}, replayed {} ({} distinct), failed {:?}, \
             moved {}, nacks {}, stopped {:?}; matching letters left: {left:?}",
            env.ready(dead_letters).await?,
            env.messages(dead_letters)?,
            kept.len(),
            report.seen,
            report.replayed.len(),
            report
                .replayed
                .iter()
                .map(|entry| &entry.key)
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            report.failed,
            report.moved_to_tail,
            report.nacks_retried,
            report.stopped_early,
        )));
    }
    let event_ids = |letters: Vec<crate::support::DeadLetter>| {
        let parsed: Result<Vec<String>, _> = letters
            .iter()
            .map(|letter| PaymentSucceeded::parse(&letter.body).map(|event| event.event_id))
            .collect();
        anyhow::Ok(ids(&mut parsed?.into_iter()))
    };
    assert_eq!(event_ids(env.dead_letters().await?)?, kept);
    // A replay confirmed but whose ack the cut lost went again: the work
    // queue may hold it twice, which its consume record absorbs.
    let mut work = event_ids(env.peek(&env.topology.queue).await?)?;
    work.dedup();
    assert_eq!(work, replayed);
    assert_eq!(
        env.count_rows("mq_dead_letter").await?,
        kept.len() as i64,
        "the index holds the letters left, and only those"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_killed_mid_way_loses_nothing_and_applies_nothing_twice() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let events = env.failed_events(&["killed-a", "killed-b"], 300).await?;
    let mut replay = crate::support::replay_under_way(&env, &database_url()).await?;
    replay.kill().await?;
    let replayed = u64::from(env.ready(&env.topology.queue).await?);
    assert!(
        replayed < events.len() as u64,
        "killed mid-way, not after {replayed} replays; its log:\n{}",
        replay.log()
    );
    // Nothing lost: what the killed replay had not acked is a dead letter
    // still (some perhaps replayed too), ready again once the broker has
    // seen its connection go, and a second replay takes it.
    let dead_letters = &env.topology.dead_letter_queue;
    wait_for(
        "the killed replay's letters back in the queue",
        Duration::from_secs(60),
        || async {
            // Ready letters the statistics (seconds behind) count too: the
            // consumer that held them is gone.
            let ready = env.ready(dead_letters).await?;
            Ok(ready > 0 && u64::from(ready) == env.messages(dead_letters)?)
        },
    )
    .await?;
    let again = run_idem(&env, &["dlq", "replay"]).await?;
    assert_eq!(again.code, Some(0), "{}{}", again.stdout, again.stderr);
    // The broker's queue statistics lag behind by seconds: the count of
    // what is left is read once they agree with the queue's own count.
    wait_for(
        "the dead-letter queue empty",
        Duration::from_secs(60),
        || async { Ok(env.ready(dead_letters).await? == 0 && env.messages(dead_letters)? == 0) },
    )
    .await?;
    // Nothing twice: a letter replayed by both runs is absorbed by its
    // consume record.
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_applied(&env, &events, Duration::from_secs(60)).await?;
    worker.stop().await?;
    assert_exact(&env, &events, &[]).await
}

/// What the worker is doing when the broker goes too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum During {
    /// Holding deliveries it cannot commit.
    Holding,
    /// Consuming, with nothing to do.
    Idle,
}

/// Which service comes back first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FirstBack {
    Database,
    Broker,
}

/// The database goes, then the broker; both come back, in the given
/// order. The worker must resume by itself: when the broker went, the
/// batches holding for the database went with it, and nothing else would
/// have lifted their hold.
async fn a_broker_loss_during_a_database_outage(
    mode: Mode,
    during: During,
    first_back: FirstBack,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let broker = Proxy::start(amqp_address()).await?;
    let database = Proxy::start(postgres_address()).await?;
    let load = load(&env, sized(mode, 1000), 0.2, 20);
    let worker =
        RunningWorker::start(env.worker_config_via(mode, Some(broker.port), Some(database.port)));
    let (before, after) = load.split_at(load.len() / 2);
    match during {
        During::Holding => {
            env.publish_events(before).await?;
            wait_records(&env, (before.len() / 5) as i64, Duration::from_secs(60)).await?;
            database.sever();
            // The rest goes out once the database is gone, so that the
            // worker holds some of it however fast it went through the first.
            env.publish_events(after).await?;
            wait_for(
                "the worker to hold its deliveries",
                Duration::from_secs(20),
                || async { Ok(worker.stats.snapshot().infrastructure_retries > 0) },
            )
            .await?;
        }
        During::Idle => {
            wait_for("the worker to consume", Duration::from_secs(20), || async {
                Ok(worker.stats.snapshot().sessions >= 1)
            })
            .await?;
            database.sever();
        }
    }
    broker.sever();
    wait_for(
        "the worker to lose the broker",
        Duration::from_secs(20),
        || async { Ok(worker.stats.snapshot().reconnects >= 1) },
    )
    .await?;
    match first_back {
        FirstBack::Database => {
            database.restore();
            broker.restore();
        }
        FirstBack::Broker => {
            broker.restore();
            wait_for(
                "the worker to consume again, without the database",
                Duration::from_secs(30),
                || async { Ok(worker.stats.snapshot().sessions >= 2) },
            )
            .await?;
            database.restore();
        }
    }
    if during == During::Idle {
        env.publish_events(&load).await?;
    }
    wait_applied(&env, &load, Duration::from_secs(90)).await?;
    let stats = worker.stop().await?;
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "{stats:?}");
    assert_exact(&env, &load, &[]).await
}

async fn a_broker_lost_while_holding_for_the_database_resumes_when_the_database_comes_back_first(
    mode: Mode,
) -> anyhow::Result<()> {
    a_broker_loss_during_a_database_outage(mode, During::Holding, FirstBack::Database).await
}

async fn a_broker_lost_while_holding_for_the_database_resumes_when_the_broker_comes_back_first(
    mode: Mode,
) -> anyhow::Result<()> {
    a_broker_loss_during_a_database_outage(mode, During::Holding, FirstBack::Broker).await
}

async fn a_broker_lost_while_idle_in_a_database_outage_resumes_when_the_database_comes_back_first(
    mode: Mode,
) -> anyhow::Result<()> {
    a_broker_loss_during_a_database_outage(mode, During::Idle, FirstBack::Database).await
}

async fn a_broker_lost_while_idle_in_a_database_outage_resumes_when_the_broker_comes_back_first(
    mode: Mode,
) -> anyhow::Result<()> {
    a_broker_loss_during_a_database_outage(mode, During::Idle, FirstBack::Broker).await
}

/// PostgreSQL refusing new connections to a database answers SQLSTATE
/// 55000, which is no connection class: an error while connecting must
/// still never count against a message.
async fn a_database_refusing_new_connections_holds_deliveries_and_dead_letters_nothing(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::in_own_database().await?;
    let load = load(&env, sized(mode, 2000), 0.2, 20);
    let (before, after) = load.split_at(load.len() / 2);
    env.publish_events(before).await?;
    let worker = RunningWorker::start(env.worker_config(mode));
    wait_records(&env, (before.len() / 5) as i64, Duration::from_secs(60)).await?;
    let admin = admin().await?;
    let name = env.database_name();
    admin
        .batch_execute(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false"))
        .await?;
    // Sessions already open go on working: end them, so that the worker
    // must connect anew.
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&name],
        )
        .await?;
    // The rest goes out now, so that the worker has work to hold however
    // fast it went through the first half.
    let retries = worker.stats.snapshot().infrastructure_retries;
    env.publish_events(after).await?;
    wait_for(
        "the worker to keep trying to connect",
        Duration::from_secs(30),
        || async { Ok(worker.stats.snapshot().infrastructure_retries >= retries + 5) },
    )
    .await?;
    let stats = worker.stats.snapshot();
    let dead = env.ready(&env.topology.dead_letter_queue).await?;
    admin
        .batch_execute(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
        .await?;
    assert_eq!(
        (stats.retried, stats.dead_lettered),
        (0, 0),
        "nothing returned or dead-lettered while refused: {stats:?}"
    );
    assert_eq!(dead, 0, "nothing dead-lettered");

    wait_applied(&env, &load, Duration::from_secs(90)).await?;
    let stats = worker.stop().await?;
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "{stats:?}");
    assert_exact(&env, &load, &[]).await
}

/// A failure is counted in the ledger before the message goes back: when
/// the ledger will not take it, the message has not used an attempt, so
/// it is held as in an outage. Returned uncounted, it would come back at
/// once, again and again, until the broker's delivery limit dead-lettered
/// a message that idem never gave up on.
async fn a_failure_the_ledger_cannot_take_holds_its_delivery_instead_of_returning_it(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    env.sql(
        "CREATE FUNCTION ledger_refuses() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'the ledger takes nothing today'; END $$;
         CREATE TRIGGER ledger_refuses BEFORE INSERT OR UPDATE ON mq_failure_ledger
             FOR EACH ROW EXECUTE FUNCTION ledger_refuses();",
    )
    .await?;
    let poison = PaymentSucceeded {
        event_id: format!("{}-poison", env.name),
        order_id: "poison-order".into(),
        points: 1,
    };
    let good = load(&env, 300, 0.1, 5);
    let mut messages = good.clone();
    messages.insert(100, poison.clone());
    env.publish_events(&messages).await?;

    let worker = RunningWorker::start(env.worker_config(mode));
    wait_for(
        "the worker to hold the failure it cannot count",
        Duration::from_secs(30),
        || async { Ok(worker.stats.snapshot().infrastructure_retries >= 5) },
    )
    .await?;
    let stats = worker.stats.snapshot();
    assert_eq!(
        (stats.retried, stats.dead_lettered),
        (0, 0),
        "returned uncounted: {stats:?}"
    );
    assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 0);
    assert_eq!(
        env.count_rows("mq_failure_ledger").await?,
        0,
        "nothing could be counted"
    );

    env.sql("DROP TRIGGER ledger_refuses ON mq_failure_ledger")
        .await?;
    wait_applied(&env, &good, Duration::from_secs(60)).await?;
    wait_for(
        "the poison message in the dead-letter queue",
        Duration::from_secs(30),
        || async { Ok(env.ready(&env.topology.dead_letter_queue).await? == 1) },
    )
    .await?;
    let stats = worker.stop().await?;
    assert_eq!((stats.retried, stats.dead_lettered), (4, 1), "{stats:?}");
    assert_exact(&env, &good, &[poison.to_body()]).await?;
    let letters = env.dead_letters().await?;
    let death = letters[0]
        .death()
        .ok_or_else(|| anyhow::anyhow!("no record of its death"))?;
    assert_eq!(
        death.reason, "rejected",
        "dead-lettered by idem after its attempts, not by the broker's limit"
    );
    let client = env.pool.get().await?;
    let failures: i32 = client
        .query_one(
            "SELECT failures FROM mq_failure_ledger WHERE event_id = $1",
            &[&poison.event_id],
        )
        .await?
        .get(0);
    assert_eq!(failures, 5);
    Ok(())
}

in_both_modes!(
    killing_a_worker_mid_load_loses_nothing_and_applies_nothing_twice,
    severing_the_broker_connection_three_times_loses_nothing,
    a_thirty_second_database_outage_dead_letters_nothing_and_the_worker_resumes,
    terminating_the_workers_database_sessions_loses_nothing,
    a_poison_message_is_dead_lettered_after_exactly_its_attempts_though_workers_are_killed,
    three_workers_killed_and_restarted_at_random_apply_twenty_thousand_events_exactly,
    a_worker_started_before_its_services_answer_connects_once_they_do,
    a_broker_lost_while_holding_for_the_database_resumes_when_the_database_comes_back_first,
    a_broker_lost_while_holding_for_the_database_resumes_when_the_broker_comes_back_first,
    a_broker_lost_while_idle_in_a_database_outage_resumes_when_the_database_comes_back_first,
    a_broker_lost_while_idle_in_a_database_outage_resumes_when_the_broker_comes_back_first,
    a_database_refusing_new_connections_holds_deliveries_and_dead_letters_nothing,
    a_failure_the_ledger_cannot_take_holds_its_delivery_instead_of_returning_it,
);

/// A PostgreSQL server of the test's own (`pg_createcluster`), trusting
/// local connections, for a test that crashes it; dropped with it.
pub(crate) struct OwnServer {
    version: String,
    name: String,
    port: u16,
}

impl OwnServer {
    pub(crate) fn start() -> anyhow::Result<Self> {
        let version = std::fs::read_dir("/etc/postgresql")?
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .max_by_key(|version| version.parse::<u32>().unwrap_or(0))
            .ok_or_else(|| anyhow::anyhow!("no PostgreSQL version in /etc/postgresql"))?;
        let server = Self {
            version,
            name: crate::support::unique_name(),
            port: free_port()?,
        };
        let port = server.port.to_string();
        run(std::process::Command::new("pg_createcluster")
            .args([&server.version, &server.name, "--port", &port])
            .args(["--", "--auth=trust"]))?;
        server.ctl(&["start"])?;
        Ok(server)
    }

    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops it as a crash would (`-m immediate`: no checkpoint, what was
    /// not flushed is lost), then starts it again.
    pub(crate) fn crash_and_restart(&self) -> anyhow::Result<()> {
        self.ctl(&["stop", "-m", "immediate"])?;
        self.ctl(&["start"])
    }

    fn ctl(&self, args: &[&str]) -> anyhow::Result<()> {
        run(std::process::Command::new("pg_ctlcluster")
            .args(["--skip-systemctl-redirect", &self.version, &self.name])
            .args(args))
    }
}

/// Runs `command`; its stderr is the error when it fails.
fn run(command: &mut std::process::Command) -> anyhow::Result<()> {
    let output = command.output()?;
    anyhow::ensure!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = std::process::Command::new("pg_dropcluster")
            .args(["--stop", &self.version, &self.name])
            .output();
    }
}

/// Per-message mode commits its claims without waiting for their flush
/// and acks them once a flush found their records: a server that crashes
/// loses what it had not flushed, and those claims run again. Nothing it
/// acked is lost, nothing is applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_server_crash_loses_nothing_the_worker_acked() -> anyhow::Result<()> {
    let server = OwnServer::start()?;
    let env = TestEnv::on_database_server(server.url()).await?;
    let load = load(&env, 8000, 0.1, 50);
    env.publish_events(&load).await?;
    let config = env.worker_config(Mode::PerMessage);
    assert!(config.lanes > 0, "claims commit unflushed by default");
    let worker = RunningWorker::start(config);
    // The test's own sessions end with each crash too: a count that fails
    // is not there yet.
    let distinct = idem_points::generate::distinct_events(&load) as i64;
    for n in [2000, 4000, distinct] {
        wait_for(
            &format!("{n} consume records"),
            Duration::from_secs(120),
            || async { Ok(env.records(GROUP).await.unwrap_or(0) >= n) },
        )
        .await?;
        if n < distinct {
            server.crash_and_restart()?;
        }
    }
    wait_for(
        "the work queue to drain",
        Duration::from_secs(60),
        || async { Ok(env.ready(&env.topology.queue).await? == 0) },
    )
    .await?;
    let stats = worker.stop().await?;
    assert!(
        stats.infrastructure_retries > 0,
        "it saw the crashes: {stats:?}"
    );
    assert!(
        stats.unconfirmed > 0,
        "claims waiting for a flush at a crash ran again: {stats:?}"
    );
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "{stats:?}");
    assert_exact(&env, &load, &[]).await
}

/// A role the server does not let call the flush's function: the worker
/// says so once, and its per-message claims each wait for their own flush,
/// every event applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_that_refuses_the_flush_gets_a_flush_per_transaction() -> anyhow::Result<()> {
    let server = OwnServer::start()?;
    let env = TestEnv::on_database_server(server.url()).await?;
    let schema = &env.schema;
    env.sql(&format!(
        "CREATE ROLE plain LOGIN;
         GRANT USAGE, CREATE ON SCHEMA {schema} TO plain;
         GRANT ALL ON ALL TABLES IN SCHEMA {schema} TO plain;
         GRANT ALL ON ALL SEQUENCES IN SCHEMA {schema} TO plain;
         REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) FROM PUBLIC;
         REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, bytea) FROM PUBLIC;"
    ))
    .await?;
    let load = load(&env, 2000, 0.1, 20);
    env.publish_events(&load).await?;
    let plain = server
        .url()
        .replace("postgres://postgres@", "postgres://plain@");
    let worker = WorkerProcess::spawn(&env, Mode::PerMessage, &amqp_url(), &plain, &[])?;
    let distinct = idem_points::generate::distinct_events(&load) as i64;
    wait_records(&env, distinct, Duration::from_secs(60)).await?;
    wait_for(
        "the work queue to drain",
        Duration::from_secs(60),
        || async { Ok(env.ready(&env.topology.queue).await? == 0) },
    )
    .await?;
    let log = worker.stop().await?;
    let refused: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("the server refused idem's flush"))
        .collect();
    assert_eq!(refused.len(), 1, "said once: {log}");
    assert!(refused[0].contains("permission denied"), "{log}");
    assert_exact(&env, &load, &[]).await
}

/// Several PostgreSQL hosts and several RabbitMQ nodes, the first of each
/// down: the worker connects to the next (for PostgreSQL, the next that
/// accepts writes) and applies the load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_first_database_host_and_broker_node_down_the_worker_uses_the_next()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let down = free_port()?;
    let server = postgres_host_port();
    let mut database = database_url().replacen(&server, &format!("127.0.0.1:{down},{server}"), 1);
    database.push(if database.contains('?') { '&' } else { '?' });
    database.push_str("target_session_attrs=read-write");
    let broker = format!("{},{}", amqp_url_at(down), amqp_url());
    let worker = WorkerProcess::spawn(&env, Mode::Batch, &broker, &database, &[])?;
    let load = load(&env, 500, 0.1, 5);
    env.publish_events(&load).await?;
    wait_applied(&env, &load, Duration::from_secs(60)).await?;
    let log = worker.stop().await?;
    assert_exact(&env, &load, &[]).await?;
    assert!(log.contains("trying the next node"), "{log}");
    let next = format!(
        "connected to RabbitMQ at amqp://{}@{}/",
        amqp_user(),
        amqp_host_port()
    );
    assert!(log.contains(&next), "{log}");
    Ok(())
}
