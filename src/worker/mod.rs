//! The consume loop: take deliveries in batches, apply each batch in one
//! transaction on a pooled connection, settle with the broker after commit,
//! and shut down cleanly when told to.
//!
//! It knows no SQL (that is [`crate::store`]), no business type (that is
//! the [`Handler`]'s) and makes no ack decision of its own (that is
//! `process`).

mod config;
mod drain;
mod epochs;
mod forward;
mod health;
mod http;
mod intake;
mod order;
mod process;
mod release;
mod settle;
mod slots;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{DeliveryTag, FieldTable};
use lapin::{Channel, Connection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, debug, error, field, info, info_span, warn};

#[cfg(feature = "cli")]
pub(crate) use config::in_flight as transactions_in_flight;
pub use config::{
    ConfigError, MAX_CONSUMER_GROUP_CHARS, Mode, ParkedBounds, Tuning, WorkerConfig,
    check_consumer_group,
};
pub use epochs::EpochSettings;
pub(crate) use process::decode;
pub use stats::{Snapshot, Stats};

use crate::backoff::RECONNECT_PATIENCE;
use crate::broker::{
    ConnectError, ConnectionWatch, TopologyError, close, close_channel, connect_with_retry,
    declare_exchanges,
};
use crate::caught;
use crate::handler::Handler;
use crate::store::{
    Applier, DatabaseConfig, Filters, Lanes, ReadyError, Replication, Standbys, Store,
};
use crate::telemetry::trace;
use forward::{Copy, Forwarder};
use health::DatabaseHealth;
use intake::Intake;
use order::{HeldKeys, SlotKeys};
use process::Processor;
use settle::{Disposition, Settlement, Settler};

