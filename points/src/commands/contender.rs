//! `idem contender`: the two consumers a team writes instead of idem, run by
//! `idem bench` beside idem's worker on the same load, so that idem's
//! figures have something to be measured against.
//!
//! Each is what a careful engineer writes in an afternoon with lapin and
//! tokio-postgres, and no more: manual acks after commit and a consume
//! record, but no retry budget, no dead-lettering beyond a body that does
//! not parse, no epochs, no outbox.
//!
//! - [`Contender::Textbook`]: per delivery, `BEGIN`, `INSERT … ON CONFLICT
//!   DO NOTHING` of the record, the upsert of the points when the record
//!   went in, `COMMIT`, ack; as many deliveries at once as `in_flight`.
//! - [`Contender::Batched`]: up to `batch_size` deliveries or `batch_wait`
//!   after the first, one transaction (the records in one statement, the
//!   points of those that went in, summed per order, in another), one ack
//!   of them all (`multiple`); up to `in_flight` batches in flight on a pool,
//!   acked in the order they were filled, as idem's batch mode keeps them.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use deadpool_postgres::Pool;
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use crate::points::PaymentSucceeded;
use idem::broker::{AmqpConfig, close, close_channel, connect};
use idem::store::DatabaseConfig;

/// Which program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    /// A transaction of four statements per delivery.
    Textbook,
    /// A transaction per batch of deliveries, one ack for the batch.
    Batched,
}

impl Contender {
    /// Every contender.
    pub const ALL: [Contender; 2] = [Contender::Textbook, Contender::Batched];

    /// Its name on the command line.
    pub fn as_arg(self) -> &'static str {
        match self {
            Contender::Textbook => "textbook",
            Contender::Batched => "batched",
        }
    }
}

/// Where a contender consumes and writes.
#[derive(Debug, Clone)]
pub struct ContenderConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The database, with the schema of the points table and [`TABLE`].
    pub database: DatabaseConfig,
    /// The queue the events are in.
    pub queue: String,
    /// The consumer's prefetch.
    pub prefetch: u16,
    /// Textbook: deliveries handled at once; batched: batches. Each on a
    /// connection of its own.
    pub in_flight: usize,
    /// Batched: most deliveries per transaction.
    pub batch_size: usize,
    /// Batched: how long a batch waits for more after its first delivery.
    pub batch_wait: Duration,
}

/// The contenders' consume record: the event id as the key, and an `id`
/// and time that the bench reads as it does idem's.
pub const TABLE: &str = "bench_contender_record";

/// Creates [`TABLE`] in the current schema.
pub const CREATE_TABLE: &str = "\
    CREATE TABLE IF NOT EXISTS bench_contender_record (\
        id          BIGSERIAL, \
        event_id    VARCHAR(128) COLLATE \"C\" PRIMARY KEY, \
        consumed_at TIMESTAMPTZ NOT NULL DEFAULT now())";

const RECORD: &str =
    "INSERT INTO bench_contender_record (event_id) VALUES ($1) ON CONFLICT DO NOTHING";

const CREDIT: &str = "\
    INSERT INTO user_points (order_id, points) VALUES ($1, $2) \
    ON CONFLICT (order_id) DO UPDATE SET points = user_points.points + EXCLUDED.points";

/// In id order: batches in flight that share an event (a copy) lock its
/// key in the same order.
const RECORD_BATCH: &str = "\
    INSERT INTO bench_contender_record (event_id) \
    SELECT id FROM unnest($1::varchar[]) AS id ORDER BY id \
    ON CONFLICT DO NOTHING RETURNING event_id";

const CREDIT_BATCH: &str = "\
    INSERT INTO user_points (order_id, points) \
    SELECT * FROM unnest($1::varchar[], $2::bigint[]) \
    ON CONFLICT (order_id) DO UPDATE SET points = user_points.points + EXCLUDED.points";

/// Consumes until `shutdown`, then lets what is in flight finish.
pub async fn run(
    contender: Contender,
    config: &ContenderConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut database = config.database.clone();
    database.pool_size = config.in_flight.max(1);
    let pool = database.pool()?;
    let connection = connect(&config.amqp, "idem contender").await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            config.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("cannot consume from {}", config.queue))?;
    let consumed = match contender {
        Contender::Textbook => textbook(consumer, pool, config.in_flight, shutdown).await,
        Contender::Batched => batched(consumer, &channel, &pool, config, shutdown).await,
    };
    close_channel(&channel).await;
    close(&connection).await;
    consumed
}

