//! One strategy under one fault: its consumers on the lab's queue, the
//! fault injected between the strategy's steps, and what the points say
//! afterwards.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use deadpool_postgres::{Object, Pool};
use futures::StreamExt;
use futures::future::BoxFuture;
use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use redis::aio::MultiplexedConnection;
use tokio::sync::{Notify, watch};
use tokio_postgres::Client;
use tokio_postgres::types::ToSql;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::strategy::{Effect, Hands, On, Step, Stop, Strategy};
use crate::points::PaymentSucceeded;
use idem::broker::{AmqpConfig, close_channel};
use idem::trial::{self, Exactness, Load};

/// What the lab does to a strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// A duplicated load, nothing injected: the throughput.
    None,
    /// Every event delivered to several consumers at once, held together
    /// where the strategy has decided that the event is new.
    SameEventAtOnce,
    /// The consumer handling an event's first delivery dies after `Step`:
    /// its database session and its channel close without commit or ack.
    Killed(Step),
    /// The points statement fails at an event's first delivery.
    EffectFails,
    /// Every event is handled, its Redis key expires, then the message
    /// comes back (a producer's retry, a replay, a recovered broker).
    ComesBackAfterTtl,
}

/// What one run of a strategy under a fault saw.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The effect, counted from the points.
    pub tally: Exactness,
    /// Messages published (copies included).
    pub messages: usize,
    /// From the consumers' start until every message was acked.
    pub elapsed: Duration,
    /// Times a version check failed and the strategy read again.
    pub conflicts: u64,
    /// Consumers killed by the fault.
    pub kills: u64,
    /// Deliveries whose handling failed (and were given back, unless
    /// already acked).
    pub failures: u64,
}

/// How one run is shaped.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub(crate) events: usize,
    /// How often each event is published, to how many consumers.
    pub(crate) load: Load,
    pub(crate) prefetch: u16,
}

/// Points per event: an order's points over this are how often its one
/// event was applied.
const POINTS: i64 = 100;

/// Where a strategy's runs happen: its schema, queue and Redis keys.
pub(crate) struct Stage {
    pub(crate) strategy: Strategy,
    pub(crate) queue: String,
    pub(crate) pool: Pool,
    pub(crate) redis: redis::Client,
    pub(crate) amqp: AmqpConfig,
    pub(crate) connection: Arc<Connection>,
    /// Start of every Redis key of this strategy.
    pub(crate) key_prefix: String,
    pub(crate) redis_ttl: Duration,
    pub(crate) short_ttl: Duration,
    pub(crate) gate_timeout: Duration,
    /// How long a run may take before the lab gives up on it.
    pub(crate) patience: Duration,
}

impl Stage {
    /// Runs the strategy under `fault` on events of its own, named `label`.
    pub(crate) async fn run(
        &self,
        fault: Fault,
        label: &str,
        shape: &Shape,
    ) -> anyhow::Result<Outcome> {
        let events: Vec<PaymentSucceeded> = (0..shape.events)
            .map(|n| PaymentSucceeded {
                event_id: format!("{label}-{n}"),
                order_id: format!("{label}-{n}"),
                points: POINTS,
            })
            .collect();
        let orders: Vec<&str> = events.iter().map(|e| e.order_id.as_str()).collect();
        let client = self.pool.get().await?;
        client
            .execute(
                "INSERT INTO points (order_id) SELECT unnest($1::text[])",
                &[&orders],
            )
            .await
            .context("adding the orders' points rows")?;
        drop(client);
        let load = load(&events, shape);

        let run = Arc::new(Run {
            strategy: self.strategy,
            fault,
            gate: (fault == Fault::SameEventAtOnce)
                .then(|| Gate::new(shape.load.repeats.copies, self.gate_timeout)),
            acked: watch::channel(0).0,
            conflicts: AtomicU64::new(0),
            kills: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            key_prefix: self.key_prefix.clone(),
            redis_ttl: match fault {
                Fault::ComesBackAfterTtl => self.short_ttl,
                _ => self.redis_ttl,
            },
            handled: Mutex::new(HashSet::new()),
            done: CancellationToken::new(),
        });
        self.publish(&load).await?;
        let started = Instant::now();
        let consumers: Vec<_> = (0..shape.load.consumers)
            .map(|_| {
                let consumer = LabConsumer {
                    run: run.clone(),
                    connection: self.connection.clone(),
                    pool: self.pool.clone(),
                    redis: self.redis.clone(),
                    queue: self.queue.clone(),
                    prefetch: shape.prefetch,
                };
                tokio::spawn(consumer.consume())
            })
            .collect();
        let mut waited = self.until_acked(&run, load.len()).await;
        if waited.is_ok() && fault == Fault::ComesBackAfterTtl {
            waited = async {
                self.until_keys_expired(&events).await?;
                self.publish(&load).await?;
                self.until_acked(&run, 2 * load.len()).await
            }
            .await;
        }
        let elapsed = started.elapsed();
        run.done.cancel();
        for consumer in consumers {
            consumer.await.context("a lab consumer panicked")??;
        }
        waited?;
        let tally = self.tally(&events).await?;
        self.remove_keys(&events).await?;
        Ok(Outcome {
            tally,
            messages: load.len(),
            elapsed,
            conflicts: run.conflicts.load(Ordering::Relaxed),
            kills: run.kills.load(Ordering::Relaxed),
            failures: run.failures.load(Ordering::Relaxed),
        })
    }

