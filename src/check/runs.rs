//! The runs of a check on the real worker: the handler's events through
//! workers in batch and per-message mode, each on a schema and queues of
//! its own; several copies of every event at once to two workers; a worker
//! killed at a chosen point; its database or broker connection cut
//! mid-batch; copies that come after their event was applied, and dead
//! letters replayed once their cause is gone; another order.
//!
//! Workers run in this process, each behind TCP proxies of its own: to
//! kill one, the check severs its proxies, which the servers see as a
//! client that died (PostgreSQL rolls back what it had not committed,
//! RabbitMQ takes back what it had not acked), and drops its tasks. The
//! worker's [`Probe`] says when.
//!
//! Over 700 lines: the runs share their rig (the scratch schemas, the
//! proxies, the probe) and read best beside each other.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Connection;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::CheckError;
use super::scratch::Scratch;
use crate::broker::{AmqpConfig, Topology, close_channel, queue_counts};
use crate::dlq::{self, Action, DlqConfig};
use crate::handler::{FailureKind, Handler};
use crate::probe::{Point, Probe, Verdict};
use crate::retry::RetryPolicy;
use crate::target::Target;
use crate::trial::proxy::Proxy;
use crate::trial::{Load, Repeats};
use crate::worker::{Mode, Stats, Worker, WorkerConfig, WorkerError};

/// What a run does to its workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Nothing.
    None,
    /// A worker dies at this moment, the next one finishes.
    Kill(Moment),
    /// The database connection is cut before a commit.
    CutDatabase,
    /// The database connection is cut with the commit in flight: it
    /// reached the server, whose answer never comes back.
    CutCommit,
    /// The broker connection is cut after a commit, before the acks.
    CutBroker,
    /// Some events fail for a cause that is then fixed; copies of the
    /// others come after they were applied; the dead letters are replayed.
    Replay,
    /// Some events fail their first attempt alone (a batch that holds one
    /// is made to fail, so that it goes alone), then apply on a retry.
    FailOnce,
}

/// Where a worker is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moment {
    /// After the handler's statements, before the commit.
    BeforeCommit,
    /// After the commit, before the acks.
    AfterCommit,
    /// A batch failed whole and its events are being applied one by one:
    /// after the first of those commits, before the others.
    MidBatch,
}

/// One run: how the events are sent, to how many workers, and what
/// happens to them.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// Its name in the report.
    pub(crate) name: String,
    /// Where its schema and queues are named from.
    pub(crate) slug: String,
    /// How the workers group deliveries into transactions.
    pub(crate) mode: Mode,
    /// How often each message is sent, to how many workers at once (each
    /// with a handler of its own).
    pub(crate) load: Load,
    /// What happens to the workers on the way.
    pub(crate) fault: Fault,
    /// The bodies in an order drawn from the seed rather than the file's.
    pub(crate) shuffled: bool,
    /// Deliveries per batch, in batch mode.
    pub(crate) batch_size: usize,
    /// The slots of its ordered queue (each event published with its
    /// ordering key); 0 for an unordered one.
    pub(crate) slots: u16,
}

/// How many times a run's fault strikes.
pub(crate) const STRIKES: usize = 3;

/// The slots of an ordered run's queue.
pub(crate) const ORDERED_SLOTS: u16 = 4;