/// A task per delivery, at most `in_flight` at once.
async fn textbook(
    mut consumer: lapin::Consumer,
    pool: Pool,
    in_flight: usize,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let permits = Arc::new(tokio::sync::Semaphore::new(in_flight.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let delivery = tokio::select! {
            next = consumer.next() => match next {
                Some(delivery) => delivery?,
                None => break,
            },
            () = shutdown.cancelled() => break,
        };
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let pool = pool.clone();
        tasks.spawn(async move {
            let handled = handle_one(&pool, &delivery).await;
            drop(permit);
            handled
        });
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(())
}

/// One delivery's transaction, then its ack; a failed transaction gives
/// the delivery back.
async fn handle_one(pool: &Pool, delivery: &Delivery) -> anyhow::Result<()> {
    let Ok(event) = PaymentSucceeded::parse(&delivery.data) else {
        delivery
            .reject(BasicRejectOptions { requeue: false })
            .await?;
        return Ok(());
    };
    let applied = async {
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        let record = tx.prepare_cached(RECORD).await?;
        if tx.execute(&record, &[&event.event_id]).await? == 1 {
            let credit = tx.prepare_cached(CREDIT).await?;
            tx.execute(&credit, &[&event.order_id, &event.points])
                .await?;
        }
        tx.commit().await?;
        anyhow::Ok(())
    }
    .await;
    match applied {
        Ok(()) => {
            delivery.ack(BasicAckOptions::default()).await?;
        }
        Err(_) => {
            delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    multiple: false,
                })
                .await?;
        }
    }
    Ok(())
}

/// Batches filled one after the other, each applied in a transaction of
/// its own on the pool while the next fills, at most `in_flight` at once;
/// each acked (or given back) with `multiple` once it and every batch
/// before it are settled, so that an ack never covers a batch still in
/// flight.
async fn batched(
    mut consumer: lapin::Consumer,
    channel: &lapin::Channel,
    pool: &Pool,
    config: &ContenderConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let in_flight = config.in_flight.max(1);
    let mut pending: VecDeque<InFlight> = VecDeque::new();
    loop {
        while pending
            .front()
            .is_some_and(|batch| batch.applied.is_finished())
        {
            settle_head(channel, &mut pending).await?;
        }
        if pending.len() >= in_flight {
            settle_head(channel, &mut pending).await?;
        }
        let first = tokio::select! {
            next = consumer.next() => match next {
                Some(delivery) => delivery?,
                None => break,
            },
            () = shutdown.cancelled() => break,
        };
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + config.batch_wait;
        while batch.len() < config.batch_size {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(delivery)) => batch.push(delivery?),
                Ok(None) | Err(_) => break,
            }
        }
        let mut events = Vec::with_capacity(batch.len());
        for delivery in &batch {
            match PaymentSucceeded::parse(&delivery.data) {
                Ok(event) => events.push(event),
                Err(_) => {
                    delivery
                        .reject(BasicRejectOptions { requeue: false })
                        .await?;
                }
            }
        }
        let Some(last) = batch.last().map(|delivery| delivery.delivery_tag) else {
            continue;
        };
        let pool = pool.clone();
        let applied = tokio::spawn(async move {
            let mut client = pool.get().await?;
            apply_batch(&mut client, &events).await
        });
        pending.push_back(InFlight { last, applied });
    }
    while !pending.is_empty() {
        settle_head(channel, &mut pending).await?;
    }
    Ok(())
}

/// A batch on its way: its last delivery, and its transaction.
struct InFlight {
    last: lapin::types::DeliveryTag,
    applied: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Waits for the oldest batch in flight, then acks it with `multiple`, or
/// gives it back if its transaction failed.
async fn settle_head(
    channel: &lapin::Channel,
    pending: &mut VecDeque<InFlight>,
) -> anyhow::Result<()> {
    let Some(InFlight { last, applied }) = pending.pop_front() else {
        return Ok(());
    };
    if matches!(applied.await, Ok(Ok(()))) {
        channel
            .basic_ack(last, BasicAckOptions { multiple: true })
            .await?;
    } else {
        channel
            .basic_nack(
                last,
                BasicNackOptions {
                    requeue: true,
                    multiple: true,
                },
            )
            .await?;
    }
    Ok(())
}

/// The records of `events` in one statement, then the points of those that
/// went in, summed per order and in order (so that concurrent consumers
/// cannot deadlock), in one transaction.
async fn apply_batch(
    client: &mut deadpool_postgres::Client,
    events: &[PaymentSucceeded],
) -> anyhow::Result<()> {
    let tx = client.transaction().await?;
    let ids: Vec<&str> = events.iter().map(|event| event.event_id.as_str()).collect();
    let record = tx.prepare_cached(RECORD_BATCH).await?;
    let went_in: std::collections::HashSet<String> = tx
        .query(&record, &[&ids])
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    // An event twice in one batch went in once, and counts once.
    let mut counted = std::collections::HashSet::new();
    let mut totals: BTreeMap<&str, i64> = BTreeMap::new();
    for event in events {
        if went_in.contains(&event.event_id) && counted.insert(event.event_id.as_str()) {
            *totals.entry(event.order_id.as_str()).or_default() += event.points;
        }
    }
    if !totals.is_empty() {
        let (orders, points): (Vec<&str>, Vec<i64>) = totals.into_iter().unzip();
        let credit = tx.prepare_cached(CREDIT_BATCH).await?;
        tx.execute(&credit, &[&orders, &points]).await?;
    }
    tx.commit().await?;
    Ok(())
}