    async fn publish(&self, load: &[Vec<u8>]) -> anyhow::Result<()> {
        trial::publish(&self.amqp, "", &self.queue, load, self.patience).await
    }

    async fn until_acked(&self, run: &Run, count: usize) -> anyhow::Result<()> {
        let mut acked = run.acked.subscribe();
        let waited = tokio::time::timeout(self.patience, acked.wait_for(|n| *n >= count))
            .await
            .is_ok_and(|seen| seen.is_ok());
        match waited {
            true => Ok(()),
            false => bail!(
                "{} under {:?}: {} of {count} messages acked after {:?}",
                self.strategy.slug(),
                run.fault,
                *acked.borrow(),
                self.patience
            ),
        }
    }

    /// Waits until none of `events` has a key left in Redis (at once for
    /// the strategies that set none).
    async fn until_keys_expired(&self, events: &[PaymentSucceeded]) -> anyhow::Result<()> {
        let mut redis = self.redis.get_multiplexed_async_connection().await?;
        let keys = self.keys(events);
        let deadline = Instant::now() + self.short_ttl + self.patience;
        loop {
            let left: usize = redis::cmd("EXISTS")
                .arg(&keys)
                .query_async(&mut redis)
                .await?;
            if left == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{left} Redis keys did not expire");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn remove_keys(&self, events: &[PaymentSucceeded]) -> anyhow::Result<()> {
        if !self.strategy.uses_redis() {
            return Ok(());
        }
        let mut redis = self.redis.get_multiplexed_async_connection().await?;
        let _: usize = redis::cmd("DEL")
            .arg(self.keys(events))
            .query_async(&mut redis)
            .await?;
        Ok(())
    }

    fn keys(&self, events: &[PaymentSucceeded]) -> Vec<String> {
        events
            .iter()
            .map(|e| redis_key(&self.key_prefix, &e.event_id))
            .collect()
    }

    async fn tally(&self, events: &[PaymentSucceeded]) -> anyhow::Result<Exactness> {
        let orders: Vec<&str> = events.iter().map(|e| e.order_id.as_str()).collect();
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT points FROM points WHERE order_id = ANY($1)",
                &[&orders],
            )
            .await?;
        let mut tally = Exactness {
            events: events.len(),
            ..Exactness::default()
        };
        for row in rows {
            let applied = row.get::<_, i64>(0) / POINTS;
            if applied == 0 {
                tally.lost += 1;
            } else if applied > 1 {
                tally.twice += 1;
            }
        }
        Ok(tally)
    }
}

/// The messages of a run, in publishing order.
fn load(events: &[PaymentSucceeded], shape: &Shape) -> Vec<Vec<u8>> {
    let bodies: Vec<Vec<u8>> = events.iter().map(PaymentSucceeded::to_body).collect();
    shape.load.repeats.of(&bodies)
}

fn redis_key(prefix: &str, event_id: &str) -> String {
    format!("{prefix}:{event_id}")
}

