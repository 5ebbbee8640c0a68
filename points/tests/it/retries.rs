//! Delayed retries: a failed message waits in the wait queue of its delay
//! (RabbitMQ holds it, not the worker's memory) and comes back for its next
//! attempt; attempts are spaced as the schedule says, counted in the ledger.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::broker::Topology;
use idem::handler::{Handler, HandlerError, Invalid, Outbox, Transaction};
use idem::worker::Mode;
use idem_points::points::{PaymentSucceeded, Points};

use crate::support::{
    GROUP, RunningWorker, TestEnv, WorkerProcess, amqp_url, assert_exact, database_url, load,
    patient, wait_for,
};

/// The points effect, for events whose order has a row in `arrivals`; the
/// others fail, as a message whose dependency has not arrived yet. Each
/// attempt's time is noted.
struct Arrivals {
    attempts: Arc<Mutex<Vec<Instant>>>,
}

impl Handler for Arrivals {
    type Event = PaymentSucceeded;

    const NAME: &'static str = "points";

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
        self.attempts
            .lock()
            .map_err(|_| HandlerError::infrastructure("poisoned"))?
            .push(Instant::now());
        let orders: Vec<&str> = events.iter().map(|event| event.order_id.as_str()).collect();
        let missing: i64 = tx
            .query_one(
                "SELECT count(*) FROM unnest($1::text[]) AS o(id) \
                 WHERE NOT EXISTS (SELECT 1 FROM arrivals WHERE order_id = o.id)",
                &[&orders],
            )
            .await?
            .get(0);
        if missing > 0 {
            return Err(HandlerError::message("its order has not arrived yet"));
        }
        Points.apply(tx, events, outbox).await
    }
}

/// `env`'s topology with the retry schedule `delays`, declared (and
/// removed with the test).
async fn with_delays(env: &TestEnv, delays: &[Duration]) -> anyhow::Result<Topology> {
    let topology = Topology {
        retry: idem::RetryPolicy::default().with_delays(delays.to_vec()),
        ..env.topology.clone()
    };
    env.declare(&topology).await?;
    Ok(topology)
}

/// The gaps between consecutive attempts are the schedule's delays, give or
/// take the time it takes to go round.
fn assert_spaced(attempts: &[Instant], delays: &[Duration]) {
    let tolerance = patient(Duration::from_millis(1500));
    // The broker's expiry is not exact to the millisecond: a wait queue
    // let a message go 6 ms before its 2 s on a loaded host.
    let early = Duration::from_millis(50);
    for (index, pair) in attempts.windows(2).enumerate() {
        let gap = pair[1] - pair[0];
        let delay = delays[index.min(delays.len() - 1)];
        assert!(
            gap + early >= delay && gap < delay + tolerance,
            "attempt {} came {gap:?} after the one before, the schedule says {delay:?}",
            index + 2
        );
    }
}

async fn ledger(env: &TestEnv, event_id: &str) -> anyhow::Result<Option<(i32, String)>> {
    let client = env.pool.get().await?;
    let row = client
        .query_opt(
            "SELECT failures, last_error FROM mq_failure_ledger WHERE event_id = $1",
            &[&event_id],
        )
        .await?;
    Ok(row.map(|row| (row.get(0), row.get(1))))
}

async fn a_message_that_fails_until_its_row_arrives_applies_at_a_later_attempt_spaced_as_configured(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.sql("CREATE TABLE arrivals (order_id TEXT PRIMARY KEY)")
        .await?;
    let delays = [Duration::from_secs(1), Duration::from_secs(2)];
    let mut config = env.worker_config(mode);
    config.topology = with_delays(&env, &delays).await?;
    let event = PaymentSucceeded {
        event_id: format!("{}-late", env.name),
        order_id: "late-order".into(),
        points: 7,
    };
    env.publish_events(std::slice::from_ref(&event)).await?;

    let attempts = Arc::new(Mutex::new(Vec::new()));
    let worker = RunningWorker::start_with(
        config,
        Arrivals {
            attempts: Arc::clone(&attempts),
        },
    );
    // Two failures counted, then the row arrives before the third attempt.
    wait_for("two failures", Duration::from_secs(20), || async {
        Ok(ledger(&env, &event.event_id)
            .await?
            .is_some_and(|(n, _)| n == 2))
    })
    .await?;
    env.sql("INSERT INTO arrivals VALUES ('late-order')")
        .await?;
    wait_for("the event applied", Duration::from_secs(20), || async {
        Ok(env.records_of(&event.event_id, GROUP).await? == 1)
    })
    .await?;
    let stats = worker.stop().await?;

    let attempts = attempts
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    assert_eq!(
        attempts.len(),
        3,
        "two failures, then the attempt that applied"
    );
    assert_spaced(&attempts, &delays);
    assert_eq!(
        (stats.applied, stats.retried, stats.dead_lettered),
        (1, 2, 0)
    );
    assert_eq!(env.points("late-order").await?, 7);
    assert_eq!(
        ledger(&env, &event.event_id).await?,
        None,
        "cleared when applied"
    );
    assert_eq!(env.ready(&env.topology.dead_letter_queue).await?, 0);
    Ok(())
}

