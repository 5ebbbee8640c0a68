//! The outbox: what an effect sends on leaves if and only if the effect
//! committed, once per event, under a key that does not change.
//!
//! Over 700 lines: one scenario per test, the outbox's and the relay's in one
//! place.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lapin::types::AMQPValue;

use idem::handler::{
    Handler, HandlerError, Invalid, Migration, Outbox, OutboxMessage, Tally, Transaction,
    message_id,
};
use idem::relay::IDEMPOTENCY_KEY;
use idem::worker::Mode;
use idem_points::points::{
    Announcing, CREDITED_ROUTING_KEY, PaymentSucceeded, Points, PointsCredited,
};

use crate::support::{
    DeadLetter, GROUP, RunningWorker, TestEnv, Untallied, Vhost, WorkerProcess, amqp_url,
    database_url, example_binary, idem_command, load, patient, wait_for,
};

/// A queue of the test's own that receives every `points.credited` sent to
/// the test's exchange, as a downstream service's would.
pub(crate) async fn credited_queue(env: &TestEnv) -> anyhow::Result<String> {
    let queue = format!("{}.credited", env.topology.queue);
    env.remove_on_drop(std::slice::from_ref(&queue))?;
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    idem::broker::declare_bound_queue(
        &channel,
        &queue,
        &env.topology.exchange,
        CREDITED_ROUTING_KEY,
    )
    .await?;
    connection.close(200, "OK".into()).await?;
    Ok(queue)
}

/// Checks each received `points.credited` (its key as `message_id` and
/// header, derived from the group and the source event) and returns them
/// by source event, with how many copies of each came.
fn by_source(messages: &[DeadLetter]) -> anyhow::Result<BTreeMap<String, (PointsCredited, usize)>> {
    let mut credits: BTreeMap<String, (PointsCredited, usize)> = BTreeMap::new();
    for message in messages {
        let credited: PointsCredited = serde_json::from_slice(&message.body)?;
        let key = message
            .properties
            .message_id()
            .as_ref()
            .context("no message_id")?
            .to_string();
        assert_eq!(
            key,
            message_id(GROUP, &credited.source_event_id, 0).to_string()
        );
        let header = message
            .properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get(IDEMPOTENCY_KEY).cloned());
        assert_eq!(header, Some(AMQPValue::LongString(key.as_str().into())));
        // The handler's own header travels too.
        let kind = message
            .properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get("Event-Type").cloned());
        assert_eq!(
            kind,
            Some(AMQPValue::LongString(CREDITED_ROUTING_KEY.into()))
        );
        let entry = credits
            .entry(credited.source_event_id.clone())
            .or_insert((credited.clone(), 0));
        assert_eq!(entry.0, credited, "two copies of one key differ");
        entry.1 += 1;
    }
    Ok(credits)
}

/// What a load should have announced: one credit per distinct event.
/// The credits in `queue`, one for each event of `want` and as it says,
/// none for another.
pub(crate) async fn every_credit_received(
    env: &TestEnv,
    queue: &str,
    want: &BTreeMap<String, PointsCredited>,
) -> anyhow::Result<()> {
    let received = by_source(&env.peek(queue).await?)?;
    let lost: Vec<&String> = want
        .keys()
        .filter(|id| !received.contains_key(*id))
        .collect();
    assert!(
        lost.is_empty(),
        "{} credits lost, among them {:?}",
        lost.len(),
        &lost[..lost.len().min(3)]
    );
    for (id, (credited, _)) in &received {
        assert_eq!(Some(credited), want.get(id), "{id}");
    }
    Ok(())
}

pub(crate) fn expected(events: &[PaymentSucceeded]) -> BTreeMap<String, PointsCredited> {
    events
        .iter()
        .map(|event| {
            (
                event.event_id.clone(),
                PointsCredited {
                    source_event_id: event.event_id.clone(),
                    order_id: event.order_id.clone(),
                    points: event.points,
                },
            )
        })
        .collect()
}