/// Why the worker stopped other than by being asked to.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The worker's settings cannot work together.
    #[error(transparent)]
    Settings(#[from] ConfigError),
    /// The database configuration is unusable.
    #[error(transparent)]
    Config(#[from] crate::store::ConfigError),
    /// The database refused us, stayed unreachable past the start-up
    /// timeout, or is not migrated.
    #[error(transparent)]
    Database(#[from] ReadyError),
    /// The broker refused us, or stayed unreachable past the start-up timeout.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The broker holds objects that disagree with idem's settings, or the
    /// user may not declare them.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The HTTP endpoints cannot listen where they were asked to.
    #[error("cannot serve the HTTP endpoints on {addr}: {source}")]
    Http {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// A worker of one handler: build it, keep its [`Stats`] if you want them,
/// then [`run`](Worker::run) it.
#[derive(Debug)]
pub struct Worker<H> {
    config: WorkerConfig,
    handler: H,
    stats: Arc<Stats>,
    /// Where a check stops this worker, when one armed it.
    probe: crate::probe::Armed,
}

/// How one connection's consumption ended.
enum SessionEnd {
    /// Shutdown: the consumer was cancelled and everything it took is settled.
    Drained,
    /// The connection or channel failed, or the broker cancelled the
    /// consumer; what was not acked comes back.
    Lost(String),
}

impl<H: Handler> Worker<H> {
    /// A worker applying `handler`'s effect, with fresh counters.
    pub fn new(config: WorkerConfig, handler: H) -> Self {
        let stats = Arc::new(Stats::new(&config.topology.queue, &config.consumer_group));
        Self {
            config,
            handler,
            stats,
            probe: None,
        }
    }

    /// The same worker, asking `probe` what to do before and after each
    /// commit: how a check ([`crate::check`]) kills it, cuts its
    /// connections or fails a transaction at a point of its choosing.
    #[doc(hidden)]
    pub fn probed(self, probe: Arc<dyn crate::probe::Probe>) -> Self {
        Self {
            probe: Some(probe),
            ..self
        }
    }

    /// The worker's counters, live.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.stats)
    }

    /// Consumes until `shutdown` fires, then stops taking deliveries, lets
    /// in-flight ones finish and be acked (for at most the shutdown
    /// timeout), closes the channel and the connection, and returns `Ok`.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        self.config.check()?;
        // Bound before anything else: a port taken is a mistake to say at once.
        let listener = match self.config.http_addr {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| WorkerError::Http { addr, source })?,
            ),
            None => None,
        };
        let store = self.store()?;
        let epochs_pool = epochs::pool(&self.config.database)?;
        match ready::<H>(&store, &self.config, &shutdown).await {
            Ok(()) => {}
            Err(ReadyError::Interrupted) => return Ok(()),
            Err(error) => return Err(error.into()),
        }
        if let Some(lanes) = store.lanes() {
            lanes.check().await;
        }
        let Self {
            config,
            handler,
            stats,
            probe,
        } = self;
        let health = DatabaseHealth::new();
        let endpoints = listener.map(|listener| {
            let probe = http::Probe {
                stats: Arc::clone(&stats),
                health: health.clone(),
                pool: store.pool().clone(),
            };
            tokio::spawn(http::serve(
                listener,
                probe,
                config.routes.clone(),
                shutdown.clone(),
            ))
        });
        let summary = tokio::spawn(summarize(
            Arc::clone(&stats),
            config.summary_interval,
            shutdown.clone(),
        ));
        // The filters stored already, before the first claim: without them
        // it would look into every closed epoch.
        epochs::load(&store, &epochs_pool, &config.epochs).await;
        let keeper = tokio::spawn(epochs::keep(
            store.clone(),
            epochs_pool,
            config.epochs,
            shutdown.clone(),
        ));
        let processor = Arc::new(Processor {
            applier: Applier::new(store, Arc::new(handler))?.probed(probe.clone()),
            max_body_bytes: config.max_body_bytes,
            parked_bounds: config.parked_bounds,
            health,
            stats: Arc::clone(&stats),
            topology: config.topology.clone(),
            probe,
            member: uuid::Uuid::from_u128(fastrand::u128(..)),
        });
        let relay = (H::SENDS_MESSAGES && config.relay)
            .then(|| start_relay(&config, stats.relay().clone()))
            .transpose()?;
        // An ordered queue's parked keys are applied beside the consumer.
        let drainer = config.topology.is_ordered().then(|| {
            tokio::spawn(drain::run(
                Arc::clone(&processor),
                config.amqp.clone(),
                shutdown.clone(),
            ))
        });
        let result = reconnecting(&config, &processor, &shutdown).await;
        if let Some(drainer) = drainer {
            drainer.abort();
        }
        if let Some(relay) = relay {
            relay.stop().await;
        }
        summary.abort();
        keeper.abort();
        if let Some(endpoints) = endpoints {
            endpoints.abort();
        }
        log_totals(&stats);
        result
    }

    /// The store the worker claims through: its pool, the closed epochs'
    /// filters, and the lanes of a handler with a tally.
    fn store(&self) -> Result<Store, WorkerError> {
        let pool = self.config.database.pool()?;
        let filters = Arc::new(Filters::new(self.stats.epochs().clone()));
        let mut store = Store::new(pool, self.config.consumer_group.clone())
            .with_filters(filters)
            .with_kept_body_bytes(self.config.kept_body_bytes);
        let standbys = (self.config.ack_after_standbys > 0).then(|| {
            Arc::new(Standbys::new(
                self.config.ack_after_standbys,
                self.config.database.statement_timeout,
            ))
        });
        if let Some(standbys) = &standbys {
            store = store.with_standbys(Arc::clone(standbys));
        }
        if self.config.lanes == 0 {
            return Ok(store);
        }
        let pool_of = |pool_size| {
            DatabaseConfig {
                pool_size,
                ..self.config.database.clone()
            }
            .pool()
        };
        let lanes = self.config.lanes;
        Ok(store.with_lanes(Lanes::new(pool_of(lanes)?, lanes, pool_of(1)?, standbys)))
    }
}

/// Waits until the database answers, is migrated for `H` and takes
/// writes, then says what a commit promises: a server without standbys (a
/// developer's, or a managed service's, which replicates out of sight) at
/// debug.
async fn ready<H: Handler>(
    store: &Store,
    config: &WorkerConfig,
    shutdown: &CancellationToken,
) -> Result<(), ReadyError> {
    let server = config.database.describe();
    let patience = config.startup_timeout;
    store
        .wait_until_ready::<H>(&server, patience, shutdown)
        .await?;
    store
        .wait_until_writable(&server, patience, shutdown)
        .await?;
    match store.replication().await {
        Some(replication @ Replication::Asynchronous { .. }) if store.standbys().is_none() => {
            warn!("PostgreSQL at {server}: {replication}");
        }
        Some(replication @ Replication::Synchronous { .. }) => {
            info!("PostgreSQL at {server}: {replication}");
        }
        // Said by `check_standbys`, which makes it safe.
        Some(Replication::Asynchronous { .. }) => {}
        Some(replication) => debug!("PostgreSQL at {server}: {replication}"),
        None => {}
    }
    store.check_standbys(&server, patience, shutdown).await
}