/// Every run, in the order of the report: `copies` at once in the copies
/// runs, batches of `batch_size`, orders drawn from `seed`; with
/// `ordered` (the handler names keys), the runs on an ordered queue too.
pub(crate) fn plans(copies: usize, batch_size: usize, seed: u64, ordered: bool) -> Vec<Plan> {
    const BOTH: &[Mode] = &[Mode::Batch, Mode::PerMessage];
    const BATCH: &[Mode] = &[Mode::Batch];
    let copies_at_once = format!("{copies} copies at once");
    // Name, slug, modes, fault, workers, copies of each message.
    type Run<'a> = (&'a str, &'a str, &'a [Mode], Fault, usize, usize);
    #[rustfmt::skip]
    let runs: [Run<'_>; 10] = [
        ("2 workers sharing the load", "shared", BOTH, Fault::None, 2, 1),
        (&copies_at_once, "copies", BOTH, Fault::None, 2, copies),
        ("killed before commit", "killed_before", BOTH, Fault::Kill(Moment::BeforeCommit), 1, 1),
        ("killed after commit", "killed_after", BOTH, Fault::Kill(Moment::AfterCommit), 1, 1),
        ("killed mid-batch", "killed_mid", BATCH, Fault::Kill(Moment::MidBatch), 1, 1),
        ("database cut", "database", BOTH, Fault::CutDatabase, 1, 1),
        ("database cut, commit in flight", "commit", BOTH, Fault::CutCommit, 1, 1),
        ("broker cut before the acks", "broker", BOTH, Fault::CutBroker, 1, 1),
        ("late copies, replayed dead letters", "replay", BATCH, Fault::Replay, 1, 1),
        ("another order, batches of 7", "order", BATCH, Fault::None, 1, 1),
    ];
    // Where a key's order can break: workers sharing the slots, a worker
    // killed and its slots taken over, heads that fail (retried while
    // their keys are parked, then dead-lettered and replayed).
    #[rustfmt::skip]
    let ordered_runs: [Run<'_>; 4] = [
        ("ordered: 2 workers on the slots", "ordered_shared", BOTH, Fault::None, 2, 1),
        ("ordered: killed, slots taken over", "ordered_killed", BATCH, Fault::Kill(Moment::AfterCommit), 2, 1),
        ("ordered: heads failed, replayed", "ordered_replay", BATCH, Fault::Replay, 1, 1),
        ("ordered: heads failing once", "ordered_retried", BOTH, Fault::FailOnce, 1, 1),
    ];
    let ordered_runs = if ordered { &ordered_runs[..] } else { &[] };
    let mut plans = Vec::new();
    let unordered = runs.iter().map(|run| (run, 0));
    let ordered = ordered_runs.iter().map(|run| (run, ORDERED_SLOTS));
    for (&(name, slug, modes, fault, workers, copies), slots) in unordered.chain(ordered) {
        for &mode in modes {
            plans.push(Plan {
                name: format!("{name} · {}", mode_name(mode)),
                slug: format!("{slug}_{}", mode_name(mode).replace(' ', "_")),
                mode,
                load: Load {
                    repeats: Repeats {
                        copies,
                        ..Repeats::once(seed)
                    },
                    consumers: workers,
                },
                fault,
                shuffled: false,
                batch_size,
                slots,
            });
        }
    }
    if let Some(order) = plans.iter_mut().find(|plan| plan.slug == "order_batch") {
        order.shuffled = true;
        order.batch_size = 7;
    }
    plans
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Batch => "batch",
        Mode::PerMessage => "per message",
    }
}

/// What the runs share: where the servers are, the handler, the events.
pub(crate) struct Rig<'a, F> {
    /// The broker, straight (publishing, counting, replaying).
    pub(crate) amqp: &'a AmqpConfig,
    /// The servers' addresses, for the workers' proxies.
    pub(crate) upstream: Upstream,
    pub(crate) connection: &'a Connection,
    pub(crate) make: &'a F,
    pub(crate) consumer_group: &'a str,
    /// Start of every queue's name.
    pub(crate) prefix: &'a str,
    /// Every body of the file, in the order the runs publish them: those
    /// of events that name a same row side by side (`collide`).
    pub(crate) bodies: &'a [Vec<u8>],
    /// Distinct valid events: their ids and a body of each.
    pub(crate) events: &'a [(String, Vec<u8>)],
    /// The ordering key of each body that decodes to an event with one.
    pub(crate) keys: &'a HashMap<Vec<u8>, String>,
    /// The distinct valid events with a key, in the file's order: each
    /// key and event id.
    pub(crate) keyed: &'a [(&'a str, &'a str)],
    pub(crate) max_attempts: u32,
    pub(crate) seed: u64,
    /// How long a run may take to settle.
    pub(crate) patience: Duration,
}

/// The servers behind the proxies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Upstream {
    pub(crate) database: SocketAddr,
    pub(crate) broker: SocketAddr,
}

/// What a run left, to be judged.
#[derive(Debug)]
pub(crate) struct Ran {
    /// Deliveries acked without effect, by every worker of the run.
    pub(crate) duplicates: u64,
    /// Transactions run again because the database refused them for a
    /// while (a deadlock, a lock timeout, a connection the run cut).
    pub(crate) retried: u64,
    /// Workers killed, connections cut, transactions failed on purpose.
    pub(crate) strikes: usize,
}