/// What the consumers of one run share.
struct Run {
    strategy: Strategy,
    fault: Fault,
    gate: Option<Gate>,
    /// Messages acked so far.
    acked: watch::Sender<usize>,
    conflicts: AtomicU64,
    kills: AtomicU64,
    failures: AtomicU64,
    key_prefix: String,
    redis_ttl: Duration,
    /// Events a strategy has begun to handle.
    handled: Mutex<HashSet<String>>,
    /// Every message is acked: the consumers stop.
    done: CancellationToken,
}

impl Run {
    /// Notes that a strategy handles `event_id`; whether for the first time.
    fn handled(&self, event_id: &str) -> bool {
        self.handled
            .lock()
            .map(|mut handled| handled.insert(event_id.to_owned()))
            .unwrap_or(false)
    }
}

/// Holds the deliveries of an event where the strategy has decided the
/// event is new, until every copy has got there or been acked, or the
/// timeout passes (a copy blocked by a lock never gets there).
struct Gate {
    copies: usize,
    timeout: Duration,
    arrived: Mutex<HashMap<String, usize>>,
    changed: Notify,
}

impl Gate {
    fn new(copies: usize, timeout: Duration) -> Self {
        Self {
            copies,
            timeout,
            arrived: Mutex::new(HashMap::new()),
            changed: Notify::new(),
        }
    }

    /// Counts a copy of `event_id` as there.
    fn arrive(&self, event_id: &str) {
        if let Ok(mut arrived) = self.arrived.lock() {
            *arrived.entry(event_id.to_owned()).or_insert(0) += 1;
        }
        self.changed.notify_waiters();
    }

    fn all_there(&self, event_id: &str) -> bool {
        self.arrived
            .lock()
            .map(|arrived| arrived.get(event_id).copied().unwrap_or(0) >= self.copies)
            .unwrap_or(true)
    }

    async fn pass(&self, event_id: &str) {
        self.arrive(event_id);
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.all_there(event_id) {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return;
            }
        }
    }
}

/// One delivery as a strategy sees it: the event, and the lab's hands on
/// what happens between the strategy's steps.
pub(crate) struct Delivered<'a> {
    run: &'a Run,
    delivery: &'a Delivery,
    event: &'a PaymentSucceeded,
    /// The first time a strategy handles this event. Not the broker's
    /// `redelivered` flag: a message prefetched by a consumer that dies is
    /// redelivered without having been handled.
    first: bool,
    acked: AtomicBool,
    gated: AtomicBool,
}

impl Delivered<'_> {
    /// The first delivery of an event is the one the faults hit; its
    /// redelivery is what the strategy must get right.
    fn first(&self) -> bool {
        self.first
    }
}

impl Hands for Delivered<'_> {
    fn event_id(&self) -> &str {
        &self.event.event_id
    }

    fn order_id(&self) -> &str {
        &self.event.order_id
    }

    fn redis_key(&self) -> String {
        redis_key(&self.run.key_prefix, &self.event.event_id)
    }

    fn redis_ttl_ms(&self) -> u64 {
        u64::try_from(self.run.redis_ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// The strategy finished `step`: the consumer dies here if the fault says so.
    fn after(&self, step: Step) -> Result<(), Stop> {
        match self.run.fault {
            Fault::Killed(at) if at == step && self.first() => Err(Stop::Crash),
            _ => Ok(()),
        }
    }

    /// The strategy has decided the event is new and is about to act on it.
    fn gate(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(gate) = &self.run.gate
                && !self.gated.swap(true, Ordering::Relaxed)
            {
                gate.pass(&self.event.event_id).await;
            }
        })
    }

    /// Runs the points statement (or, under [`Fault::EffectFails`], one
    /// that fails); the rows it changed.
    fn effect<'a>(&'a self, on: On<'a, 'a>, effect: Effect) -> BoxFuture<'a, Result<u64, Stop>> {
        Box::pin(async move {
            let order = self.order_id();
            let points = &self.event.points;
            let (sql, params): (&str, Vec<&(dyn ToSql + Sync)>) = match &effect {
                _ if self.run.fault == Fault::EffectFails && self.first() => {
                    ("SELECT 1 / 0", vec![])
                }
                Effect::Add => (
                    "UPDATE points SET points = points + $2, version = version + 1 \
                     WHERE order_id = $1",
                    vec![&order, points],
                ),
                Effect::AddAt(version) => (
                    "UPDATE points SET points = points + $2, version = version + 1 \
                     WHERE order_id = $1 AND version = $3",
                    vec![&order, points, version],
                ),
            };
            let changed = match on {
                On::Session(client) => client.execute(sql, &params).await?,
                On::Tx(tx) => tx.execute(sql, &params).await?,
            };
            Ok(changed)
        })
    }

    /// Acks the delivery.
    fn ack(&self) -> BoxFuture<'_, Result<(), Stop>> {
        Box::pin(async move {
            self.delivery
                .ack(BasicAckOptions::default())
                .await
                .map_err(Stop::Broker)?;
            self.acked.store(true, Ordering::Relaxed);
            self.run.acked.send_modify(|n| *n += 1);
            Ok(())
        })
    }

    /// A version check failed.
    fn conflict(&self) {
        self.run.conflicts.fetch_add(1, Ordering::Relaxed);
    }
}