/// The totals of a worker that stopped; nothing for one that never
/// consumed, whose error is the one line to read.
fn log_totals(stats: &Stats) {
    let totals = stats.snapshot();
    if totals.sessions == 0 {
        return;
    }
    info!(
        applied = totals.applied,
        duplicates = totals.duplicates,
        invalid = totals.invalid,
        retried = totals.retried,
        dead_lettered = totals.dead_lettered,
        "worker stopped: applied {}, duplicates {}, invalid {}, retried {}, dead-lettered {}",
        totals.applied,
        totals.duplicates,
        totals.invalid,
        totals.retried,
        totals.dead_lettered
    );
}

/// A relay running beside the consumer, and what stops it.
struct RelayTask {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<crate::relay::RelayReport, crate::relay::RelayError>>,
}

impl RelayTask {
    /// Stops the relay once the consumer has drained (or failed): what the
    /// last batches wrote goes out now if the relay is quick, or with the
    /// next relay to run.
    async fn stop(self) {
        self.stop.cancel();
        match self.task.await {
            Ok(Ok(report)) => crate::relay::log_report(&report),
            Ok(Err(_)) => {}
            Err(error) => warn!(%error, "the relay failed"),
        }
    }
}

/// Starts a relay on a pool of its own (as many connections as its lanes
/// hold transactions), until its `stop` fires.
fn start_relay(
    config: &WorkerConfig,
    counters: crate::relay::RelayCounters,
) -> Result<RelayTask, WorkerError> {
    let mut relay = crate::relay::RelayConfig::new(config.amqp.clone(), config.startup_timeout);
    relay.outgoing.clone_from(&config.outgoing);
    let pool = DatabaseConfig {
        pool_size: relay.connections(),
        ..config.database.clone()
    }
    .pool()?;
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        let relayed = crate::relay::run(&pool, &relay, &counters, &token).await;
        // Said when it happens: the consumer goes on, and what it sends
        // waits in the outbox for a relay.
        if let Err(error) = &relayed {
            error!(%error, "the relay stopped: outgoing messages wait in the outbox until a relay runs");
        }
        relayed
    });
    Ok(RelayTask { stop, task })
}

/// Connects, consumes, and after each lost connection connects again, until
/// shutdown drains a session.
async fn reconnecting<H: Handler>(
    config: &WorkerConfig,
    processor: &Arc<Processor<H>>,
    shutdown: &CancellationToken,
) -> Result<(), WorkerError> {
    let stats = &processor.stats;
    // After the first connection, a lost one is retried for as long as it takes.
    let mut patience = config.startup_timeout;
    let mut pause = Pause::default();
    loop {
        let connection =
            match connect_with_retry(&config.amqp, "idem worker", patience, shutdown).await {
                Ok(connection) => connection,
                Err(ConnectError::Interrupted) => return Ok(()),
                Err(error) => return Err(error.into()),
            };
        patience = RECONNECT_PATIENCE;
        let started = Instant::now();
        // Shared with the session's batches, which open fresh channels on
        // it when the broker nacks their copies.
        let connection = Arc::new(connection);
        let end = session(config, &connection, processor, shutdown).await;
        close(&connection).await;
        match end? {
            SessionEnd::Drained => return Ok(()),
            SessionEnd::Lost(reason) => {
                stats.reconnects(1);
                let wait = pause.after(started.elapsed());
                warn!(%reason, "lost the connection to RabbitMQ: reconnecting in {:.1}s", wait.as_secs_f64());
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = shutdown.cancelled() => return Ok(()),
                }
            }
        }
    }
}

/// Logs, every `interval`, what the worker did since the last line.
async fn summarize(stats: Arc<Stats>, interval: Duration, shutdown: CancellationToken) {
    if interval.is_zero() {
        return;
    }
    let mut last = stats.snapshot();
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = shutdown.cancelled() => return,
        }
        let now = stats.snapshot();
        let finished = now.finished() - last.finished();
        // Counted as the final line and the metrics count them: invalid
        // messages apart from those that spent their attempts.
        info!(
            applied = now.applied - last.applied,
            duplicates = now.duplicates - last.duplicates,
            invalid = now.invalid - last.invalid,
            dead_lettered = now.dead_lettered - last.dead_lettered,
            retried = now.retried - last.retried,
            "in the last {}: applied {}, duplicates {}, invalid {}, dead-lettered {}, retried {} ({:.0} messages/s)",
            crate::duration::format(interval),
            now.applied - last.applied,
            now.duplicates - last.duplicates,
            now.invalid - last.invalid,
            now.dead_lettered - last.dead_lettered,
            now.retried - last.retried,
            finished as f64 / interval.as_secs_f64()
        );
        last = now;
    }
}