/// The topology of the run `plan`, its names starting with `prefix`:
/// queues of its own (its slots, when ordered), retries at once (no wait
/// queue), one replica. The worker's attempts are set apart, per run.
pub(crate) fn topology(prefix: &str, plan: &Plan) -> Topology {
    let name = format!("{prefix}.{}", plan.slug);
    Topology {
        retry: RetryPolicy::at_once(RetryPolicy::DEFAULT_ATTEMPTS),
        quorum_size: 1,
        ..Topology::for_queue(&name)
            .bound_to(&format!("{name}.events"), "event")
            .ordered(plan.slots)
    }
}

/// Deletes the queues and exchanges of every run whose names start with
/// `prefix`, those of runs that did not finish among them.
pub(crate) async fn remove(connection: &Connection, prefix: &str) -> Result<(), CheckError> {
    let channel = connection.create_channel().await.map_err(broker)?;
    for plan in plans(2, 2, 0, true) {
        topology(prefix, &plan)
            .delete(&channel)
            .await
            .map_err(broker)?;
    }
    close_channel(&channel).await;
    Ok(())
}

impl<G: Handler, F: Fn() -> G + Send + Sync> Rig<'_, F> {
    /// Runs `plan` on `scratch` (made for it) and waits until everything
    /// sent is settled.
    pub(crate) async fn run(&self, plan: &Plan, scratch: &Scratch) -> Result<Ran, CheckError> {
        let topology = topology(self.prefix, plan);
        let channel = self.connection.create_channel().await.map_err(broker)?;
        topology.delete(&channel).await.map_err(broker)?;
        close_channel(&channel).await;
        topology
            .declare(self.connection)
            .await
            .map_err(|error| CheckError::Failed(error.into()))?;
        let (kills, killed) = mpsc::unbounded_channel();
        let chosen: HashSet<String> = match plan.fault {
            Fault::Replay | Fault::FailOnce => self
                .events
                .iter()
                .step_by(20)
                .map(|(id, _)| id.clone())
                .collect(),
            _ => HashSet::new(),
        };
        let shared = Arc::new(Shared {
            fault: plan.fault,
            kills,
            chosen,
            armed: AtomicBool::new(matches!(plan.fault, Fault::Replay | Fault::FailOnce)),
            state: Mutex::default(),
        });
        let mut crew = Crew {
            rig: self,
            plan,
            scratch,
            topology: &topology,
            shared: Arc::clone(&shared),
            killed,
            alive: Vec::new(),
            every: Vec::new(),
            started: 0,
        };
        let bodies = self.load(plan);
        let ran = async {
            crew.settle_after(&bodies).await?;
            if plan.fault == Fault::Replay {
                let late: Vec<Vec<u8>> = self
                    .events
                    .iter()
                    .filter(|(id, _)| !shared.chosen.contains(id))
                    .map(|(_, body)| body.clone())
                    .collect();
                crew.settle_after(&late).await?;
                shared.armed.store(false, Ordering::Relaxed);
                self.replay(scratch, &topology).await?;
                crew.settle_after(&[]).await?;
            }
            Ok::<_, CheckError>(())
        }
        .await;
        crew.stop().await;
        let channel = self.connection.create_channel().await.map_err(broker)?;
        let deleted = topology.delete(&channel).await.map_err(broker);
        close_channel(&channel).await;
        ran?;
        deleted?;
        let snapshots: Vec<_> = crew
            .every
            .iter()
            .map(|(stats, killed)| (stats.snapshot(), *killed))
            .collect();
        let strikes = shared.state.lock().map_or(0, |state| state.strikes);
        Ok(Ran {
            duplicates: snapshots.iter().map(|(s, _)| s.duplicates).sum(),
            // A worker being killed fails what it had in flight: no
            // sign of the handler's.
            retried: snapshots
                .iter()
                .filter(|(_, killed)| !killed)
                .map(|(s, _)| s.infrastructure_retries)
                .sum(),
            strikes,
        })
    }

    /// The bodies of `plan`, in its order, each as often as it says.
    fn load(&self, plan: &Plan) -> Vec<Vec<u8>> {
        let mut bodies = self.bodies.to_vec();
        if plan.shuffled {
            fastrand::Rng::with_seed(self.seed).shuffle(&mut bodies);
        }
        plan.load.repeats.of(&bodies)
    }

    /// Replays every dead letter of the run (bodies that can never decode
    /// aside), as `dlq replay` does.
    async fn replay(&self, scratch: &Scratch, topology: &Topology) -> Result<(), CheckError> {
        let config = DlqConfig::new(Target::new(
            self.amqp.clone(),
            scratch.database.clone(),
            topology.clone(),
            self.consumer_group,
            self.patience,
        ));
        let action = Action::Replay {
            rate: None,
            include_invalid: false,
        };
        let report = dlq::run(&config, &action, &(self.make)(), &CancellationToken::new())
            .await
            .map_err(|error| CheckError::Failed(error.into()))?;
        if !report.succeeded() {
            return Err(CheckError::Failed(
                format!(
                    "the replay left {} dead letters unreplayed",
                    report.failed.len()
                )
                .into(),
            ));
        }
        Ok(())
    }
}