/// Messages of the outbox that `condition` holds for.
async fn outbox_count(env: &TestEnv, condition: &str) -> anyhow::Result<i64> {
    let client = env.pool.get().await?;
    let row = client
        .query_one(
            &format!("SELECT count(*) FROM mq_outbox_message WHERE {condition}"),
            &[],
        )
        .await?;
    Ok(row.get(0))
}

pub(crate) async fn unsent(env: &TestEnv) -> anyhow::Result<i64> {
    outbox_count(env, "sent_at IS NULL").await
}

async fn outbox_rows(env: &TestEnv) -> anyhow::Result<i64> {
    outbox_count(env, "true").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_credit_is_announced_once_under_a_key_of_its_own() -> anyhow::Result<()> {
    for mode in Mode::ALL {
        let env = TestEnv::new().await?;
        let queue = credited_queue(&env).await?;
        let events = load(&env, 600, 0.2, 20);
        let handler = Points.announcing(env.topology.exchange.as_str());
        let worker = RunningWorker::start_with(env.worker_config(mode), handler);
        env.publish_events(&events).await?;
        let want = expected(&events);
        wait_for(
            "every credit announced",
            Duration::from_secs(60),
            || async {
                Ok(env.ready(&queue).await? as usize >= want.len() && unsent(&env).await? == 0)
            },
        )
        .await?;
        let stats = worker.stats.clone();
        worker.stop().await?;
        let stats = stats.snapshot();
        let received = by_source(&env.peek(&queue).await?)?;
        // Nothing was killed: not even a second copy.
        assert!(
            received.values().all(|(_, copies)| *copies == 1),
            "{mode:?}"
        );
        let received: BTreeMap<_, _> = received.into_iter().map(|(k, (c, _))| (k, c)).collect();
        assert_eq!(received, want, "{mode:?}");
        // One row written per credit, sent, and removed once confirmed.
        assert_eq!(stats.outbox_sent, want.len() as u64, "{mode:?}");
        assert_eq!(outbox_rows(&env).await?, 0, "{mode:?}");
    }
    Ok(())
}

async fn an_effect_that_rolls_back_sends_nothing<H: Handler<Event = PaymentSucceeded>>(
    handler: H,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let store = idem::store::Store::new(env.pool.clone(), GROUP.to_owned());
    let applier = idem::store::Applier::new(store, Arc::new(handler))?;
    let event = |id: &str, points: i64| PaymentSucceeded {
        event_id: format!("{}-{id}", env.name),
        order_id: "7".into(),
        points,
    };
    let (first, second, third) = (event("a", i64::MAX), event("b", 1), event("c", 2));
    applier.apply(&[&first]).await?;
    assert_eq!(outbox_rows(&env).await?, 1);
    // Its points overflow the order's: the statement fails, and with it
    // the record, the effect and the message of the whole transaction.
    let failed = applier.apply(&[&third, &second]).await;
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(outbox_rows(&env).await?, 1);
    assert_eq!(env.records(GROUP).await?, 1);
    // A duplicate applies nothing, and sends nothing either.
    applier.apply(&[&first]).await?;
    assert_eq!(outbox_rows(&env).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_that_rolls_back_sends_nothing_and_a_duplicate_sends_nothing_again()
-> anyhow::Result<()> {
    let exchange = "unused";
    an_effect_that_rolls_back_sends_nothing(Points.announcing(exchange)).await?;
    an_effect_that_rolls_back_sends_nothing(Untallied(Points.announcing(exchange))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_and_a_relay_killed_mid_load_lose_no_credit_and_keep_every_key()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let queue = credited_queue(&env).await?;
    let events = load(&env, 3000, 0.1, 50);
    let want = expected(&events);
    let worker = |relay: bool| {
        let mut command = idem_command(&env, &amqp_url(), &database_url());
        command.args([
            "worker",
            "--credits-exchange",
            env.topology.exchange.as_str(),
        ]);
        if !relay {
            command.arg("--no-relay");
        }
        WorkerProcess::start(command)
    };
    let relay = |until_empty: bool| {
        let mut command = idem_command(&env, &amqp_url(), &database_url());
        command.arg("relay");
        if until_empty {
            command.arg("--until-empty");
        }
        WorkerProcess::start(command)
    };

    // The worker relays for itself, and is killed part-way through the
    // first half of the load.
    let (early, late) = events.split_at(events.len() / 2);
    let mut first = worker(true)?;
    env.publish_events(early).await?;
    wait_for("some credits sent", Duration::from_secs(60), || async {
        Ok(env.ready(&queue).await? >= 300)
    })
    .await?;
    first.kill().await?;
    // Then a worker that leaves the outbox to a relay apart, with the other
    // half to apply: the relay has at least that half's credits to send,
    // however far the first worker got, and is killed part-way too.
    let second = worker(false)?;
    let sent_before = env.ready(&queue).await?;
    let mut relaying = relay(false)?;
    env.publish_events(late).await?;
    wait_for("the relay at work", Duration::from_secs(60), || async {
        Ok(env.ready(&queue).await? > sent_before + 100)
    })
    .await?;
    relaying.kill().await?;
    wait_for("every event applied", Duration::from_secs(90), || async {
        Ok(env.records(GROUP).await? == want.len() as i64
            && env.ready(&env.topology.queue).await? == 0)
    })
    .await?;
    second.stop().await?;
    let mut last = relay(true)?;
    let code = last.wait(Duration::from_secs(60)).await?;
    assert_eq!(code, Some(0), "{}", last.log());
    assert_eq!(unsent(&env).await?, 0);

    let received = by_source(&env.peek(&queue).await?)?;
    let keys: BTreeSet<&String> = received.keys().collect();
    assert_eq!(keys, want.keys().collect::<BTreeSet<_>>());
    for (id, (credited, _)) in &received {
        assert_eq!(credited, &want[id]);
    }
    assert_eq!(outbox_rows(&env).await?, 0);
    Ok(())
}

/// [`Announcing`], and a second message per event to an exchange that does
/// not exist.
struct AlsoNowhere {
    announcing: Announcing,
    nowhere: String,
}

impl Handler for AlsoNowhere {
    type Event = PaymentSucceeded;
    const NAME: &'static str = Points::NAME;
    const MIGRATIONS: &'static [Migration] = Points::MIGRATIONS;
    const SENDS_MESSAGES: bool = true;

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
        self.announcing.decode(body)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        self.announcing.event_id(event)
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&PaymentSucceeded],
        outbox: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        self.announcing.apply(tx, events, outbox).await
    }

    fn tally(&self) -> Option<Tally<PaymentSucceeded>> {
        self.announcing.tally()
    }

    fn outgoing(&self, event: &PaymentSucceeded) -> Vec<idem::handler::OutboxMessage> {
        let mut messages = self.announcing.outgoing(event);
        messages.push(idem::handler::OutboxMessage::json(
            &self.nowhere,
            "nowhere",
            b"{}".to_vec(),
        ));
        messages
    }
}

/// A transaction's outbox row commits with its consume records and its
/// effect, in the same WAL: a PostgreSQL server that crashes (`-m
/// immediate`, nothing flushed after the crash kept) twice while the worker
/// applies and relays loses no applied event's credit and sends none for an
/// event it did not apply; what was sent but not yet removed goes again
/// under its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_server_crash_loses_no_credit_and_keeps_every_key() -> anyhow::Result<()> {
    let server = crate::faults::OwnServer::start()?;
    let env = TestEnv::on_database_server(server.url()).await?;
    let queue = credited_queue(&env).await?;
    let events = load(&env, 4000, 0.1, 50);
    let want = expected(&events);
    let handler = Points.announcing(env.topology.exchange.as_str());
    let worker = RunningWorker::start_with(env.worker_config(Mode::Batch), handler);
    // A part of the load at a time, the server crashed once the outbox
    // holds messages of the part that the relay has not removed: committed
    // with their events, they must outlive the crash.
    for part in events.chunks(1000) {
        env.publish_events(part).await?;
        wait_for(
            "messages of the part in the outbox",
            Duration::from_secs(120),
            || async { Ok(unsent(&env).await.unwrap_or(0) > 0) },
        )
        .await?;
        server.crash_and_restart()?;
    }
    // The test's own sessions end with each crash too: a count that fails
    // is not there yet.
    wait_for(
        "every event applied and its credit sent",
        Duration::from_secs(120),
        || async {
            Ok(env.records(GROUP).await.unwrap_or(0) == want.len() as i64
                && unsent(&env).await.unwrap_or(1) == 0
                && env.ready(&env.topology.queue).await? == 0)
        },
    )
    .await?;
    worker.stop().await?;
    every_credit_received(&env, &queue, &want).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_stays_in_the_outbox_is_counted_and_holds_up_no_other()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let events = load(&env, 8, 0.0, 3);
    let nowhere = format!("{}.nowhere", env.topology.exchange);
    let handler = AlsoNowhere {
        announcing: Points.announcing(env.topology.exchange.as_str()),
        nowhere: nowhere.clone(),
    };
    let worker = RunningWorker::start_with(env.worker_config(Mode::Batch), handler);
    env.publish_events(&events).await?;
    // No queue is bound for the credits yet: returned. The others' exchange
    // does not exist: the broker closes the channel over each.
    let n = events.len() as u64;
    wait_for(
        "every message refused once",
        Duration::from_secs(30),
        || async { Ok(worker.stats.snapshot().outbox_refused >= 2 * n) },
    )
    .await?;
    assert_eq!(env.records(GROUP).await?, n as i64);
    assert_eq!(unsent(&env).await?, 2 * n as i64);
    assert_eq!(
        outbox_count(&env, "last_error LIKE '%NO_ROUTE%'").await?,
        n as i64
    );
    assert_eq!(
        outbox_count(
            &env,
            &format!("exchange = '{nowhere}' AND last_error LIKE '%NOT_FOUND%'")
        )
        .await?,
        n as i64
    );
    assert!(
        worker
            .stats
            .encode()
            .contains("idem_outbox_refused_publishes_total"),
        "{}",
        worker.stats.encode()
    );

    // Once a queue is bound, the credits go out at their next attempt; the
    // messages to nowhere stay, and hold up none of them. (A credit sent on
    // a channel that then closed over one of those goes again: it may
    // arrive twice, under the same key.)
    let queue = credited_queue(&env).await?;
    wait_for("the credits sent", Duration::from_secs(30), || async {
        Ok(unsent(&env).await? == n as i64)
    })
    .await?;
    let stats = worker.stop().await?;
    assert_eq!(stats.outbox_sent, n);
    assert_eq!(
        outbox_count(&env, &format!("exchange = '{nowhere}' AND sent_at IS NULL")).await?,
        n as i64
    );
    let received = by_source(&env.peek(&queue).await?)?;
    assert_eq!(received.len(), events.len());
    Ok(())
}

/// `points/examples/notifications`, pointed at `vhost` and `env`'s schema.
fn notifications(env: &TestEnv, vhost: &Vhost) -> anyhow::Result<tokio::process::Command> {
    let mut command = tokio::process::Command::new(example_binary("notifications")?);
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(idem::vars::AMQP_URL, vhost.amqp_url())
        .env(idem::vars::DATABASE_URL, database_url())
        .env(idem::vars::SCHEMA, &env.schema)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    Ok(command)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chain_applies_each_credit_once_downstream_though_both_workers_are_killed()
-> anyhow::Result<()> {
    // Both services on a vhost of their own, under their real names: the
    // points worker announcing to `points.events`, the notifications
    // example consuming from it as its own consumer group.
    let env = TestEnv::new().await?;
    let vhost = Vhost::add(".*", ".*", ".*")?;
    let amqp = idem::broker::AmqpConfig::new(idem::secret::SecretUrl::new(vhost.amqp_url()));
    let migrated = notifications(&env, &vhost)?.arg("migrate").output().await?;
    anyhow::ensure!(
        migrated.status.success(),
        "notifications migrate: {}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let downstream = || -> anyhow::Result<WorkerProcess> {
        let mut command = notifications(&env, &vhost)?;
        command.arg("worker");
        WorkerProcess::start(command)
    };
    let points_topology = idem::broker::Topology {
        retry: idem::RetryPolicy::default().with_delays(crate::support::TEST_RETRY_DELAYS.to_vec()),
        ..idem_points::points::topology()
    };
    let upstream = || {
        let mut command = idem_command(&env, &vhost.amqp_url(), &database_url());
        command.envs(idem::vars::topology(&points_topology)).args([
            "worker",
            "--credits-exchange",
            "points.events",
        ]);
        WorkerProcess::start(command)
    };
    let mut notifier = downstream()?;
    // Its queue bound before the first credit goes out.
    wait_for(
        "the notifications queue",
        Duration::from_secs(30),
        || async {
            Ok(
                crate::support::ready(&amqp, "notifications.points-credited")
                    .await
                    .is_ok(),
            )
        },
    )
    .await?;
    let mut crediting = upstream()?;
    wait_for(
        "the points worker consuming",
        Duration::from_secs(30),
        || async {
            let connection = idem::broker::connect(&amqp, "idem test").await?;
            let channel = connection.create_channel().await?;
            let counts = idem::broker::queue_counts(&channel, &points_topology.queue).await;
            connection.close(200, "OK".into()).await?;
            Ok(counts.is_ok_and(|(_, consumers)| consumers == 1))
        },
    )
    .await?;
    let events = load(&env, 4000, 0.1, 40);
    let bodies: Vec<Vec<u8>> = events.iter().map(PaymentSucceeded::to_body).collect();
    crate::support::publish(&amqp, &points_topology, &bodies).await?;

    let queued = || async {
        let client = env.pool.get().await?;
        let row = client
            .query_one("SELECT count(*) FROM notification", &[])
            .await?;
        anyhow::Ok(row.get::<_, i64>(0))
    };
    wait_for("some notifications", Duration::from_secs(60), || async {
        Ok(queued().await? >= 400)
    })
    .await?;
    crediting.kill().await?;
    notifier.kill().await?;
    let crediting = upstream()?;
    let notifier = downstream()?;
    let want = expected(&events);
    wait_for(
        "every credit queued downstream",
        Duration::from_secs(120),
        || async { Ok(queued().await? == want.len() as i64 && unsent(&env).await? == 0) },
    )
    .await?;
    crediting.stop().await?;
    notifier.stop().await?;

    // Each credit once downstream, as credited upstream, and nothing
    // dead-lettered on the way.
    let client = env.pool.get().await?;
    let rows = client
        .query(
            "SELECT source_event_id::text, order_id::text, points FROM notification",
            &[],
        )
        .await?;
    let queued: BTreeMap<String, PointsCredited> = rows
        .iter()
        .map(|row| {
            let credited = PointsCredited {
                source_event_id: row.get(0),
                order_id: row.get(1),
                points: row.get(2),
            };
            (credited.source_event_id.clone(), credited)
        })
        .collect();
    assert_eq!(queued, want);
    let by_order = client
        .query(
            "SELECT n.order_id::text, sum(n.points)::bigint, min(p.points) \
             FROM notification n JOIN user_points p USING (order_id) GROUP BY n.order_id",
            &[],
        )
        .await?;
    let orders: BTreeSet<&String> = events.iter().map(|event| &event.order_id).collect();
    assert_eq!(by_order.len(), orders.len());
    for row in &by_order {
        assert_eq!(
            row.get::<_, i64>(1),
            row.get::<_, i64>(2),
            "order {}",
            row.get::<_, String>(0)
        );
    }
    for queue in [
        "points.payment-succeeded.dlq",
        "notifications.points-credited.dlq",
    ] {
        assert_eq!(crate::support::ready(&amqp, queue).await?, 0, "{queue}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_off_from_the_broker_three_times_loses_no_message() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let queue = credited_queue(&env).await?;
    let events = load(&env, 3000, 0.1, 30);
    let want = expected(&events);
    // The outbox filled by a worker that leaves it to relays.
    let mut config = env.worker_config(Mode::Batch);
    config.relay = false;
    let worker =
        RunningWorker::start_with(config, Points.announcing(env.topology.exchange.as_str()));
    env.publish_events(&events).await?;
    wait_for("every event applied", Duration::from_secs(60), || async {
        Ok(env.records(GROUP).await? == want.len() as i64)
    })
    .await?;
    worker.stop().await?;
    assert_eq!(unsent(&env).await?, want.len() as i64);

    // Then one relay, through a proxy that cuts its connection three times.
    let broker = crate::proxy::Proxy::start(crate::support::amqp_address()).await?;
    let mut relay = idem::relay::RelayConfig::new(
        idem::broker::AmqpConfig::new(idem::secret::SecretUrl::new(env.amqp_url_via(broker.port))),
        crate::support::patient(Duration::from_secs(10)),
    );
    relay.batch_size = 50;
    let counters = idem::relay::RelayCounters::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let relaying = {
        let (pool, relay, counters, stop) = (
            env.pool.clone(),
            relay.clone(),
            counters.clone(),
            stop.clone(),
        );
        tokio::spawn(async move { idem::relay::run(&pool, &relay, &counters, &stop).await })
    };
    let step = want.len() as u64 / 5;
    for cut in 1..=3 {
        wait_for("the relay at work", Duration::from_secs(60), || async {
            Ok(counters.sent.get() >= step * cut)
        })
        .await?;
        // Its connection dropped mid-batch: it must reconnect to go on.
        broker.cut();
    }
    wait_for("every message relayed", Duration::from_secs(90), || async {
        Ok(unsent(&env).await? == 0)
    })
    .await?;
    stop.cancel();
    let report = relaying.await??;
    assert_eq!(report.sent, want.len() as u64);
    assert_eq!(report.refused, 0);

    let received = by_source(&env.peek(&queue).await?)?;
    let keys: BTreeSet<&String> = received.keys().collect();
    assert_eq!(keys, want.keys().collect::<BTreeSet<_>>());
    Ok(())
}

/// Credits each event's points and sends on what it found: the order's
/// total, as `points.gold` from `gold` points on and as `points.standing`
/// below; a message depends on the effect, not on the event alone.
struct Standing {
    gold: i64,
}

impl Handler for Standing {
    type Event = PaymentSucceeded;
    const NAME: &'static str = Points::NAME;
    const MIGRATIONS: &'static [Migration] = Points::MIGRATIONS;
    const SENDS_MESSAGES: bool = true;

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
        Points.decode(body)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        &event.event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&PaymentSucceeded],
        outbox: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        for event in events {
            let total: i64 = tx
                .query_one(
                    "INSERT INTO user_points (order_id, points) VALUES ($1, $2) \
                     ON CONFLICT (order_id) DO UPDATE \
                     SET points = user_points.points + EXCLUDED.points \
                     RETURNING points",
                    &[&event.order_id, &event.points],
                )
                .await?
                .get(0);
            let standing = if total >= self.gold {
                "gold"
            } else {
                "standing"
            };
            let body = serde_json::json!({ "order_id": event.order_id, "total": total });
            outbox.send(
                &event.event_id,
                OutboxMessage::json("x", &format!("points.{standing}"), body.to_string().into()),
            )?;
        }
        Ok(())
    }
}

/// What the outbox holds, by key: routing key and body.
async fn sent_by_key(env: &TestEnv) -> anyhow::Result<BTreeMap<String, (String, String)>> {
    let client = env.pool.get().await?;
    let rows = client
        .query(
            "SELECT message_id::text, routing_key, convert_from(body, 'UTF8') FROM mq_outbox_message",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_apply_sends_depends_on_what_it_found_and_is_sent_once_under_the_event_s_key()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let store = idem::store::Store::new(env.pool.clone(), GROUP.to_owned());
    let applier = idem::store::Applier::new(store, Arc::new(Standing { gold: 12 }))?;
    let event = |id: &str, points: i64| PaymentSucceeded {
        event_id: format!("{}-{id}", env.name),
        order_id: format!("{}-order", env.name),
        points,
    };
    let (a, b, c) = (event("a", 5), event("b", 10), event("c", i64::MAX));
    applier.apply(&[&a, &a, &b]).await?;
    let key = |event: &PaymentSucceeded| message_id(GROUP, &event.event_id, 0).to_string();
    let order = &a.order_id;
    let want = BTreeMap::from([
        (
            key(&a),
            (
                "points.standing".to_owned(),
                format!(r#"{{"order_id":"{order}","total":5}}"#),
            ),
        ),
        (
            key(&b),
            (
                "points.gold".to_owned(),
                format!(r#"{{"order_id":"{order}","total":15}}"#),
            ),
        ),
    ]);
    assert_eq!(sent_by_key(&env).await?, want);
    // Duplicates apply nothing and send nothing again.
    applier.apply(&[&b, &a]).await?;
    assert_eq!(sent_by_key(&env).await?, want);
    // The total overflows after `apply` sent for `a2`: the whole
    // transaction rolls back, its message with it.
    let a2 = event("a2", 1);
    let failed = applier.apply(&[&a2, &c]).await;
    assert!(
        matches!(&failed, Err(failure) if failure.kind != idem::handler::FailureKind::Permanent),
        "{failed:?}"
    );
    assert_eq!(sent_by_key(&env).await?, want);
    assert_eq!(env.records(GROUP).await?, 2);

    // A handler that sends without declaring it: no relay would publish the
    // message, so the event can never apply.
    struct Undeclared;
    impl Handler for Undeclared {
        type Event = PaymentSucceeded;
        const NAME: &'static str = Points::NAME;
        const MIGRATIONS: &'static [Migration] = Points::MIGRATIONS;
        fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
            Points.decode(body)
        }
        fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
            &event.event_id
        }
        async fn apply(
            &self,
            tx: &Transaction<'_>,
            events: &[&PaymentSucceeded],
            outbox: &mut Outbox<'_>,
        ) -> Result<(), HandlerError> {
            Standing { gold: 0 }.apply(tx, events, outbox).await
        }
    }
    let store = idem::store::Store::new(env.pool.clone(), GROUP.to_owned());
    let undeclared = idem::store::Applier::new(store, Arc::new(Undeclared))?;
    let refused = undeclared.apply(&[&a2]).await;
    assert!(
        matches!(&refused, Err(failure) if failure.kind == idem::handler::FailureKind::Permanent
            && failure.reason.contains("SENDS_MESSAGES")),
        "{refused:?}"
    );
    assert_eq!(sent_by_key(&env).await?, want);
    assert_eq!(env.records(GROUP).await?, 2);
    Ok(())
}

/// Writes `count` messages to the test's exchange, routed as credits, into
/// the outbox in one statement, so that their ids rise with their bodies
/// ("1", "2", …).
async fn write_outbox(env: &TestEnv, count: i64) -> anyhow::Result<()> {
    env.pool
        .get()
        .await?
        .execute(
            "INSERT INTO mq_outbox (message_id, exchange, routing_key, body) \
             SELECT gen_random_uuid(), $1, $2, convert_to(n::text, 'UTF8') \
             FROM generate_series(1, $3::bigint) AS n ORDER BY n",
            &[&env.topology.exchange, &CREDITED_ROUTING_KEY, &count],
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_one_lane_sends_a_destination_s_messages_in_the_outbox_s_order()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let queue = credited_queue(&env).await?;
    // More than a batch holds, so that the order must hold within batches
    // and across them.
    const MESSAGES: i64 = 2500;
    write_outbox(&env, MESSAGES).await?;
    let client = env.pool.get().await?;
    let in_id_order: Vec<String> = client
        .query(
            "SELECT convert_from(body, 'UTF8') FROM mq_outbox ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    let mut relay =
        idem::relay::RelayConfig::new(env.amqp.clone(), patient(Duration::from_secs(10)));
    relay.until_empty = true;
    let report = idem::relay::run(
        &env.pool,
        &relay,
        &idem::relay::RelayCounters::default(),
        &tokio_util::sync::CancellationToken::new(),
    )
    .await?;
    assert_eq!(report.sent, MESSAGES as u64);
    assert_eq!(outbox_rows(&env).await?, 0);

    let received: Vec<String> = env
        .peek(&queue)
        .await?
        .into_iter()
        .map(|message| String::from_utf8(message.body))
        .collect::<Result<_, _>>()?;
    assert_eq!(received.len(), in_id_order.len());
    let first_out_of_order = received
        .iter()
        .zip(&in_id_order)
        .position(|(got, want)| got != want);
    assert_eq!(
        first_out_of_order, None,
        "received out of the outbox's order"
    );
    Ok(())
}

/// A relay whose statement fails inside its transaction (here a lock it
/// waits for too long) starts again on a fresh connection: the failed one
/// is closed, not handed back to the pool with its transaction still open
/// and aborted, where every later statement would fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_statement_fails_mid_transaction_goes_on_once_the_database_lets_it()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let queue = credited_queue(&env).await?;
    const MESSAGES: i64 = 200;
    write_outbox(&env, MESSAGES).await?;
    let client = env.pool.get().await?;
    let mut locker = env.pool.get().await?;
    let lock = locker.transaction().await?;
    lock.batch_execute("LOCK TABLE mq_outbox IN ACCESS EXCLUSIVE MODE")
        .await?;

    let relay = idem::relay::RelayConfig::new(env.amqp.clone(), patient(Duration::from_secs(10)));
    let mut database = env.database.clone();
    database.pool_size = relay.connections();
    database.lock_timeout = Duration::from_millis(200);
    let pool = database.pool()?;
    let counters = idem::relay::RelayCounters::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let relaying = {
        let (relay, counters, stop) = (relay.clone(), counters.clone(), stop.clone());
        tokio::spawn(async move { idem::relay::run(&pool, &relay, &counters, &stop).await })
    };
    // The relay's sessions that wait for the lock: a second one means the
    // first gave up (its lock timeout) and the relay tried again on a
    // connection of its own.
    let waiting = || async {
        let pids: Vec<i32> = client
            .query(
                "SELECT pid FROM pg_locks WHERE NOT granted AND relation = 'mq_outbox'::regclass",
                &[],
            )
            .await?
            .iter()
            .map(|row| row.get(0))
            .collect();
        anyhow::Ok(pids)
    };
    wait_for(
        "the relay to wait for the lock",
        Duration::from_secs(30),
        || async { Ok(!waiting().await?.is_empty()) },
    )
    .await?;
    let first = waiting().await?.first().copied();
    wait_for(
        "the relay to wait again, on another connection",
        Duration::from_secs(30),
        || async { Ok(waiting().await?.iter().any(|pid| Some(*pid) != first)) },
    )
    .await?;
    lock.rollback().await?;

    wait_for("every message sent", Duration::from_secs(30), || async {
        Ok(counters.sent.get() == MESSAGES as u64)
    })
    .await?;
    stop.cancel();
    relaying.await??;
    assert_eq!(outbox_rows(&env).await?, 0);
    assert_eq!(env.peek(&queue).await?.len(), MESSAGES as usize);
    Ok(())
}