/// Declares and consumes on one connection until it fails, or until
/// shutdown drains it (or its deadline passes).
async fn session<H: Handler>(
    config: &WorkerConfig,
    connection: &Arc<Connection>,
    processor: &Arc<Processor<H>>,
    shutdown: &CancellationToken,
) -> Result<SessionEnd, WorkerError> {
    // The topology first, and only then the watch: comparing a queue's
    // arguments can cost a channel the broker closes (an older idem's
    // queue), and a watch listening then would take that for a lost
    // connection. Unwatched, lapin drops those errors; by the time
    // `declare` returns, it has dropped all of them.
    let declared = async {
        config.topology.declare(connection).await?;
        declare_exchanges(connection, &config.outgoing).await
    };
    match declared.await {
        Ok(()) => {}
        Err(error) if error.needs_an_operator() => {
            return Err(error.into());
        }
        Err(error) => return Ok(SessionEnd::Lost(error.to_string())),
    }
    let watch = ConnectionWatch::start(connection, "consuming");
    let lost = watch.lost();
    let Channels {
        consume: channel,
        waits,
        forwarder,
    } = match open_channels(connection, config, &processor.stats).await {
        Ok(channels) => channels,
        Err(error) => return Ok(SessionEnd::Lost(error.to_string())),
    };
    let deadline = async {
        shutdown.cancelled().await;
        tokio::time::sleep(config.shutdown_timeout).await;
    };
    let consuming = async {
        if config.topology.is_ordered() {
            slots::consume(config, connection, &forwarder, processor, &watch, shutdown).await
        } else {
            let source = Source {
                queue: &config.topology.queue,
                permits: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
                hand_over: None,
            };
            consume(
                config, source, &channel, &forwarder, processor, lost, shutdown,
            )
            .await
        }
    };
    let end = tokio::select! {
        end = consuming => end,
        reason = release::run(&waits, &forwarder, &config.topology, shutdown) => {
            SessionEnd::Lost(reason)
        }
        () = deadline => {
            warn!("shutdown timeout reached: closing with deliveries in flight; the broker redelivers them");
            SessionEnd::Drained
        }
    };
    if let SessionEnd::Drained = end {
        close_channel(&channel).await;
        close_channel(&waits).await;
        close_channel(forwarder.channel().await.channel()).await;
    }
    Ok(end)
}

/// Consumes and settles on one channel until it fails (`lost` resolves, or
/// the consumer errs), or until shutdown cancels the consumer and everything
/// taken is settled.
/// The span of a batch, following the trace context its messages carry.
fn batch_span(config: &WorkerConfig, batch: &[Delivery]) -> Span {
    let span = info_span!(
        "batch",
        delivery.first_tag = batch[0].delivery_tag,
        batch.size = batch.len(),
        otel.name = field::Empty,
        otel.kind = field::Empty,
    );
    if trace::on() {
        trace::follow(
            &span,
            config.topology.queue.as_str(),
            &config.consumer_group,
            batch.iter().map(|d| d.properties.headers().as_ref()),
        );
    }
    span
}

/// A batch's place among the transactions in flight: its permit, its
/// count in flight until done, and, from a slot, the keys it holds.
struct Place {
    permit: OwnedSemaphorePermit,
    counted: InFlight,
    held: Option<HeldKeys>,
}