fn broker(error: lapin::Error) -> CheckError {
    CheckError::Failed(format!("RabbitMQ: {error}").into())
}

/// The workers of one run, each behind proxies of its own.
struct Crew<'a, 'r, F> {
    rig: &'a Rig<'r, F>,
    plan: &'a Plan,
    scratch: &'a Scratch,
    topology: &'a Topology,
    shared: Arc<Shared>,
    /// Which worker a probe wants killed.
    killed: mpsc::UnboundedReceiver<usize>,
    alive: Vec<Incarnation>,
    /// The counters of every worker the run started, and whether it was
    /// killed.
    every: Vec<(Arc<Stats>, bool)>,
    /// Workers started so far: the next one's number.
    started: usize,
}

/// One worker, as long as it lives.
struct Incarnation {
    id: usize,
    task: JoinHandle<Result<(), WorkerError>>,
    shutdown: CancellationToken,
    stats: Arc<Stats>,
    database: Arc<Proxy>,
    broker: Arc<Proxy>,
}

/// A worker left behind (a check interrupted) dies with its handle.
impl Drop for Incarnation {
    fn drop(&mut self) {
        self.task.abort();
        self.shutdown.cancel();
    }
}

/// How long a worker may take to drain once asked to stop.
const DRAIN: Duration = Duration::from_secs(10);

/// How often a run's progress is looked at.
const POLL: Duration = Duration::from_millis(50);

impl<G: Handler, F: Fn() -> G + Send + Sync> Crew<'_, '_, F> {
    /// Starts the run's workers, publishes `bodies` once they consume,
    /// and waits until every event is applied or dead-lettered, nothing is
    /// left in the work queue and every worker stopped.
    async fn settle_after(&mut self, bodies: &[Vec<u8>]) -> Result<(), CheckError> {
        for _ in 0..self.plan.load.consumers {
            self.start().await?;
        }
        self.until_consuming().await?;
        crate::trial::publish_keyed(
            self.rig.amqp,
            &self.topology.exchange,
            &self.topology.routing_key,
            bodies,
            |body| self.rig.keys.get(body).cloned(),
            self.rig.patience,
        )
        .await
        .map_err(|error| CheckError::Failed(error.into()))?;
        let deadline = Instant::now() + self.rig.patience;
        loop {
            tokio::select! {
                Some(id) = self.killed.recv() => {
                    self.kill(id);
                    self.start().await?;
                    continue;
                }
                () = tokio::time::sleep(POLL) => {}
            }
            if Instant::now() > deadline {
                return Err(CheckError::Failed(
                    format!(
                        "the run did not settle within {}: {}",
                        crate::duration::format(self.rig.patience),
                        self.progress().await
                    )
                    .into(),
                ));
            }
            if !self.looks_done().await? {
                continue;
            }
            // Stopped, a worker holds nothing: what is still in the queue
            // is exactly what is left to do.
            self.stop().await;
            if self.ready().await? == 0 {
                return Ok(());
            }
            for _ in 0..self.plan.load.consumers {
                self.start().await?;
            }
        }
    }

