//! `idem demo`: the whole story on local services in one command, on data
//! of its own (schema `idem_demo`, queues and exchanges named `idem-demo.*`,
//! consumer group `idem-demo`), reset at each run.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use anyhow::{Context, bail};
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use tokio_util::sync::CancellationToken;

use crate::points::{self, PaymentSucceeded, Points};
use idem::broker::{
    AmqpConfig, Outgoing, PublishOptions, Topology, close, close_channel, connect,
    declare_bound_queue, publish_all, ready_messages,
};
use idem::store::{DatabaseConfig, migrate};
use idem::worker::{Snapshot, Worker, WorkerConfig};

/// The demo's schema.
pub const SCHEMA: &str = "idem_demo";
/// The demo's consumer group.
pub const CONSUMER_GROUP: &str = "idem-demo";
/// Prefix of the demo's queues and exchanges.
pub const PREFIX: &str = "idem-demo.";

/// What the demo saw.
#[derive(Debug)]
pub struct DemoReport {
    /// Messages published, duplicates and the invalid one included.
    pub published: usize,
    /// Distinct events among them.
    pub events: usize,
    /// The worker's counters once it drained the queue.
    pub worker: Snapshot,
    /// Points per order afterwards.
    pub points: BTreeMap<String, i64>,
    /// Rows in `mq_consume_record`.
    pub consume_records: i64,
    /// Messages in the dead-letter queue.
    pub dead_letter_queue: (String, u32),
    /// `points.credited` messages the worker's relay sent (confirmed, then
    /// removed from the outbox), and how many the outbox still holds.
    pub outbox: (u64, i64),
    /// Messages in the queue bound for `points.credited`, and how many
    /// distinct idempotency keys they carry.
    pub credited_queue: (String, usize, usize),
}

/// The sample: three orders, producer retries, and one message that breaks
/// the contract.
fn sample() -> Vec<Vec<u8>> {
    let event = |id: &str, order: &str, points: i64| {
        PaymentSucceeded {
            event_id: id.into(),
            order_id: order.into(),
            points,
        }
        .to_body()
    };
    vec![
        event("payment-success-10001", "10001", 100),
        event("payment-success-10002-a", "10002", 50),
        event("payment-success-10001", "10001", 100),
        event("payment-success-10003", "10003", 40),
        event("payment-success-10002-b", "10002", 25),
        event("payment-success-10001", "10001", 100),
        br#"{"eventId": "payment-success-10004", "orderId": "10004", "points": -5}"#.to_vec(),
        event("payment-success-10003", "10003", 40),
        event("payment-success-10002-a", "10002", 50),
    ]
}

/// What a run leaves behind, and how to remove it.
fn left_behind() -> String {
    format!(
        "schema {SCHEMA}, queues and exchanges named {PREFIX}*; `idem demo --clean` removes them"
    )
}

/// Removes what [`run`] leaves behind: its schema, queues and exchanges.
/// Says what it removed.
pub async fn clean(amqp: AmqpConfig, database: DatabaseConfig) -> anyhow::Result<String> {
    let topology = points::topology().prefixed(PREFIX);
    let credits = Credits::of(&topology);
    let connection = drop_schema_once_both_answer(&database, &amqp).await?;
    delete_topology(&connection, &topology).await?;
    credits.delete(&connection).await?;
    close(&connection).await;
    Ok(format!(
        "removed schema {SCHEMA} and the queues and exchanges named {PREFIX}*"
    ))
}

/// Drops the demo's schema once both services answer (nothing of either is
/// changed before), and returns the broker connection.
async fn drop_schema_once_both_answer(
    database: &DatabaseConfig,
    amqp: &AmqpConfig,
) -> anyhow::Result<lapin::Connection> {
    let pool = database.pool()?;
    let client = pool.get().await.context("cannot reach PostgreSQL")?;
    let connection = connect(amqp, "idem demo").await?;
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        .await
        .context("cannot drop the demo schema")?;
    Ok(connection)
}

/// Runs the demo against `amqp` and `database` (whose schema is replaced by
/// the demo's own).
pub async fn run(amqp: AmqpConfig, database: DatabaseConfig) -> anyhow::Result<DemoReport> {
    let topology = points::topology().prefixed(PREFIX);
    let credits = Credits::of(&topology);
    // The worker as `idem worker` runs it by default, but quick to give up
    // on services that are not there.
    let mut config = WorkerConfig::new(
        amqp.clone(),
        database.with_schema(SCHEMA),
        topology.clone(),
        CONSUMER_GROUP,
    );
    config.startup_timeout = Duration::from_secs(5);
    config.shutdown_timeout = Duration::from_secs(10);
    let pool = config.database.pool()?;
    let connection = drop_schema_once_both_answer(&config.database, &amqp).await?;
    migrate::run::<Points>(&pool, Some(SCHEMA))
        .await
        .context("migrating the demo schema")?;
    reset_topology(&connection, &topology).await?;
    credits.reset(&connection).await?;
    close(&connection).await;

    let bodies = sample();
    let messages: Vec<Outgoing> = bodies
        .iter()
        .map(|body| topology.event(body.clone()))
        .collect();
    let events = bodies
        .iter()
        .filter_map(|b| PaymentSucceeded::parse(b).ok())
        .map(|e| e.event_id)
        .collect::<std::collections::HashSet<_>>()
        .len();
    let options = PublishOptions {
        window: 64,
        patience: Duration::from_secs(5),
    };
    let never = CancellationToken::new();
    let report = publish_all(&amqp, &messages, &options, &never).await?;
    if !report.all_confirmed() {
        bail!("the broker did not confirm every demo message: {report:?}");
    }

    // Every credit is announced, through the outbox, on the demo's own
    // exchange: the worker's relay sends them once the points committed.
    let worker = Worker::new(config, Points.announcing(credits.exchange.as_str()));
    let stats = worker.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    let drained = wait_until(Duration::from_secs(30), || {
        let done = stats.snapshot();
        done.finished() >= messages.len() as u64 && done.outbox_sent >= done.applied
    })
    .await;
    shutdown.cancel();
    running.await.context("the worker panicked")??;
    if !drained {
        bail!(
            "the worker did not finish the demo's {} messages within 30 s: {:?}",
            messages.len(),
            stats.snapshot()
        );
    }

    let client = pool.get().await?;
    let points = client
        .query(
            "SELECT order_id, points FROM user_points ORDER BY order_id",
            &[],
        )
        .await?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect::<Result<_, tokio_postgres::Error>>()?;
    let consume_records: i64 = client
        .query_one("SELECT count(*) FROM mq_consume_record", &[])
        .await?
        .try_get(0)?;
    let left: i64 = client
        .query_one("SELECT count(*) FROM mq_outbox_message", &[])
        .await?
        .try_get(0)?;
    let outbox = (stats.snapshot().outbox_sent, left);
    let connection = connect(&amqp, "idem demo").await?;
    let channel = connection.create_channel().await?;
    let dlq = ready_messages(&channel, &topology.dead_letter_queue).await?;
    let (credited, keys) = credits.received(&channel).await?;
    close_channel(&channel).await;
    close(&connection).await;
    Ok(DemoReport {
        published: messages.len(),
        events,
        worker: stats.snapshot(),
        points,
        consume_records,
        dead_letter_queue: (topology.dead_letter_queue, dlq),
        outbox,
        credited_queue: (credits.queue, credited, keys),
    })
}