/// Processes `batch` (taken from `queue`) in its `place`, sends the copies
/// it decided on (to wait, to die), and hands every settlement to
/// `settler`; a panic gives the batch back.
async fn settle_batch<H: Handler>(
    processor: Arc<Processor<H>>,
    forwarder: Arc<Forwarder>,
    settler: Settler,
    batch: Vec<Delivery>,
    place: Place,
    queue: Arc<str>,
) {
    let tags: Vec<DeliveryTag> = batch.iter().map(|d| d.delivery_tag).collect();
    let Place {
        permit,
        counted: _counted,
        held,
    } = place;
    let mut permit = Some(permit);
    // The transaction's and the wait's futures are several kilobytes:
    // boxed, they are built once the task runs, and the task moved into
    // the runtime stays small. Unboxed, the copies cost per-message mode
    // about a tenth more worker CPU per message (`idem bench`).
    let keys = held.as_ref().map(HeldKeys::slot);
    let processing = Box::pin(processor.process(batch, &queue, keys, &mut permit));
    let settlements = match caught::future(processing).await {
        Ok(mut decided) => {
            if !decided.waiting.is_empty() || !decided.dead.is_empty() {
                let topology = &processor.topology;
                let waiting = std::mem::take(&mut decided.waiting)
                    .into_iter()
                    .map(|waiting| Copy::to_wait(topology, waiting));
                let dead = std::mem::take(&mut decided.dead)
                    .into_iter()
                    .map(|dying| Copy::to_die(topology, &decided.queue, dying));
                let copies = waiting.chain(dead).collect();
                let sent = Box::pin(forward::send(&forwarder, copies));
                decided.settlements.extend(sent.await);
            }
            decided.settlements
        }
        Err(panic) => given_back(&processor.stats, tags, &panic),
    };
    settler.settle(settlements);
    drop(permit);
    drop(held);
}

/// What one consumer takes from, and how it stops.
struct Source<'a> {
    /// The work queue, or a slot of an ordered queue.
    queue: &'a str,
    /// Its places among the transactions in flight (the slots of an
    /// ordered queue share theirs).
    permits: Arc<Semaphore>,
    /// For a slot: fired to hand the slot over (or at shutdown). The
    /// consumer is not cancelled, which would make the slot's next consumer
    /// active while this one still holds deliveries of its keys: it stops
    /// taking, finishes its batches in flight, and the caller closes the
    /// channel, which gives what it took and did not start back to the
    /// slot, ahead of the rest.
    hand_over: Option<CancellationToken>,
}

/// Consumes `source` until its channel or connection fails, or until it
/// is told to stop (shutdown; a slot's hand-over) and has settled what it
/// took.
async fn consume<H: Handler>(
    config: &WorkerConfig,
    source: Source<'_>,
    channel: &Channel,
    forwarder: &Arc<Forwarder>,
    processor: &Arc<Processor<H>>,
    lost: impl Future<Output = String>,
    shutdown: &CancellationToken,
) -> SessionEnd {
    let Source {
        queue,
        permits,
        hand_over,
    } = source;
    let mut lost = std::pin::pin!(lost);
    // A slot's consumer is one of the session's: the slots count it.
    let slot = hand_over.is_some();
    let consumer = match subscribe(config, queue, channel, &processor.stats, !slot).await {
        Ok(consumer) => consumer,
        Err(error) => return SessionEnd::Lost(error.to_string()),
    };
    let canceller = hand_over
        .is_none()
        .then(|| tokio::spawn(cancel_on(shutdown.clone(), channel.clone(), consumer.tag())));
    let hand_over = hand_over.unwrap_or_default();
    let (settler, settled) = Settler::spawn(channel.clone(), Arc::clone(&processor.stats));
    let keys = slot.then(|| Arc::new(SlotKeys::default()));
    let queue: Arc<str> = Arc::from(queue);
    let mut in_flight = JoinSet::new();
    let mut intake = Intake::new(consumer, config.batch_size, config.batch_wait);
    let end = loop {
        let next = tokio::select! {
            biased;
            () = hand_over.cancelled() => break SessionEnd::Drained,
            next = intake.next_batch() => next,
        };
        let batch = match next {
            Ok(Some(batch)) => batch,
            Ok(None) if shutdown.is_cancelled() => break SessionEnd::Drained,
            // The broker cancelled us (the queue was deleted, say): start over.
            Ok(None) => break SessionEnd::Lost("the broker cancelled the consumer".into()),
            Err(error) => break SessionEnd::Lost(error.to_string()),
        };
        // Waiting for the database, or for a batch to finish, is also
        // watching the broker: a connection lost meanwhile ends the session
        // now, not once the database is back.
        let held = match &keys {
            Some(keys) => tokio::select! {
                held = keys.hold(&batch) => Some(held),
                reason = &mut lost => break SessionEnd::Lost(reason),
            },
            None => None,
        };
        let permit = tokio::select! {
            permit = async {
                processor.health.wait_up().await;
                Arc::clone(&permits).acquire_owned().await
            } => permit,
            reason = &mut lost => break SessionEnd::Lost(reason),
        };
        let Ok(permit) = permit else {
            unreachable!("the semaphore is never closed");
        };
        settler.track(batch.iter().map(|d| d.delivery_tag).collect());

        let span = batch_span(config, &batch);
        let place = Place {
            permit,
            counted: InFlight::start(Arc::clone(&processor.stats)),
            held,
        };
        in_flight.spawn(
            settle_batch(
                Arc::clone(processor),
                Arc::clone(forwarder),
                settler.clone(),
                batch,
                place,
                Arc::clone(&queue),
            )
            .instrument(span),
        );
        while in_flight.try_join_next().is_some() {}
    };
    if let Some(canceller) = canceller {
        canceller.abort();
    }
    if !slot {
        processor.stats.consuming(false);
    }
    if let SessionEnd::Drained = end {
        while in_flight.join_next().await.is_some() {}
        drop(settler);
        let _ = settled.await;
    }
    end
}