async fn a_message_that_keeps_failing_is_dead_lettered_after_exactly_its_attempts_spaced_as_configured(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.sql("CREATE TABLE arrivals (order_id TEXT PRIMARY KEY)")
        .await?;
    let delays = [Duration::from_millis(300), Duration::from_millis(600)];
    let mut config = env.worker_config(mode);
    config.topology = with_delays(&env, &delays).await?;
    config.topology.retry = config.topology.retry.clone().with_attempts(4);
    let event = PaymentSucceeded {
        event_id: format!("{}-never", env.name),
        order_id: "never-order".into(),
        points: 1,
    };
    env.publish_events(std::slice::from_ref(&event)).await?;

    let attempts = Arc::new(Mutex::new(Vec::new()));
    let worker = RunningWorker::start_with(
        config,
        Arrivals {
            attempts: Arc::clone(&attempts),
        },
    );
    wait_for("the dead letter", Duration::from_secs(20), || async {
        Ok(env.ready(&env.topology.dead_letter_queue).await? == 1)
    })
    .await?;
    let stats = worker.stop().await?;

    let attempts = attempts
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    assert_eq!(attempts.len(), 4, "exactly --max-attempts");
    assert_spaced(&attempts, &delays);
    assert_eq!((stats.retried, stats.dead_lettered), (3, 1));
    assert_eq!(
        ledger(&env, &event.event_id).await?,
        Some((4, "its order has not arrived yet".to_owned()))
    );
    let letters = env.dead_letters().await?;
    assert_eq!(letters.len(), 1);
    assert_eq!(PaymentSucceeded::parse(&letters[0].body), Ok(event));
    let death = letters[0]
        .death()
        .ok_or_else(|| anyhow::anyhow!("no record of its death"))?;
    assert_eq!(death.reason, "rejected");
    assert_eq!(death.queue, env.topology.queue, "replayed to where it died");
    // The route it was first published with, though it was last published
    // by idem, to a wait queue.
    assert_eq!(death.exchange, env.topology.exchange);
    assert_eq!(death.routing_keys, vec![env.topology.routing_key.clone()]);
    for delay in delays {
        let waiting = env.ready(&env.topology.wait_queue(delay)).await?;
        assert_eq!(waiting, 0, "nothing left waiting");
    }
    Ok(())
}

/// `('a'), ('b')`: the rows of a one-column `VALUES`.
fn rows(values: &[&str]) -> String {
    values
        .iter()
        .map(|value| format!("('{value}')"))
        .collect::<Vec<_>>()
        .join(", ")
}

async fn killing_the_worker_while_messages_wait_loses_nothing_and_applies_nothing_twice(
    mode: Mode,
) -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    // Long enough that the kill lands while they wait.
    let delay = Duration::from_secs(3);
    let load = load(&env, 3000, 0.2, 20);
    // The copies of an event share its budget, and an early event of the
    // load has many: give every copy room for a few failures, so that none
    // is dead-lettered and the queue must come out empty.
    let mut copies = std::collections::BTreeMap::<&str, u32>::new();
    for event in &load {
        *copies.entry(event.event_id.as_str()).or_default() += 1;
    }
    let budget = copies.values().max().copied().unwrap_or(1) * 4;
    let topology = Topology {
        retry: idem::RetryPolicy::default().with_delays(vec![delay]),
        delivery_limit: budget * 2,
        ..env.topology.clone()
    };
    // A delivery limit above that budget: the work queue again.
    env.connect()
        .await?
        .create_channel()
        .await?
        .queue_delete(topology.queue.as_str().into(), Default::default())
        .await?;
    env.declare(&topology).await?;
    let wait_queue = topology.wait_queue(delay);
    let orders: Vec<&str> = load
        .iter()
        .map(|event| event.order_id.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let (ready, late) = orders.split_at(orders.len() / 2);
    // Events of the late orders fail until their orders are ready.
    env.sql(&format!(
        "CREATE TABLE ready_orders (order_id TEXT PRIMARY KEY);
         INSERT INTO ready_orders VALUES {};
         CREATE FUNCTION not_yet() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NOT EXISTS (SELECT 1 FROM ready_orders WHERE order_id = NEW.order_id) THEN
                 RAISE EXCEPTION 'order % is not ready', NEW.order_id;
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER not_yet BEFORE INSERT OR UPDATE ON user_points
             FOR EACH ROW EXECUTE FUNCTION not_yet();",
        rows(ready)
    ))
    .await?;
    env.publish_events(&load).await?;

    let args = [
        "--retry-delays",
        "3s",
        "--max-attempts",
        &budget.to_string(),
        "--delivery-limit",
        &topology.delivery_limit.to_string(),
    ];
    let mut first = WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &args)?;
    // The worker holds what waits (up to its wait queues' prefetch), so the
    // queue shows none ready. An event that failed again a delay after its
    // first failure went through the wait queue, and what failed after it
    // waits there now. Killed then, in the second round, far from any
    // event's budget (each copy has room for four).
    wait_for(
        "an event failed again after its wait",
        Duration::from_secs(60),
        || async {
            env.count(
                "SELECT count(*) FROM mq_failure_ledger
                  WHERE last_failed_at >= first_failed_at + make_interval(secs => $1)",
                &[&delay.as_secs_f64()],
            )
            .await
            .map(|waited| waited > 0)
        },
    )
    .await?;
    first.kill().await?;
    wait_for(
        "the copies the killed worker held back in their wait queue",
        Duration::from_secs(30),
        || async { Ok(env.ready(&wait_queue).await? > 0) },
    )
    .await?;
    env.sql(&format!("INSERT INTO ready_orders VALUES {}", rows(late)))
        .await?;
    let second = WorkerProcess::spawn(&env, mode, &amqp_url(), &database_url(), &args)?;
    let distinct = idem_points::generate::distinct_events(&load) as i64;
    wait_for("every event applied", Duration::from_secs(90), || async {
        Ok(env.records(GROUP).await? >= distinct)
    })
    .await?;
    wait_for(
        "the work and wait queues empty",
        Duration::from_secs(30),
        || async {
            Ok(env.ready(&env.topology.queue).await? == 0 && env.ready(&wait_queue).await? == 0)
        },
    )
    .await?;
    second.stop().await?;
    assert_exact(&env, &load, &[]).await?;
    assert_eq!(env.count_rows("mq_failure_ledger").await?, 0);
    Ok(())
}