    /// Every worker idle, the work queue empty, every event applied or
    /// dead-lettered.
    async fn looks_done(&self) -> Result<bool, CheckError> {
        if !self.alive.iter().all(|worker| worker.stats.is_idle()) || self.ready().await? > 0 {
            return Ok(false);
        }
        let (settled, events) = self.settled().await?;
        Ok(settled == events)
    }

    /// Events applied, dead-lettered or parked behind a dead letter (on an
    /// ordered queue, until a replay), of how many.
    async fn settled(&self) -> Result<(usize, usize), CheckError> {
        let ids: Vec<&str> = self.rig.events.iter().map(|(id, _)| id.as_str()).collect();
        let client = self
            .scratch
            .pool
            .get()
            .await
            .map_err(|error| CheckError::Failed(error.into()))?;
        let fates = super::fates_of(&client, self.rig.consumer_group, &ids).await?;
        let behind_dead: HashSet<String> = if self.topology.is_ordered() {
            client
                .query(
                    "SELECT event.event_id::text FROM mq_parked_event AS event \
                     JOIN mq_parked_key AS key USING (consumer_group, ordering_key) \
                     WHERE event.consumer_group = $1 AND key.head_dead",
                    &[&self.rig.consumer_group],
                )
                .await
                .and_then(|rows| rows.iter().map(|row| row.try_get(0)).collect())
                .map_err(|error| CheckError::database("reading the parked events", &error))?
        } else {
            HashSet::new()
        };
        // Each event once, though a dead head is parked too.
        let settled = ids
            .iter()
            .filter(|id| {
                fates.applied.contains(**id)
                    || fates.dead.contains_key(**id)
                    || behind_dead.contains(**id)
            })
            .count();
        Ok((settled, ids.len()))
    }

    /// Where a run that did not settle stands, for its error.
    async fn progress(&self) -> String {
        let settled = match self.settled().await {
            Ok((settled, events)) => {
                format!("{settled} of {events} events applied or dead-lettered")
            }
            Err(error) => error.to_string(),
        };
        let ready = self
            .ready()
            .await
            .map_or_else(|error| error.to_string(), |ready| ready.to_string());
        format!("{settled}, {ready} messages ready in the work queue")
    }

    /// Messages ready in the queues the workers consume (the work queue,
    /// or its slots).
    async fn ready(&self) -> Result<u32, CheckError> {
        Ok(self.counts().await?.iter().map(|(ready, _)| ready).sum())
    }

    /// Messages ready and consumers of each queue the workers consume.
    async fn counts(&self) -> Result<Vec<(u32, u32)>, CheckError> {
        let channel = self.rig.connection.create_channel().await.map_err(broker)?;
        let mut counts = Vec::new();
        for queue in self.topology.consumed_queues() {
            match queue_counts(&channel, &queue).await {
                Ok(count) => counts.push(count),
                Err(error) => {
                    close_channel(&channel).await;
                    return Err(broker(error));
                }
            }
        }
        close_channel(&channel).await;
        Ok(counts)
    }