/// Registers a consumer of `queue` on `channel`, counted as a session
/// consuming when `counted`, and says so.
async fn subscribe(
    config: &WorkerConfig,
    queue: &str,
    channel: &Channel,
    stats: &Stats,
    counted: bool,
) -> lapin::Result<lapin::Consumer> {
    let consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    if counted {
        stats.sessions(1);
        stats.consuming(true);
    }
    info!(
        queue,
        consumer_group = %config.consumer_group,
        prefetch = config.prefetch,
        batch_size = config.batch_size,
        "consuming"
    );
    Ok(consumer)
}

/// One transaction in flight, counted until its task ends or is dropped.
struct InFlight(Arc<Stats>);

impl InFlight {
    fn start(stats: Arc<Stats>) -> Self {
        stats.in_flight(1);
        Self(stats)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight(-1);
    }
}

/// What becomes of a batch whose processing panicked outside the handler's
/// transaction (where a panic is a failure of its message): no one knows
/// which delivery did it, so each goes back to the broker, whose delivery
/// limit is the backstop for a message that keeps crashing idem. Settling
/// them keeps the settler from waiting on them for ever.
fn given_back(stats: &Stats, tags: Vec<DeliveryTag>, panic: &caught::Panic) -> Vec<Settlement> {
    error!(%panic, batch.size = tags.len(), "processing a batch panicked: returning its deliveries to the broker");
    stats.retried(tags.len() as u64, Duration::ZERO);
    tags.into_iter()
        .map(|tag| Settlement {
            tag,
            disposition: Disposition::Retry,
        })
        .collect()
}

/// The wait before reconnecting: short after a session that ran a while,
/// growing while sessions keep failing quickly.
#[derive(Debug, Default)]
struct Pause {
    quick_failures: u32,
}

impl Pause {
    fn after(&mut self, session_lasted: Duration) -> Duration {
        if session_lasted > Duration::from_secs(30) {
            self.quick_failures = 0;
        }
        let base = Duration::from_millis(100) * 2u32.pow(self.quick_failures.min(6));
        self.quick_failures += 1;
        let base = base.min(Duration::from_secs(5));
        // Jitter: half of it fixed, half random.
        base / 2 + base.mul_f64(fastrand::f64() / 2.0)
    }
}

/// The channels of a session.
struct Channels {
    /// Consumes the work queue, with the prefetch set.
    consume: Channel,
    /// Consumes the wait queues, taking each message out once it is due.
    waits: Channel,
    /// In confirm mode: failed messages to wait, dead ones to the
    /// dead-letter exchange, due ones back to the work queue.
    forwarder: Arc<Forwarder>,
}

async fn open_channels(
    connection: &Arc<Connection>,
    config: &WorkerConfig,
    stats: &Stats,
) -> lapin::Result<Channels> {
    let consume = connection.create_channel().await?;
    consume
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await?;
    let waits = connection.create_channel().await?;
    waits
        .basic_qos(release::PREFETCH, BasicQosOptions::default())
        .await?;
    let forwarder =
        Arc::new(Forwarder::open(Arc::clone(connection), stats.copies_nacked().clone()).await?);
    Ok(Channels {
        consume,
        waits,
        forwarder,
    })
}

/// Cancels the consumer once `shutdown` fires: the broker stops sending, and
/// the consumer's stream ends after what it already buffered.
async fn cancel_on(
    shutdown: CancellationToken,
    channel: Channel,
    consumer_tag: lapin::types::ShortString,
) {
    shutdown.cancelled().await;
    info!("shutdown requested: no new deliveries; finishing those in flight");
    if let Err(error) = channel
        .basic_cancel(consumer_tag, BasicCancelOptions::default())
        .await
    {
        warn!(%error, "could not cancel the consumer");
    }
}