in_both_modes!(
    a_message_that_fails_until_its_row_arrives_applies_at_a_later_attempt_spaced_as_configured,
    a_message_that_keeps_failing_is_dead_lettered_after_exactly_its_attempts_spaced_as_configured,
    killing_the_worker_while_messages_wait_loses_nothing_and_applies_nothing_twice,
);

/// A copy applied as a first delivery does not look in the failure ledger;
/// a row another copy of its event left there (it failed while this one
/// went in) is then neither a spent budget nor a failing event, and a copy
/// that follows an attempt clears it, duplicate or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_row_of_an_event_applied_since_is_neither_failing_nor_spent() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let store = idem::store::Store::new(env.pool.clone(), GROUP);
    let applier = idem::store::Applier::new(store.clone(), Arc::new(Points))?;
    let event = PaymentSucceeded {
        event_id: format!("{}-e", env.name),
        order_id: "o".into(),
        points: 5,
    };
    let id = event.event_id.as_str();
    let rows = || async {
        let row = env
            .pool
            .get()
            .await?
            .query_one(
                "SELECT count(*) FROM mq_failure_ledger WHERE event_id = $1",
                &[&id],
            )
            .await?;
        anyhow::Ok(row.try_get::<_, i64>(0)?)
    };
    for _ in 0..3 {
        store.record_failure(id, "deadlock detected").await?;
    }
    assert_eq!(store.exhausted(&[id], 3).await?, vec![id.to_owned()]);
    assert_eq!(store.failing(10).await?, (1, false));
    // A count that stops where it was told to, and says there was more.
    store.record_failure("another", "deadlock detected").await?;
    assert_eq!(store.failing(1).await?, (1, true));
    assert_eq!(store.failing(2).await?, (2, false));
    store.reset_ledger(&["another"]).await?;

    assert!(applier.apply_first_deliveries(&[&event]).await?.take(id));
    assert_eq!(rows().await?, 1, "a first delivery leaves the ledger alone");
    assert!(
        store.exhausted(&[id], 3).await?.is_empty(),
        "an applied event is not out of attempts: its copies are duplicates"
    );
    assert_eq!(store.failing(10).await?, (0, false), "nor is it failing");

    assert!(!applier.apply(&[&event]).await?.take(id), "a duplicate");
    assert_eq!(rows().await?, 0, "a copy that follows an attempt clears it");
    assert_eq!(env.points("o").await?, 5);
    Ok(())
}

/// The worker consumes its wait queues; one deleted under it (the broker
/// cancels the consumer) ends the session, as a cancelled work queue's
/// consumer does: the worker connects again, declares the queue again and
/// consumes it, rather than go on without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_queue_deleted_under_the_worker_is_declared_and_consumed_again() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let wait_queue = env.topology.wait_queue(env.topology.retry.waits()[0]);
    let consumed = || async {
        // A queue that does not exist (yet) has no consumer.
        Ok(env.consumers(&wait_queue).await.unwrap_or(0) == 1)
    };
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_for(
        "the worker consuming its wait queue",
        Duration::from_secs(30),
        consumed,
    )
    .await?;
    let connection = env.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_delete(wait_queue.as_str().into(), Default::default())
        .await?;
    channel.close(200, "OK".into()).await?;
    connection.close(200, "OK".into()).await?;
    wait_for(
        "the wait queue declared and consumed again",
        Duration::from_secs(30),
        consumed,
    )
    .await?;
    let sessions = worker.stats.snapshot().sessions;
    worker.stop().await?;
    assert_eq!(sessions, 2, "one session more, after the cancel");
    Ok(())
}
