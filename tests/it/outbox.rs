//! The outbox: what an effect sends on leaves if and only if the effect
//! committed, once per event, under a key that does not change.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

use idem::handler::{Handler, HandlerError, Invalid, Migration, Tally, Transaction, message_id};
use idem::points::{Announcing, CREDITED_ROUTING_KEY, PaymentSucceeded, Points, PointsCredited};
use idem::relay::IDEMPOTENCY_KEY;
use idem::worker::Mode;

use crate::helpers::{
    DeadLetter, GROUP, RunningWorker, TestEnv, WorkerProcess, amqp_url, database_url, idem_command,
    load, wait_for,
};

/// A queue of the test's own that receives every `points.credited` sent to
/// the test's exchange, as a downstream service's would.
async fn credited_queue(env: &TestEnv) -> anyhow::Result<String> {
    let queue = format!("{}.credited", env.topology.queue);
    env.remove_on_drop(std::slice::from_ref(&queue))?;
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            queue.as_str().into(),
            env.topology.exchange.as_str().into(),
            CREDITED_ROUTING_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
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
        let entry = credits
            .entry(credited.source_event_id.clone())
            .or_insert((credited.clone(), 0));
        assert_eq!(entry.0, credited, "two copies of one key differ");
        entry.1 += 1;
    }
    Ok(credits)
}

/// What a load should have announced: one credit per distinct event.
fn expected(events: &[PaymentSucceeded]) -> BTreeMap<String, PointsCredited> {
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

/// Rows of the outbox that `condition` holds for.
async fn outbox_count(env: &TestEnv, condition: &str) -> anyhow::Result<i64> {
    let client = env.pool.get().await?;
    let row = client
        .query_one(
            &format!("SELECT count(*) FROM mq_outbox WHERE {condition}"),
            &[],
        )
        .await?;
    Ok(row.get(0))
}

async fn unsent(env: &TestEnv) -> anyhow::Result<i64> {
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
        worker.stop().await?;
        let received = by_source(&env.peek(&queue).await?)?;
        // Nothing was killed: not even a second copy.
        assert!(
            received.values().all(|(_, copies)| *copies == 1),
            "{mode:?}"
        );
        let received: BTreeMap<_, _> = received.into_iter().map(|(k, (c, _))| (k, c)).collect();
        assert_eq!(received, want, "{mode:?}");
        assert_eq!(outbox_rows(&env).await?, want.len() as i64, "{mode:?}");
    }
    Ok(())
}

/// [`Announcing`] through the general path: no tally, so idem calls
/// `apply` and writes the outbox rows after it.
struct General(Announcing);

impl Handler for General {
    type Event = PaymentSucceeded;
    const NAME: &'static str = Points::NAME;
    const MIGRATIONS: &'static [Migration] = Points::MIGRATIONS;
    const SENDS_MESSAGES: bool = true;

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, Invalid> {
        self.0.decode(body)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        self.0.event_id(event)
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&PaymentSucceeded],
    ) -> Result<(), HandlerError> {
        self.0.apply(tx, events).await
    }

    fn outgoing(&self, event: &PaymentSucceeded) -> Vec<idem::handler::OutboxMessage> {
        self.0.outgoing(event)
    }

    fn tally(&self) -> Option<Tally<PaymentSucceeded>> {
        None
    }
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
    an_effect_that_rolls_back_sends_nothing(General(Points.announcing(exchange))).await
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

    // The worker relays for itself, and is killed part-way.
    let mut first = worker(true)?;
    env.publish_events(&events).await?;
    wait_for("some credits sent", Duration::from_secs(60), || async {
        Ok(env.ready(&queue).await? >= 300)
    })
    .await?;
    first.kill().await?;
    // Then a worker that leaves the outbox to relays apart; one is killed
    // part-way too.
    let second = worker(false)?;
    let mut relaying = relay(false)?;
    let sent_before = env.ready(&queue).await?;
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
    assert_eq!(outbox_rows(&env).await?, want.len() as i64);
    Ok(())
}