/// Where the demo's worker announces its credits, and a queue that takes
/// them, as a downstream service's would.
struct Credits {
    exchange: String,
    queue: String,
}

impl Credits {
    fn of(topology: &Topology) -> Self {
        Self {
            exchange: format!("{PREFIX}points.events"),
            queue: format!("{}.credited", topology.queue),
        }
    }

    /// Both gone.
    async fn delete(&self, connection: &lapin::Connection) -> anyhow::Result<()> {
        let channel = connection.create_channel().await?;
        channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
        channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await?;
        close_channel(&channel).await;
        Ok(())
    }

    /// Both anew: deleted, declared, bound.
    async fn reset(&self, connection: &lapin::Connection) -> anyhow::Result<()> {
        use lapin::options::ExchangeDeclareOptions;
        use lapin::types::FieldTable;
        self.delete(connection).await?;
        let channel = connection.create_channel().await?;
        channel
            .exchange_declare(
                self.exchange.as_str().into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        declare_bound_queue(
            &channel,
            &self.queue,
            &self.exchange,
            points::CREDITED_ROUTING_KEY,
        )
        .await?;
        close_channel(&channel).await;
        Ok(())
    }

    /// The credits in the queue, and their distinct idempotency keys; read
    /// and given back.
    async fn received(&self, channel: &lapin::Channel) -> anyhow::Result<(usize, usize)> {
        use lapin::options::{BasicGetOptions, BasicNackOptions};
        let mut keys = std::collections::HashSet::new();
        let mut count = 0;
        let mut last = None;
        while let Some(message) = channel
            .basic_get(
                self.queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?
        {
            count += 1;
            if let Some(id) = message.delivery.properties.message_id() {
                keys.insert(id.to_string());
            }
            last = Some(message.delivery.delivery_tag);
        }
        if let Some(tag) = last {
            channel
                .basic_nack(
                    tag,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await?;
        }
        Ok((count, keys.len()))
    }
}

/// Deletes the demo's queues and exchanges, so each run starts empty.
async fn reset_topology(connection: &lapin::Connection, topology: &Topology) -> anyhow::Result<()> {
    delete_topology(connection, topology).await?;
    topology.declare(connection).await?;
    Ok(())
}

/// Deletes the demo's queues and exchanges.
async fn delete_topology(
    connection: &lapin::Connection,
    topology: &Topology,
) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    topology
        .delete(&channel)
        .await
        .context("cannot delete the demo's queues and exchanges")?;
    close_channel(&channel).await;
    Ok(())
}

async fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while !done() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = &self.worker;
        writeln!(f, "idem demo")?;
        writeln!(
            f,
            "  published            {} messages ({} distinct events: producer retries, and 1 invalid message)",
            self.published, self.events
        )?;
        writeln!(f, "  applied              {}", w.applied)?;
        writeln!(f, "  duplicates skipped   {}", w.duplicates)?;
        writeln!(
            f,
            "  dead-lettered        {} (invalid: {})",
            w.invalid + w.dead_lettered,
            w.invalid
        )?;
        writeln!(f, "  consume records      {}", self.consume_records)?;
        writeln!(f, "  points per order")?;
        for (order, points) in &self.points {
            writeln!(f, "    {order:<8} {points}")?;
        }
        let (queue, count) = &self.dead_letter_queue;
        writeln!(f, "  dead-letter queue    {queue}: {count} message(s)")?;
        let (sent, left) = self.outbox;
        writeln!(
            f,
            "  outbox               {sent} points.credited sent (written with the credits, \
             removed once confirmed), {left} left"
        )?;
        let (downstream, credited, keys) = &self.credited_queue;
        writeln!(
            f,
            "  downstream queue     {downstream}: {credited} message(s), {keys} idempotency key(s)"
        )?;
        writeln!(
            f,
            "  look closer: idem dlq list --schema {SCHEMA} --consumer-group {CONSUMER_GROUP} --dead-letter-queue {queue}"
        )?;
        write!(f, "  left behind: {}", left_behind())
    }
}