    /// Waits until the work queue has as many consumers as workers alive
    /// (an ordered queue: until each slot has one).
    async fn until_consuming(&self) -> Result<(), CheckError> {
        let deadline = Instant::now() + self.rig.patience;
        let wanted = if self.topology.is_ordered() {
            1
        } else {
            self.alive.len()
        };
        loop {
            let counts = self.counts().await?;
            if counts
                .iter()
                .all(|(_, consumers)| *consumers as usize >= wanted)
            {
                return Ok(());
            }
            if let Some(failed) = self.alive.iter().find(|worker| worker.task.is_finished()) {
                return Err(CheckError::Failed(
                    format!("worker {} stopped before it consumed", failed.id).into(),
                ));
            }
            if Instant::now() > deadline {
                return Err(CheckError::Failed(
                    "the workers did not start consuming".into(),
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Starts a worker of a handler of its own, behind proxies of its own.
    async fn start(&mut self) -> Result<(), CheckError> {
        let proxy = |upstream| async move {
            Proxy::start(upstream).await.map(Arc::new).map_err(|error| {
                CheckError::Failed(format!("cannot start a proxy: {error}").into())
            })
        };
        let database = proxy(self.rig.upstream.database).await?;
        let broker = proxy(self.rig.upstream.broker).await?;
        let local = |proxy: &Proxy| SocketAddr::from(([127, 0, 0, 1], proxy.port));
        let mut config = WorkerConfig::in_mode(
            self.plan.mode,
            self.rig.amqp.through(local(&broker)),
            self.scratch.database.clone().through(local(&database)),
            self.topology.clone(),
            self.rig.consumer_group,
        );
        config.relay = false;
        config.summary_interval = Duration::ZERO;
        config.startup_timeout = self.rig.patience;
        config.shutdown_timeout = DRAIN;
        config.topology.retry = config.topology.retry.with_attempts(self.rig.max_attempts);
        if self.plan.mode == Mode::Batch {
            config.batch_size = self.plan.batch_size;
            config.prefetch = u16::try_from(self.plan.batch_size * 8).unwrap_or(u16::MAX);
        }
        let id = self.started;
        self.started += 1;
        let probe = Arc::new(WorkerProbe {
            id,
            shared: Arc::clone(&self.shared),
            database: Arc::clone(&database),
            broker: Arc::clone(&broker),
        });
        let worker = Worker::new(config, (self.rig.make)()).probed(probe);
        let stats = worker.stats();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(worker.run(shutdown.clone()));
        self.every.push((Arc::clone(&stats), false));
        self.alive.push(Incarnation {
            id,
            task,
            shutdown,
            stats,
            database,
            broker,
        });
        Ok(())
    }

    /// Kills worker `id` as kill -9 would: its connections die at once,
    /// with what they had not committed or acked, and so do its tasks.
    fn kill(&mut self, id: usize) {
        let Some(place) = self.alive.iter().position(|worker| worker.id == id) else {
            return;
        };
        let worker = self.alive.remove(place);
        if let Some(killed) = self.every.get_mut(id) {
            killed.1 = true;
        }
        worker.database.sever();
        worker.broker.sever();
        worker.task.abort();
        worker.shutdown.cancel();
    }

    /// Stops every worker, as SIGTERM does: each drains and acks what it
    /// took (or is killed once it took longer than it may).
    async fn stop(&mut self) {
        for worker in &self.alive {
            worker.shutdown.cancel();
        }
        for mut worker in std::mem::take(&mut self.alive) {
            if tokio::time::timeout(DRAIN * 2, &mut worker.task)
                .await
                .is_err()
            {
                worker.database.sever();
                worker.broker.sever();
                worker.task.abort();
            }
        }
        // A probe of a worker stopped meanwhile may have asked for its death.
        while self.killed.try_recv().is_ok() {}
    }
}

/// What the probes of one run share.
#[derive(Debug)]
struct Shared {
    fault: Fault,
    /// Where a probe asks for its worker's death.
    kills: mpsc::UnboundedSender<usize>,
    /// The events whose transactions fail while `armed` ([`Fault::Replay`]).
    chosen: HashSet<String>,
    armed: AtomicBool,
    state: Mutex<Strikes>,
}

/// How far a run's fault has gone.
#[derive(Debug, Default)]
struct Strikes {
    /// Times it struck.
    strikes: usize,
    /// Times the point it strikes at was reached.
    reached: usize,
    /// Workers struck once already, or whose batch was failed on purpose.
    struck: HashSet<usize>,
    /// The chosen events that failed their attempt alone ([`Fault::FailOnce`]).
    failed_once: HashSet<String>,
    broke_batch: HashSet<usize>,
    /// Workers that asked for their death: everything they do now waits
    /// for it.
    dying: HashSet<usize>,
}

/// What a probe does to its worker.
enum Act {
    Go,
    Fail(FailureKind, String),
    Die,
    CutDatabase,
    CutAfterCommitSent,
    CutBroker,
}

/// The probe of one worker.
#[derive(Debug)]
struct WorkerProbe {
    id: usize,
    shared: Arc<Shared>,
    database: Arc<Proxy>,
    broker: Arc<Proxy>,
}

/// The reaches of a point at which a cut strikes: the first, and two more
/// spread over the run.
const CUT_AT: [usize; STRIKES] = [1, 3, 6];

impl WorkerProbe {
    fn act(&self, point: Point, events: &[&str]) -> Act {
        let shared = &self.shared;
        let Ok(mut state) = shared.state.lock() else {
            return Act::Go;
        };
        if state.dying.contains(&self.id) {
            return Act::Die;
        }
        let spent = state.strikes >= STRIKES;
        let first_here = !state.struck.contains(&self.id);
        match (shared.fault, point) {
            (Fault::Kill(Moment::BeforeCommit), Point::BeforeCommit)
            | (Fault::Kill(Moment::AfterCommit), Point::AfterCommit)
                if !spent && first_here =>
            {
                self.die(&mut state)
            }
            // A batch that failed by itself will do as well as one failed here.
            (Fault::Kill(Moment::MidBatch), Point::BatchFailed) => {
                state.broke_batch.insert(self.id);
                Act::Go
            }
            (Fault::Kill(Moment::MidBatch), Point::BeforeCommit)
                if !spent && events.len() > 1 && !state.broke_batch.contains(&self.id) =>
            {
                Act::Fail(
                    FailureKind::Message,
                    "idem check: this batch is made to fail, so that its events are applied one by one"
                        .into(),
                )
            }
            (Fault::Kill(Moment::MidBatch), Point::AfterCommit)
                if !spent
                    && first_here
                    && events.len() == 1
                    && state.broke_batch.contains(&self.id) =>
            {
                self.die(&mut state)
            }
            (Fault::CutDatabase | Fault::CutCommit, Point::BeforeCommit)
            | (Fault::CutBroker, Point::AfterCommit) => {
                state.reached += 1;
                if spent || !CUT_AT.contains(&state.reached) {
                    return Act::Go;
                }
                state.strikes += 1;
                match shared.fault {
                    Fault::CutDatabase => Act::CutDatabase,
                    Fault::CutCommit => Act::CutAfterCommitSent,
                    _ => Act::CutBroker,
                }
            }
            (Fault::FailOnce, Point::BeforeCommit) => {
                let unfailed: Vec<&str> = events
                    .iter()
                    .copied()
                    .filter(|id| shared.chosen.contains(*id) && !state.failed_once.contains(*id))
                    .collect();
                match unfailed.as_slice() {
                    [] => Act::Go,
                    [id] if events.len() == 1 => {
                        state.failed_once.insert((*id).to_owned());
                        state.strikes += 1;
                        Act::Fail(
                            FailureKind::Message,
                            "idem check: this event fails its first attempt, and applies on a retry"
                                .into(),
                        )
                    }
                    _ => Act::Fail(
                        FailureKind::Message,
                        "idem check: this batch is made to fail, so that an event in it fails alone"
                            .into(),
                    ),
                }
            }
            (Fault::Replay, Point::BeforeCommit)
                if shared.armed.load(Ordering::Relaxed)
                    && events.iter().any(|id| shared.chosen.contains(*id)) =>
            {
                state.strikes += 1;
                Act::Fail(
                    FailureKind::Permanent,
                    "idem check: a failure injected into this event, whose cause is gone before its replay"
                        .into(),
                )
            }
            _ => Act::Go,
        }
    }

    /// Marks this worker dying and asks the check to kill it.
    fn die(&self, state: &mut Strikes) -> Act {
        state.strikes += 1;
        state.struck.insert(self.id);
        state.dying.insert(self.id);
        let _ = self.shared.kills.send(self.id);
        Act::Die
    }
}

impl Probe for WorkerProbe {
    fn reached<'a>(
        &'a self,
        point: Point,
        events: &'a [&'a str],
    ) -> Pin<Box<dyn Future<Output = Verdict> + Send + 'a>> {
        let act = self.act(point, events);
        Box::pin(async move {
            match act {
                Act::Go => Verdict::Go,
                Act::Fail(kind, reason) => Verdict::Fail { kind, reason },
                // Held here until the check kills the worker.
                Act::Die => std::future::pending().await,
                Act::CutDatabase => {
                    self.database.cut();
                    Verdict::Go
                }
                // What the worker sends next is the commit.
                Act::CutAfterCommitSent => {
                    self.database.cut_after_next_write();
                    Verdict::Go
                }
                Act::CutBroker => {
                    self.broker.cut();
                    Verdict::Go
                }
            }
        })
    }
}