/// One consumer of a run; killed and started again as the fault says.
#[allow(non_camel_case_types)]
struct LabConsumer {
    run: Arc<Run>,
    connection: Arc<Connection>,
    pool: Pool,
    redis: redis::Client,
    queue: String,
    prefetch: u16,
}

impl LabConsumer {
    async fn consume(self) -> anyhow::Result<()> {
        while !self.run.done.is_cancelled() {
            let channel = self.connection.create_channel().await?;
            channel
                .basic_qos(self.prefetch, BasicQosOptions::default())
                .await?;
            let mut deliveries = channel
                .basic_consume(
                    self.queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let mut db = self.pool.get().await?;
            let mut redis = self.redis.get_multiplexed_async_connection().await?;
            let killed = self.serve(&mut deliveries, &mut db, &mut redis).await?;
            if killed {
                // As with kill -9: the session ends (PostgreSQL rolls back
                // what was not committed) and the broker takes back what
                // was not acked.
                drop(Object::take(db));
                self.run.kills.fetch_add(1, Ordering::Relaxed);
            }
            close_channel(&channel).await;
            // Only now: a consumer dropped on an open channel cancels
            // itself, and lapin fails the whole connection when the
            // cancel's answer meets a channel that is closing.
            drop(deliveries);
        }
        Ok(())
    }

    /// Handles deliveries until the run is done (false) or the fault kills
    /// this consumer (true).
    async fn serve(
        &self,
        deliveries: &mut lapin::Consumer,
        db: &mut Object,
        redis: &mut MultiplexedConnection,
    ) -> anyhow::Result<bool> {
        loop {
            let delivery = tokio::select! {
                () = self.run.done.cancelled() => return Ok(false),
                delivery = deliveries.next() => delivery,
            };
            let Some(delivery) = delivery else {
                bail!("the broker cancelled a lab consumer");
            };
            let delivery = delivery?;
            let event = PaymentSucceeded::parse(&delivery.data)
                .map_err(|e| anyhow::anyhow!("a lab message does not parse: {e}"))?;
            let delivered = Delivered {
                run: &self.run,
                delivery: &delivery,
                event: &event,
                first: self.run.handled(&event.event_id),
                acked: AtomicBool::new(false),
                gated: AtomicBool::new(false),
            };
            let client: &mut Client = db;
            match self.run.strategy.handle(client, redis, &delivered).await {
                Ok(()) => {}
                Err(Stop::Crash) => return Ok(true),
                Err(Stop::Failed(why)) => {
                    debug!(
                        strategy = self.run.strategy.slug(),
                        event.id = %event.event_id,
                        error = %why,
                        "the strategy failed on a delivery"
                    );
                    self.run.failures.fetch_add(1, Ordering::Relaxed);
                    if !delivered.acked.load(Ordering::Relaxed) {
                        delivery
                            .nack(BasicNackOptions {
                                requeue: true,
                                ..BasicNackOptions::default()
                            })
                            .await?;
                    }
                }
                Err(Stop::Broker(e)) => return Err(e.into()),
            }
            // A copy that was acked without reaching the gate will not.
            if let Some(gate) = &self.run.gate
                && delivered.acked.load(Ordering::Relaxed)
                && !delivered.gated.load(Ordering::Relaxed)
            {
                gate.arrive(&event.event_id);
            }
        }
    }
}
