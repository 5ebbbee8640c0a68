//! `idem bench`: idem's throughput against the broker's own ceiling, in one
//! run, on the same queue type and prefetch, with a correctness check after
//! every run.
//!
//! For each round: the broker's ceiling (consume and ack with `multiple`, no
//! database), then `idem worker` in per-message mode and in batch mode, as
//! child processes, over the same published load. Throughput is the number
//! of messages over the span between the first and the last delivery
//! applied (the consume records' timestamps), CPU and peak RSS are read from
//! the worker's `/proc` entry.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use deadpool_postgres::Pool;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use super::contender::{self, Contender};
use crate::generate::{self, LoadSpec};
use crate::points::{self, PaymentSucceeded, Points};
use idem::broker::{
    AmqpConfig, Outgoing, PublishOptions, Topology, close, close_channel, connect, publish_all,
    ready_messages,
};
use idem::handler::{Handler, message_id};
use idem::store::outbox::Unsent;
use idem::store::{DatabaseConfig, Filters, migrate};
use idem::vars;
use idem::worker::EpochSettings;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The database (the bench uses a schema of its own in it).
    pub database: DatabaseConfig,
    /// Messages per run, duplicates included.
    pub messages: usize,
    /// Share of duplicates.
    pub duplicate_ratio: f64,
    /// Orders the events are spread over.
    pub orders: usize,
    /// Events with random UUIDs as ids instead of sequential ones.
    pub uuid_ids: bool,
    /// Consume records already in the table before a worker run, with
    /// random UUID ids: each worker runs once per size in every round, to
    /// show how deduplication holds up as records pile up.
    pub prefill: Vec<u64>,
    /// Epochs (days of a retention window) the prefilled records are
    /// spread over, the last of them current; `None`: as the worker's
    /// opening by size leaves them ([`prefill_layout`]).
    pub prefill_epochs: Option<u16>,
    /// The workers' `--epoch-records`, when given (else theirs, which a
    /// prefill without `prefill_epochs` takes as
    /// [`EpochSettings::DEFAULT_MAX_RECORDS`]).
    pub epoch_records: Option<u64>,
    /// Over each prefill, also a run during which the oldest day of
    /// records is removed (`idem prune`'s way), against the run without.
    pub prune_during: bool,
    /// Prefetch of every consumer measured.
    pub prefetch: u16,
    /// Batch mode's batch size.
    pub batch_size: usize,
    /// Batch mode's wait for a batch to fill.
    pub batch_wait: Duration,
    /// Batch mode's transactions in flight.
    pub batch_in_flight: usize,
    /// Per-message mode's transactions in flight.
    pub per_message_in_flight: usize,
    /// Rounds; medians are reported.
    pub rounds: usize,
    /// Also run pgbench at 16 clients with per-message mode's transaction, the
    /// general path's and the textbook's (BEGIN, record, upsert, COMMIT),
    /// each with PostgreSQL's CPU per transaction.
    pub pgbench: bool,
    /// Also run batch mode announcing every credit through the outbox, and
    /// count a run done once every message is sent too.
    pub outbox: bool,
    /// Which of ceiling, per-message and batch to run.
    pub modes: Vec<Mode>,
    /// Beside each mode, on the same load, the consumer a team would write
    /// instead ([`contender`]): the textbook transaction per message beside
    /// per-message mode, a straightforward batched consumer beside batch
    /// mode (with its 100 per batch or 5 ms).
    pub contenders: bool,
    /// The idem binary to run as the worker.
    pub worker_binary: PathBuf,
    /// Another build of idem to measure beside it, in the same rounds.
    pub baseline_binary: Option<PathBuf>,
}

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The broker alone: consume and ack with `multiple`.
    Ceiling,
    /// `idem worker --mode per-message`.
    PerMessage,
    /// `idem worker` in batch mode.
    Batch,
}

impl Mode {
    /// Every mode, in the order of a round.
    pub const ALL: [Mode; 3] = [Mode::Ceiling, Mode::PerMessage, Mode::Batch];

    /// The value of `--modes` that selects this mode.
    pub fn as_flag(self) -> &'static str {
        match self {
            Mode::Ceiling => "ceiling",
            Mode::PerMessage => "per-message",
            Mode::Batch => "batch",
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, Copy, Default)]
pub struct Measurement {
    /// Messages per second.
    pub rate: f64,
    /// Worker CPU (user + system) per message, in microseconds.
    pub cpu_us_per_message: Option<f64>,
    /// Worker peak resident set, in MiB.
    pub peak_rss_mib: Option<f64>,
    /// CPU of the local PostgreSQL server per message, in microseconds.
    pub postgres_us_per_message: Option<f64>,
    /// CPU of the local RabbitMQ node per message, in microseconds.
    pub rabbitmq_us_per_message: Option<f64>,
    /// WAL that PostgreSQL wrote per message, in bytes (`pg_stat_wal`,
    /// the whole server's).
    pub wal_bytes_per_message: Option<f64>,
    /// Full-page images among it, per message.
    pub wal_fpi_per_message: Option<f64>,
}

impl Measurement {
    /// The worker's, PostgreSQL's and RabbitMQ's CPU per message, when all
    /// three were measured.
    pub fn all_cpu_us_per_message(&self) -> Option<f64> {
        Some(
            self.cpu_us_per_message?
                + self.postgres_us_per_message?
                + self.rabbitmq_us_per_message?,
        )
    }

    /// Cores those three kept busy on average while the load drained.
    pub fn cores_busy(&self) -> Option<f64> {
        Some(self.all_cpu_us_per_message()? * self.rate / 1e6)
    }
}

/// The medians of every round.
#[derive(Debug, Default)]
pub struct BenchReport {
    /// Settings, for the printout.
    pub settings: String,
    /// Each mode's measurements, one per round, in the order first run
    /// (a mode over a prefilled table is a mode of its own).
    pub rounds: Vec<(String, Vec<Measurement>)>,
    /// pgbench at 16 clients running per-message mode's transaction (the
    /// tally's one statement), per round.
    pub pgbench: Vec<Pgbench>,
    /// The same transaction as the general path runs it (five statements
    /// instead of the tally's one), per round.
    pub pgbench_general: Vec<Pgbench>,
    /// The textbook per-message transaction (BEGIN, a consume record
    /// `INSERT … ON CONFLICT DO NOTHING`, the upsert, COMMIT) on tables of
    /// its own, per round.
    pub pgbench_textbook: Vec<Pgbench>,
    /// Credits the outbox run sent per message of its load (the load's
    /// duplicates send none).
    pub credits_per_message: f64,
}

/// One pgbench run.
#[derive(Debug, Clone, Copy)]
pub struct Pgbench {
    /// Transactions per second.
    pub tps: f64,
    /// CPU of the local PostgreSQL server per transaction, in microseconds;
    /// `None` when it runs elsewhere.
    pub postgres_us: Option<f64>,
}

const CEILING: &str = "1 ceiling (ack multiple, no database)";
const PER_MESSAGE: &str = "2 per-message";
const PER_MESSAGE_BASELINE: &str = "2 per-message, baseline build";
const BATCH: &str = "3 batch";
const BATCH_BASELINE: &str = "3 batch, baseline build";
const BATCH_OUTBOX: &str = "4 batch, outbox on (applied and sent)";
const BATCH_OUTBOX_BASELINE: &str = "4 batch, outbox on, baseline build";
const PUBLISHED_ALONE: &str = "5 credits published alone, per credit";
/// idem's consume records, where the bench counts a worker's progress.
const IDEM_RECORDS: &str = "mq_consume_record";
const TEXTBOOK: &str = "2 per-message, textbook consumer";
const BATCHED: &str = "3 batch, straightforward batched consumer";

/// Where the bench's credits go (the outbox run's).
fn credited_queue(topology: &Topology) -> String {
    format!("{}.credited", topology.queue)
}

/// A mode's key without the digit that orders the printout.
fn label(key: &str) -> &str {
    key.split_once(' ').map_or(key, |(_, name)| name)
}

/// This build's worker under `keys[0]` and, when there is one, the
/// baseline's under `keys[1]`, the baseline first every other round: what
/// runs second may find the servers warmer, or tired.
fn builds<'c>(
    config: &'c BenchConfig,
    keys: [&'static str; 2],
    round: usize,
) -> Vec<(&'static str, &'c std::path::Path)> {
    let mut builds = vec![(keys[0], config.worker_binary.as_path())];
    if let Some(baseline) = &config.baseline_binary {
        builds.push((keys[1], baseline.as_path()));
        if round.is_multiple_of(2) {
            builds.reverse();
        }
    }
    builds
}

/// The key of `mode` run over `prefill` records.
fn over(mode: &str, prefill: u64) -> String {
    match prefill {
        0 => mode.to_owned(),
        n => format!("{mode}, {n} records before"),
    }
}

/// The suffix of a run's key during which the oldest day was removed.
const REMOVING: &str = ", a day removed";

/// What a worker run measures, besides the mode.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// Where the run's consume records are: idem's, or a contender's.
    records: &'static str,
    /// The run's consume records are those whose id is above it.
    floor: i64,
    /// The run is done once every outgoing message is sent too.
    outbox: bool,
    /// Half-way through, the oldest of this many prefilled days is removed.
    removal: Option<usize>,
}

/// The records of each prefilled epoch, oldest first, the last one current:
/// `epochs` of about the same size, or, without, as the worker's opening
/// by size leaves them: closed epochs of `epoch_records` each (or a little
/// fewer) and a current one half full; one epoch if the worker opens none
/// by size.
pub fn prefill_layout(count: u64, epochs: Option<u16>, epoch_records: u64) -> Vec<u64> {
    let even = |total: u64, epochs: u64| -> Vec<u64> {
        (0..epochs)
            .map(|epoch| total / epochs + u64::from(epoch < total % epochs))
            .collect()
    };
    match (epochs, epoch_records) {
        (Some(epochs), _) => even(count, u64::from(epochs.max(1))),
        (None, 0) => vec![count],
        (None, records) => {
            let current = count.min(records / 2);
            let closed = count - current;
            let mut layout = even(closed, closed.div_ceil(records));
            layout.push(current);
            layout
        }
    }
}

/// Removes the oldest day of `epochs` prefilled ones as `idem prune` does
/// (the epochs are a day apart, the current one opened a day ago); returns
/// the epochs dropped and how long it took.
async fn remove_oldest_day(pool: Pool, epochs: usize) -> anyhow::Result<(Vec<i32>, Duration)> {
    let started = Instant::now();
    let day = 24 * 3600;
    let config = idem::store::retention::PruneConfig::new(
        Duration::from_secs(epochs.saturating_sub(1) as u64 * day - day / 2),
        Duration::from_secs(365 * day),
        idem::commands::prune::PruneSettings::DEFAULT_LOCK_TIMEOUT,
    );
    let pruned = idem::store::retention::prune(&pool, &config)
        .await?
        .context("another pruner was at work")?;
    Ok((pruned.dropped, started.elapsed()))
}

impl BenchReport {
    fn runs(&self, key: &str) -> Option<&Vec<Measurement>> {
        self.rounds
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, runs)| runs)
    }

    fn push(&mut self, key: String, measured: Measurement) {
        match self.rounds.iter_mut().find(|(k, _)| *k == key) {
            Some((_, runs)) => runs.push(measured),
            None => self.rounds.push((key, vec![measured])),
        }
    }
}

/// Runs every round and returns the measurements. Stops early, removing
/// what it created, when `shutdown` fires.
pub async fn run(
    config: &BenchConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<BenchReport> {
    let bench = Bench::new(config).await?;
    bench.sweep_leftovers().await;
    let report = tokio::select! {
        report = bench.rounds() => report,
        () = shutdown.cancelled() => Err(anyhow::anyhow!("interrupted")),
    };
    // Whatever happened, leave no schema or queue behind.
    let removed = bench.remove().await;
    let report = report?;
    removed?;
    Ok(report)
}

impl Bench<'_> {
    async fn rounds(&self) -> anyhow::Result<BenchReport> {
        let config = self.config;
        let bench = self;
        let mut load = generate::events(&LoadSpec {
            count: config.messages,
            duplicate_ratio: config.duplicate_ratio,
            orders: config.orders,
            seed: 42,
            prefix: "bench".into(),
        });
        if config.uuid_ids {
            generate::with_uuid_ids(&mut load, 42);
        }
        let bodies: Vec<Vec<u8>> = load.iter().map(PaymentSucceeded::to_body).collect();
        let mut report = BenchReport {
            settings: format!(
                "{} messages ({:.0}% duplicates, {} orders, {} event ids), {} consume records before each worker run, quorum queue, prefetch {}; batch mode: {} per batch, {:?} wait, {} in flight; per-message mode: {} in flight",
                config.messages,
                config.duplicate_ratio * 100.0,
                config.orders,
                if config.uuid_ids {
                    "random UUID"
                } else {
                    "sequential"
                },
                config
                    .prefill
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(" / "),
                config.prefetch,
                config.batch_size,
                config.batch_wait,
                config.batch_in_flight,
                config.per_message_in_flight
            ),
            ..BenchReport::default()
        };
        for round in 1..=config.rounds {
            eprintln!("round {round} of {}", config.rounds);
            bench.reset().await?;
            bench.publish(&bodies).await?;
            settle_down().await;
            if config.modes.contains(&Mode::Ceiling) {
                let ceiling = bench.ceiling(config.messages).await?;
                eprintln!("  ceiling      {:>9.0} msgs/s", ceiling.rate);
                report.push(CEILING.to_owned(), ceiling);
            }
            for (wanted, args, keys) in [
                (
                    Mode::PerMessage,
                    bench.per_message_args(),
                    [PER_MESSAGE, PER_MESSAGE_BASELINE],
                ),
                (Mode::Batch, bench.batch_args(), [BATCH, BATCH_BASELINE]),
            ] {
                if !config.modes.contains(&wanted) {
                    continue;
                }
                for (key, binary) in builds(config, keys, round) {
                    for &prefill in &config.prefill {
                        let removals = if config.prune_during && prefill > 0 {
                            &[false, true][..]
                        } else {
                            &[false][..]
                        };
                        for &removal in removals {
                            bench.reset().await?;
                            let floor = bench.prefill(prefill).await?;
                            bench.publish(&bodies).await?;
                            settle_down().await;
                            let run = Run {
                                records: IDEM_RECORDS,
                                floor,
                                outbox: false,
                                removal: removal.then(|| bench.layout(prefill).len()),
                            };
                            let measured = bench.worker(binary, &args, &load, run).await?;
                            let mut key = over(key, prefill);
                            if removal {
                                key.push_str(REMOVING);
                            }
                            eprintln!("  {:<30} {:>9.0} msgs/s", label(&key), measured.rate);
                            report.push(key, measured);
                        }
                    }
                }
                if config.contenders {
                    let (key, args) = match wanted {
                        Mode::PerMessage => (TEXTBOOK, bench.contender_args(Contender::Textbook)),
                        _ => (BATCHED, bench.contender_args(Contender::Batched)),
                    };
                    let run = Run {
                        records: contender::TABLE,
                        floor: 0,
                        outbox: false,
                        removal: None,
                    };
                    let measured = bench
                        .run_afresh(&config.worker_binary, &bodies, &load, &args, run)
                        .await?;
                    eprintln!("  {:<30} {:>9.0} msgs/s", label(key), measured.rate);
                    report.push(key.to_owned(), measured);
                }
            }
            if config.outbox && config.modes.contains(&Mode::Batch) {
                let mut args = bench.batch_args();
                args.extend(["--credits-exchange".into(), bench.topology.exchange.clone()]);
                for (key, binary) in builds(config, [BATCH_OUTBOX, BATCH_OUTBOX_BASELINE], round) {
                    let run = Run {
                        records: IDEM_RECORDS,
                        floor: 0,
                        outbox: true,
                        removal: None,
                    };
                    let measured = bench.run_afresh(binary, &bodies, &load, &args, run).await?;
                    eprintln!("  {:<30} {:>9.0} msgs/s", label(key), measured.rate);
                    report.push(key.to_owned(), measured);
                }
                let alone = bench.publish_alone(&load).await?;
                eprintln!(
                    "  {:<30} {:>9.0} msgs/s",
                    label(PUBLISHED_ALONE),
                    alone.rate
                );
                report.push(PUBLISHED_ALONE.to_owned(), alone);
                report.credits_per_message =
                    generate::distinct_events(&load) as f64 / load.len() as f64;
            }
            if config.pgbench {
                for (transaction, runs) in [
                    (PgbenchScript::Tally, &mut report.pgbench),
                    (PgbenchScript::General, &mut report.pgbench_general),
                    (PgbenchScript::Textbook, &mut report.pgbench_textbook),
                ] {
                    bench.reset().await?;
                    let (name, script) = match transaction {
                        // Into the epoch the reset opened.
                        PgbenchScript::Tally => {
                            ("idem's tally", pgbench_script(bench.current_epoch().await?))
                        }
                        PgbenchScript::General => ("idem's general path", pgbench_general_script()),
                        PgbenchScript::Textbook => ("textbook", PGBENCH_TEXTBOOK.to_owned()),
                    };
                    let run = bench.pgbench(&script).await?;
                    eprintln!("  pgbench, {name:<20} {:>9.0} tps", run.tps);
                    runs.push(run);
                }
            }
        }
        Ok(report)
    }
}

/// The bench's own schema and topology.
struct Bench<'a> {
    config: &'a BenchConfig,
    schema: String,
    topology: Topology,
    database: DatabaseConfig,
    pool: Pool,
}

impl<'a> Bench<'a> {
    async fn new(config: &'a BenchConfig) -> anyhow::Result<Self> {
        let schema = format!("idem_bench_{}", std::process::id());
        let mut database = config.database.clone().with_schema(&schema);
        database.pool_size = 2;
        let pool = database.pool()?;
        Ok(Self {
            config,
            topology: points::topology().prefixed(&format!("idem-bench-{}.", std::process::id())),
            schema,
            database,
            pool,
        })
    }

    /// The current epoch of the bench's schema.
    async fn current_epoch(&self) -> anyhow::Result<i32> {
        Ok(self
            .pool
            .get()
            .await?
            .query_one("SELECT max(epoch) FROM mq_consume_epoch", &[])
            .await?
            .try_get(0)?)
    }

    /// An empty schema and an empty topology, with a queue that takes the
    /// credits the outbox sends (to the topology's exchange).
    async fn reset(&self) -> anyhow::Result<()> {
        self.remove().await?;
        migrate::run::<Points>(&self.pool, Some(&self.schema)).await?;
        self.pool
            .get()
            .await?
            .batch_execute(contender::CREATE_TABLE)
            .await?;
        let connection = connect(&self.config.amqp, "idem bench").await?;
        self.topology.declare(&connection).await?;
        let channel = connection.create_channel().await?;
        // Not durable, unlike a downstream service's: what the bench
        // measures is idem's side of the publish, not the queue's disk.
        let credited = credited_queue(&self.topology);
        channel
            .queue_declare(
                credited.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                credited.as_str().into(),
                self.topology.exchange.as_str().into(),
                points::CREDITED_ROUTING_KEY.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
        Ok(())
    }

    async fn remove(&self) -> anyhow::Result<()> {
        Self::remove_objects(self.config, &self.pool, &self.schema, &self.topology).await
    }

    /// Removes the schema and topology of earlier bench processes that died
    /// (their names carry the pid of a process that no longer runs).
    async fn sweep_leftovers(&self) {
        let Ok(client) = self.pool.get().await else {
            return;
        };
        let Ok(rows) = client
            .query(
                "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idem\\_bench\\_%'",
                &[],
            )
            .await
        else {
            return;
        };
        for row in rows {
            let Ok(schema) = row.try_get::<_, String>(0) else {
                continue;
            };
            let Some(pid) = schema.strip_prefix("idem_bench_") else {
                continue;
            };
            if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            let topology = points::topology().prefixed(&format!("idem-bench-{pid}."));
            if let Err(error) =
                Self::remove_objects(self.config, &self.pool, &schema, &topology).await
            {
                eprintln!("could not remove the leftovers of bench {pid}: {error:#}");
            }
        }
    }

    async fn remove_objects(
        config: &BenchConfig,
        pool: &Pool,
        schema: &str,
        topology: &Topology,
    ) -> anyhow::Result<()> {
        let client = pool.get().await.context("cannot reach PostgreSQL")?;
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await?;
        let connection = connect(&config.amqp, "idem bench").await?;
        let channel = connection.create_channel().await?;
        topology.delete(&channel).await?;
        channel
            .queue_delete(
                credited_queue(topology).as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await?;
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
        Ok(())
    }

    async fn publish(&self, bodies: &[Vec<u8>]) -> anyhow::Result<()> {
        let messages: Vec<Outgoing> = bodies
            .iter()
            .map(|body| self.topology.event(body.clone()))
            .collect();
        self.publish_confirmed(&messages, 2000, "the load").await
    }

    /// Publishes `messages` with `publish_all`, `window` confirms at once,
    /// and fails unless every one of them (`what`) was confirmed.
    async fn publish_confirmed(
        &self,
        messages: &[Outgoing],
        window: usize,
        what: &str,
    ) -> anyhow::Result<()> {
        let options = PublishOptions {
            window,
            patience: Duration::from_secs(10),
        };
        let report = publish_all(
            &self.config.amqp,
            messages,
            &options,
            &CancellationToken::new(),
        )
        .await?;
        ensure!(
            report.all_confirmed(),
            "{what} was not confirmed: {report:?}"
        );
        Ok(())
    }

    /// The outbox run's credits published again as the relay sent them
    /// (the handler's messages of each event, under their keys), alone,
    /// the way `idem publish` publishes (`publish_all`, its default window
    /// of confirms), to the same queue emptied first: what a confirmed
    /// publish of those messages costs the broker and the publisher
    /// without a relay around it.
    async fn publish_alone(&self, load: &[PaymentSucceeded]) -> anyhow::Result<Measurement> {
        let handler = Points.announcing(self.topology.exchange.as_str());
        let mut seen = std::collections::HashSet::new();
        let messages: Vec<Outgoing> = load
            .iter()
            .filter(|event| seen.insert(event.event_id.as_str()))
            .flat_map(|event| {
                let id = |index| message_id(points::CONSUMER_GROUP, &event.event_id, index);
                handler
                    .outgoing(event)
                    .into_iter()
                    .enumerate()
                    .map(move |(index, message)| Unsent {
                        id: 0,
                        message_id: id(index).to_string(),
                        exchange: message.exchange,
                        routing_key: message.routing_key,
                        content_type: message.content_type,
                        headers: message.headers,
                        body: message.body,
                        attempts: 0,
                    })
            })
            .map(|unsent| idem::relay::outgoing(&unsent))
            .collect();
        let connection = connect(&self.config.amqp, "idem bench").await?;
        let channel = connection.create_channel().await?;
        channel
            .queue_purge(
                credited_queue(&self.topology).as_str().into(),
                QueuePurgeOptions::default(),
            )
            .await?;
        close_channel(&channel).await;
        close(&connection).await;
        settle_down().await;
        let me = std::process::id();
        let (services, before) = (ServiceCpu::now(), ProcessUsage::read(me));
        let started = Instant::now();
        self.publish_confirmed(
            &messages,
            PublishOptions::DEFAULT_WINDOW,
            "the credits published alone",
        )
        .await?;
        let elapsed = started.elapsed();
        let (_, rabbitmq) = ServiceCpu::now().per_message(&services, messages.len() as f64);
        let publisher = ProcessUsage::read(me).zip(before).map(|(after, before)| {
            (after.cpu - before.cpu).as_secs_f64() * 1e6 / messages.len() as f64
        });
        Ok(Measurement {
            rate: messages.len() as f64 / elapsed.as_secs_f64(),
            cpu_us_per_message: publisher,
            rabbitmq_us_per_message: rabbitmq,
            ..Measurement::default()
        })
    }

    /// Consumes `messages` and acks them with `multiple`, as fast as the
    /// broker delivers.
    async fn ceiling(&self, messages: usize) -> anyhow::Result<Measurement> {
        let connection = connect(&self.config.amqp, "idem bench ceiling").await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await?;
        let mut consumer = channel
            .basic_consume(
                self.topology.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        // Ack a tenth of the window at a time, so that the broker never waits.
        let every = (usize::from(self.config.prefetch) / 10).max(1);
        let services = ServiceCpu::now();
        let mut started = None;
        for n in 1..=messages {
            let delivery = consumer
                .next()
                .await
                .context("the consumer ended early")??;
            started.get_or_insert_with(Instant::now);
            if n % every == 0 || n == messages {
                channel
                    .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                    .await?;
            }
        }
        let elapsed = started.map_or(Duration::ZERO, |s| s.elapsed());
        let (_, rabbitmq) = ServiceCpu::now().per_message(&services, messages as f64);
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
        Ok(Measurement {
            rate: messages as f64 / elapsed.as_secs_f64(),
            rabbitmq_us_per_message: rabbitmq,
            ..Measurement::default()
        })
    }

    fn common_args(&self) -> Vec<String> {
        let mut args = vec![
            "worker".into(),
            "--prefetch".into(),
            self.config.prefetch.to_string(),
        ];
        if let Some(records) = self.config.epoch_records {
            args.extend(["--epoch-records".into(), records.to_string()]);
        }
        args
    }

    /// `args` run by `binary` as [`Bench::worker`] does, on an empty
    /// schema and topology with the load published anew.
    async fn run_afresh(
        &self,
        binary: &std::path::Path,
        bodies: &[Vec<u8>],
        load: &[PaymentSucceeded],
        args: &[String],
        run: Run,
    ) -> anyhow::Result<Measurement> {
        self.reset().await?;
        self.publish(bodies).await?;
        settle_down().await;
        self.worker(binary, args, load, run).await
    }

    /// A contender with the settings of the mode it stands beside.
    fn contender_args(&self, contender: Contender) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "contender".into(),
            contender.as_arg().into(),
            "--prefetch".into(),
            self.config.prefetch.to_string(),
        ];
        match contender {
            Contender::Textbook => args.extend([
                "--in-flight".into(),
                self.config.per_message_in_flight.to_string(),
            ]),
            // The straightforward consumer's own settings, whatever idem's.
            Contender::Batched => args.extend([
                "--batch-size".into(),
                "100".into(),
                "--batch-wait".into(),
                "5ms".into(),
            ]),
        }
        args
    }

    fn per_message_args(&self) -> Vec<String> {
        let mut args = self.common_args();
        args.extend([
            "--mode".into(),
            idem::worker::Mode::PerMessage.as_flag().into(),
            "--max-in-flight".into(),
            self.config.per_message_in_flight.to_string(),
        ]);
        args
    }

    fn batch_args(&self) -> Vec<String> {
        let mut args = self.common_args();
        args.extend([
            "--mode".into(),
            idem::worker::Mode::Batch.as_flag().into(),
            "--batch-size".into(),
            self.config.batch_size.to_string(),
            "--batch-wait".into(),
            format!("{}ms", self.config.batch_wait.as_millis()),
            "--max-in-flight".into(),
            self.config.batch_in_flight.to_string(),
        ]);
        args
    }

    /// The prefilled epochs' records ([`prefill_layout`]).
    fn layout(&self, count: u64) -> Vec<u64> {
        prefill_layout(
            count,
            self.config.prefill_epochs,
            self.config
                .epoch_records
                .unwrap_or(EpochSettings::DEFAULT_MAX_RECORDS),
        )
    }

    /// Fills the consume records with `prefill` rows of random UUID ids in
    /// the worker's consumer group, spread over epochs ([`Bench::layout`])
    /// a day apart, the last of them current (a retention window of that
    /// many days, at the end of its last day), fast: each partition's
    /// unique index is dropped, the rows loaded, the index built again.
    /// Then VACUUM, for a table as a long-running one is, the closed
    /// epochs' filters, as the workers that closed them would have built
    /// them, and a checkpoint, so that the run starts where a steady state
    /// would. Returns the highest id among them: the run's own records are
    /// above it.
    async fn prefill(&self, count: u64) -> anyhow::Result<i64> {
        if count == 0 {
            return Ok(0);
        }
        let started = Instant::now();
        let mut client = self.pool.get().await?;
        client
            .batch_execute("SET statement_timeout = 0; SET maintenance_work_mem = '512MB'")
            .await?;
        let layout = self.layout(count);
        let epochs = layout.len() as i64;
        for (day, rows) in (0..).zip(&layout) {
            if day > 0 {
                client.batch_execute("SELECT mq_open_epoch()").await?;
            }
            let epoch: i32 = client
                .query_one("SELECT max(epoch) FROM mq_consume_epoch", &[])
                .await?
                .try_get(0)?;
            let partition = format!("mq_consume_record_{epoch}");
            let rows = i64::try_from(*rows)?;
            client
                .batch_execute(&format!(
                    "ALTER TABLE {partition} DROP CONSTRAINT {partition}_key"
                ))
                .await?;
            client
                .execute(
                    "INSERT INTO mq_consume_record \
                         (event_id, consumer_group, digest, consumed_at, epoch) \
                     SELECT id, $1, mq_digest($1, id), \
                         now() - make_interval(days => $3::int), $4 \
                     FROM (SELECT gen_random_uuid()::text AS id \
                           FROM generate_series(1, $2::bigint)) AS ids",
                    &[
                        &points::CONSUMER_GROUP,
                        &rows,
                        &i32::try_from(epochs - 1 - day)?,
                        &epoch,
                    ],
                )
                .await
                .context("prefilling the consume records")?;
            client
                .batch_execute(&format!(
                    "ALTER TABLE {partition} \
                     ADD CONSTRAINT {partition}_key UNIQUE (digest)"
                ))
                .await?;
        }
        // A day apart, the current one opened a day ago: as a daily
        // rotation leaves them.
        client
            .batch_execute(
                "UPDATE mq_consume_epoch SET opened_at = now() - \
                 make_interval(days => (SELECT max(epoch) FROM mq_consume_epoch) - epoch + 1)",
            )
            .await?;
        client
            .batch_execute("VACUUM (ANALYZE) mq_consume_record")
            .await?;
        let filtering = Instant::now();
        let synced = Filters::default()
            .sync(&mut client, usize::MAX, true)
            .await
            .context("building the closed epochs' filters")?;
        eprintln!(
            "  built the filters of {} closed epochs in {:.0} s",
            synced.built.len(),
            filtering.elapsed().as_secs_f64()
        );
        if let Err(error) = client.batch_execute("CHECKPOINT").await {
            eprintln!(
                "  no checkpoint after the prefill ({}): the run may write fewer full pages than a steady state",
                idem::store::describe(&error)
            );
        }
        client
            .batch_execute("RESET statement_timeout; RESET maintenance_work_mem")
            .await?;
        let floor: i64 = client
            .query_one("SELECT coalesce(max(id), 0) FROM mq_consume_record", &[])
            .await?
            .try_get(0)?;
        eprintln!(
            "  prefilled {count} consume records in {:.0} s",
            started.elapsed().as_secs_f64()
        );
        Ok(floor)
    }

    /// Runs `binary worker` with `args` until the load is applied, checks
    /// the result, and measures. The run's consume records are those
    /// whose id is above `floor`.
    async fn worker(
        &self,
        binary: &std::path::Path,
        args: &[String],
        load: &[PaymentSucceeded],
        run: Run,
    ) -> anyhow::Result<Measurement> {
        let Run {
            records: table,
            floor,
            outbox,
            removal,
        } = run;
        let mut removing = None;
        let client = self.pool.get().await?;
        let wal_before = wal(&client).await;
        let services = ServiceCpu::now();
        let mut worker = tokio::process::Command::new(binary);
        if let Some(ca_file) = &self.database.ca_file {
            worker.env(vars::DATABASE_CA_FILE, ca_file);
        }
        if let Some(ca_file) = &self.config.amqp.ca_file {
            worker.env(vars::AMQP_CA_FILE, ca_file);
        }
        let mut child = worker
            .env(vars::AMQP_URL, self.config.amqp.url.expose())
            .env(vars::DATABASE_URL, self.database.url.expose())
            .env(vars::SCHEMA, &self.schema)
            .envs(vars::topology(&self.topology))
            .env("RUST_LOG", "error")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start the worker")?;
        let pid = child.id().context("the worker exited at once")?;
        let distinct = generate::distinct_events(load) as i64;
        let probe = QueueProbe::open(&self.config.amqp).await?;
        // No deadline for the whole load, which a slow machine stretches
        // without end; only for a stall: nothing taken, nothing recorded.
        const STALL: Duration = Duration::from_secs(120);
        let mut seen = (u32::MAX, -1);
        let mut progressed = Instant::now();
        let mut all_sent: Option<String> = None;
        loop {
            // The broker first: counting records scans the table, which
            // would load the database under measurement.
            let ready = probe.ready(&self.topology.queue).await?;
            if let Some(epochs) = removal
                && removing.is_none()
                && (ready as usize) < load.len() / 2
            {
                removing = Some(tokio::spawn(remove_oldest_day(self.pool.clone(), epochs)));
            }
            let mut recorded = -1;
            if ready == 0 {
                recorded = client
                    .query_one(
                        &format!("SELECT count(*) FROM {table} WHERE id > $1"),
                        &[&floor],
                    )
                    .await?
                    .try_get(0)?;
                if recorded >= distinct
                    && (!outbox || idem::store::outbox::unsent(&client).await? == 0)
                {
                    // A relay removes what it sent: the last is sent by now
                    // (within the 50 ms between two looks).
                    if outbox {
                        all_sent = Some(
                            client
                                .query_one("SELECT clock_timestamp()::text", &[])
                                .await?
                                .try_get(0)?,
                        );
                    }
                    break;
                }
            }
            if (ready, recorded) != seen {
                seen = (ready, recorded);
                progressed = Instant::now();
            }
            if let Ok(Some(status)) = child.try_wait() {
                bail!("the worker exited with {status} before the load was applied");
            }
            ensure!(
                progressed.elapsed() < STALL,
                "the worker made no progress for {} s ({ready} messages ready)",
                STALL.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if outbox {
            // Confirmed, each in the queue bound for the credits: exactly
            // one per event, since nothing was killed.
            let credited = probe.ready(&credited_queue(&self.topology)).await?;
            ensure!(
                i64::from(credited) == distinct,
                "{credited} credits sent for {distinct} events"
            );
        }
        probe.close().await;
        if let Some(removing) = removing {
            let (dropped, took) = removing.await??;
            ensure!(
                !dropped.is_empty(),
                "the removal during the run dropped no epoch"
            );
            eprintln!(
                "  removed epochs {dropped:?} in {:.0} ms while the worker ran",
                took.as_secs_f64() * 1e3
            );
        }
        let usage = ProcessUsage::read(pid);
        let (postgres, rabbitmq) = ServiceCpu::now().per_message(&services, load.len() as f64);
        let lsn_after = wal_lsn(&client).await;
        let stopped = tokio::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await?;
        ensure!(stopped.success(), "cannot stop the worker");
        let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await??;
        ensure!(status.success(), "the worker exited with {status}");
        let fpi_after = settled_fpi(&client).await;

        // With the outbox, until the last message was sent.
        let span: f64 = client
            .query_one(
                &format!(
                    "SELECT extract(epoch FROM greatest(max(consumed_at), \
                         $2::text::timestamptz) - min(consumed_at))::float8 \
                     FROM {table} WHERE id > $1"
                ),
                &[&floor, &all_sent],
            )
            .await?
            .try_get(0)?;
        self.verify(load, table, floor).await?;
        let messages = load.len() as f64;
        let wal_bytes = match (&wal_before, lsn_after) {
            (Some(before), Some(after)) => client
                .query_one(
                    "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8",
                    &[&after, &before.lsn],
                )
                .await
                .ok()
                .and_then(|row| row.try_get::<_, f64>(0).ok()),
            _ => None,
        };
        let wal_fpi = wal_before
            .as_ref()
            .zip(fpi_after)
            .map(|(before, after)| after - before.fpi);
        Ok(Measurement {
            rate: messages / span.max(1e-3),
            cpu_us_per_message: usage.as_ref().map(|u| u.cpu.as_secs_f64() * 1e6 / messages),
            peak_rss_mib: usage.map(|u| u.peak_rss_kib as f64 / 1024.0),
            postgres_us_per_message: postgres,
            rabbitmq_us_per_message: rabbitmq,
            wal_bytes_per_message: wal_bytes.map(|bytes| bytes / messages),
            wal_fpi_per_message: wal_fpi.map(|fpi| fpi / messages),
        })
    }

    /// Every order at its exact total, one record per distinct event (above
    /// `floor`, the prefilled ones), nothing dead-lettered.
    async fn verify(
        &self,
        load: &[PaymentSucceeded],
        table: &str,
        floor: i64,
    ) -> anyhow::Result<()> {
        let client = self.pool.get().await?;
        let points: BTreeMap<String, i64> = client
            .query("SELECT order_id, points FROM user_points", &[])
            .await?
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<Result<_, tokio_postgres::Error>>()?;
        ensure!(
            points == generate::expected_points(load),
            "per-order totals are wrong"
        );
        let (records, events): (i64, i64) = {
            let row = client
                .query_one(
                    &format!(
                        "SELECT count(*), count(DISTINCT event_id) FROM {table} WHERE id > $1"
                    ),
                    &[&floor],
                )
                .await?;
            (row.try_get(0)?, row.try_get(1)?)
        };
        let distinct = generate::distinct_events(load) as i64;
        ensure!(
            records == distinct && events == distinct,
            "{records} records for {distinct} events"
        );
        let probe = QueueProbe::open(&self.config.amqp).await?;
        let dead = probe.ready(&self.topology.dead_letter_queue).await;
        probe.close().await;
        let dead = dead?;
        ensure!(dead == 0, "{dead} messages were dead-lettered");
        Ok(())
    }

    /// pgbench at 16 clients for 10 s running `transaction` (a pgbench
    /// script) on fresh event ids, in the bench's schema.
    async fn pgbench(&self, transaction: &str) -> anyhow::Result<Pgbench> {
        let script = std::env::temp_dir().join(format!("{}.sql", self.schema));
        std::fs::write(&script, transaction)?;
        self.pool
            .get()
            .await?
            .batch_execute(&format!(
                "SET search_path TO {schema}; {PGBENCH_TEXTBOOK_TABLES}",
                schema = self.schema
            ))
            .await?;
        settle_down().await;
        let before = ServiceCpu::now();
        let output = tokio::process::Command::new("pgbench")
            .env("PGOPTIONS", format!("-c search_path={}", self.schema))
            .args([
                "--no-vacuum",
                "--client=16",
                "--jobs=2",
                "--time=10",
                "--protocol=prepared",
            ])
            .arg(format!("--file={}", script.display()))
            .arg(format!("--define=orders={}", self.config.orders))
            .arg(self.database.url.expose())
            .output()
            .await
            .context("cannot run pgbench (is it installed?)")?;
        let _ = std::fs::remove_file(&script);
        let stdout = String::from_utf8_lossy(&output.stdout);
        ensure!(
            output.status.success(),
            "pgbench failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let after = ServiceCpu::now();
        let field = |prefix: &str| {
            stdout.lines().find_map(|line| {
                let rest = line.strip_prefix(prefix)?;
                rest.split_whitespace().next()?.parse::<f64>().ok()
            })
        };
        let tps = field("tps = ").context("no tps in pgbench's output")?;
        let transactions = field("number of transactions actually processed: ")
            .context("no transaction count in pgbench's output")?;
        let (postgres_us, _) = after.per_message(&before, transactions);
        Ok(Pgbench { tps, postgres_us })
    }
}

/// The first lines of a pgbench script: a fresh event id, a random order.
const PGBENCH_VARIABLES: &str =
    "\\set event random(1, 1000000000000)\n\\set order random(1, :orders)\n";
/// One event, one order and 7 points, as the statements' parameters.
const PGBENCH_EVENT_IDS: &str = "ARRAY['pgbench-' || :event]::varchar[]";
const PGBENCH_GROUP: &str = "'pgbench'";
const PGBENCH_ORDERS: &str = "ARRAY['order-' || :order]::varchar[]";
const PGBENCH_POINTS: &str = "ARRAY[7]::bigint[]";
/// The event's digest, as the worker computes it.
const PGBENCH_DIGESTS: &str = "ARRAY[mq_digest('pgbench', 'pgbench-' || :event)]";

/// A claim without filters (pgbench's schema has no closed epoch to look
/// into).
fn unfiltered(statement: &str) -> String {
    [
        ("$4::int[]", "'{}'::int[]"),
        ("$5::timestamptz[]", "'{}'::timestamptz[]"),
        ("$6::int[]", "'{}'::int[]"),
        ("$7::int[]", "'{}'::int[]"),
    ]
    .iter()
    .fold(statement.to_owned(), |statement, (param, none)| {
        statement.replace(param, none)
    })
}

/// Per-message mode's transaction, as pgbench runs it: what the worker
/// runs for a first delivery of one event when no closed epoch may hold
/// it, its claim straight into the current epoch (`epoch`) and the points
/// tally in one statement.
fn pgbench_script(epoch: i32) -> String {
    let tally = Points.tally().unwrap_or(points::POINTS);
    let statement = idem::store::straight_claim_and_tally_statement(&tally)
        .replace("$1::varchar", "('pgbench-' || :event)::varchar")
        .replace(
            "$3::uuid",
            "mq_digest('pgbench', 'pgbench-' || :event)::uuid",
        )
        .replace("$2::varchar", &format!("{PGBENCH_GROUP}::varchar"))
        .replace("$4::int", &format!("{epoch}::int"))
        .replace("$5::varchar", "('order-' || :order)::varchar")
        .replace("$6::bigint", "7::bigint");
    format!("{PGBENCH_VARIABLES}{statement};\n")
}

/// The transactions `--pgbench` runs, each on a schema of its own.
#[derive(Debug, Clone, Copy)]
enum PgbenchScript {
    /// Per-message mode's: the claim straight into the current epoch with
    /// the tally, one statement.
    Tally,
    /// The general path's five statements.
    General,
    /// The textbook's: BEGIN, record, upsert, COMMIT.
    Textbook,
}

/// The same work as the general path does it, for a handler without a
/// tally: BEGIN, the claim, the effect, the ledger clear, COMMIT.
fn pgbench_general_script() -> String {
    let [claim, effect, clear] = idem::store::general_path_statements(&points::POINTS);
    let claim = claim
        .replace("$1::varchar[]", PGBENCH_EVENT_IDS)
        .replace("$3::uuid[]", PGBENCH_DIGESTS)
        .replace("$2", PGBENCH_GROUP);
    let claim = unfiltered(&claim);
    let effect = effect
        .replace("$2::bigint[]", PGBENCH_POINTS)
        .replace("$1::varchar[]", PGBENCH_ORDERS);
    let clear = clear
        .replace("$1::varchar[]", PGBENCH_EVENT_IDS)
        .replace("$2", PGBENCH_GROUP);
    format!("{PGBENCH_VARIABLES}BEGIN;\n{claim};\n{effect};\n{clear};\nCOMMIT;\n")
}

/// The tables of the textbook transaction, beside idem's in the bench's
/// schema (removed with it): a consume record keyed by the event id, and
/// points per order as idem's handler keeps them.
const PGBENCH_TEXTBOOK_TABLES: &str = "\
    CREATE TABLE IF NOT EXISTS textbook_consumed (event_id VARCHAR(64) PRIMARY KEY); \
    CREATE TABLE IF NOT EXISTS textbook_points (\
        order_id VARCHAR(64) PRIMARY KEY, points BIGINT NOT NULL DEFAULT 0) \
        WITH (fillfactor = 50);";

/// The transaction a team writes by hand for one message: BEGIN, the
/// consume record, the upsert, COMMIT (an ack follows it).
const PGBENCH_TEXTBOOK: &str = "\
\\set event random(1, 1000000000000)
\\set order random(1, :orders)
BEGIN;
INSERT INTO textbook_consumed (event_id) VALUES ('pgbench-' || :event) ON CONFLICT DO NOTHING;
INSERT INTO textbook_points (order_id, points) VALUES ('order-' || :order, 7) \
ON CONFLICT (order_id) DO UPDATE SET points = textbook_points.points + EXCLUDED.points;
COMMIT;
";

/// Where PostgreSQL's WAL stood before a run.
#[derive(Debug, Clone)]
struct Wal {
    /// `pg_current_wal_lsn()`: the bytes written since are the difference.
    lsn: String,
    /// `pg_stat_wal.wal_fpi`: full-page images written so far.
    fpi: f64,
}

/// Where the WAL stands (PostgreSQL 14 and later, for `pg_stat_wal`);
/// `None` where it cannot be read.
async fn wal(client: &tokio_postgres::Client) -> Option<Wal> {
    let row = client
        .query_one(
            "SELECT pg_current_wal_lsn()::text, wal_fpi::float8 FROM pg_stat_wal",
            &[],
        )
        .await
        .ok()?;
    Some(Wal {
        lsn: row.try_get(0).ok()?,
        fpi: row.try_get(1).ok()?,
    })
}

async fn wal_lsn(client: &tokio_postgres::Client) -> Option<String> {
    client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .ok()?
        .try_get(0)
        .ok()
}

/// `pg_stat_wal.wal_fpi` once it stops moving: sessions report their WAL
/// statistics when they have been idle a moment, or when they end, not
/// as they write. Gives up waiting after 10 s.
async fn settled_fpi(client: &tokio_postgres::Client) -> Option<f64> {
    let read = || async {
        client
            .query_one("SELECT wal_fpi::float8 FROM pg_stat_wal", &[])
            .await
            .ok()?
            .try_get::<_, f64>(0)
            .ok()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = read().await?;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = read().await?;
        if now == last || Instant::now() > deadline {
            return Some(now);
        }
        last = now;
    }
}

/// Reads queue depths over one channel, so that polling costs the broker
/// next to nothing.
struct QueueProbe {
    connection: lapin::Connection,
    channel: lapin::Channel,
}

impl QueueProbe {
    async fn open(amqp: &AmqpConfig) -> anyhow::Result<Self> {
        let connection = connect(amqp, "idem bench probe").await?;
        let channel = connection.create_channel().await?;
        Ok(Self {
            connection,
            channel,
        })
    }

    /// Messages ready in `queue`.
    async fn ready(&self, queue: &str) -> anyhow::Result<u32> {
        Ok(ready_messages(&self.channel, queue).await?)
    }

    async fn close(self) {
        close_channel(&self.channel).await;
        close(&self.connection).await;
    }
}

/// CPU time used so far by the local PostgreSQL and RabbitMQ servers (all
/// processes named `postgres`, and `beam.smp`), from `/proc`; zero when
/// they run elsewhere.
#[derive(Debug, Clone, Copy, Default)]
struct ServiceCpu {
    postgres_ticks: u64,
    rabbitmq_ticks: u64,
}

impl ServiceCpu {
    fn now() -> Self {
        let mut total = Self::default();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return total;
        };
        for entry in entries.flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((head, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let ticks = |i: usize| {
                fields
                    .get(i)
                    .and_then(|f| f.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            // With the time of children reaped: a backend (or autovacuum
            // worker) that exits during a run leaves its CPU in the
            // postmaster's count instead of taking it away.
            let used = ticks(11) + ticks(12) + ticks(13) + ticks(14);
            if head.ends_with("(postgres") {
                total.postgres_ticks += used;
            } else if head.ends_with("(beam.smp") {
                total.rabbitmq_ticks += used;
            }
        }
        total
    }

    /// Microseconds per message of each server since `earlier`; `None` for
    /// a server not seen on this machine.
    fn per_message(&self, earlier: &Self, messages: f64) -> (Option<f64>, Option<f64>) {
        let per = |now: u64, then: u64| {
            (now > 0).then(|| now.saturating_sub(then) as f64 * 10_000.0 / messages)
        };
        (
            per(self.postgres_ticks, earlier.postgres_ticks),
            per(self.rabbitmq_ticks, earlier.rabbitmq_ticks),
        )
    }
}

/// Waits, for at most 20 s, until the local servers are nearly idle: after
/// a load is published, RabbitMQ goes on writing it to disk for a while, and
/// a measurement started then would measure that too.
async fn settle_down() {
    const WINDOW: Duration = Duration::from_millis(500);
    // Ticks are 10 ms: under 5 % of a core over the window.
    const QUIET_TICKS: u64 = 2;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut before = ServiceCpu::now();
    while Instant::now() < deadline {
        tokio::time::sleep(WINDOW).await;
        let now = ServiceCpu::now();
        let busy = (now.postgres_ticks + now.rabbitmq_ticks)
            .saturating_sub(before.postgres_ticks + before.rabbitmq_ticks);
        if busy <= QUIET_TICKS {
            return;
        }
        before = now;
    }
}

/// CPU time and peak memory of a process, from `/proc`.
struct ProcessUsage {
    cpu: Duration,
    peak_rss_kib: u64,
}

impl ProcessUsage {
    fn read(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name, which is in parentheses.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let peak_rss_kib = status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        // Linux reports CPU time in clock ticks of 1/100 s (USER_HZ).
        Some(Self {
            cpu: Duration::from_millis(ticks * 10),
            peak_rss_kib,
        })
    }
}

fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values.collect();
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some(values[values.len() / 2])
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "idem bench: {}", self.settings)?;
        let rates = |mode: &str| -> Vec<f64> {
            self.runs(mode)
                .map(|runs| runs.iter().map(|m| m.rate).collect())
                .unwrap_or_default()
        };
        // Ratios are taken within each round, then their median: the
        // machine's speed drifts between rounds, much less within one.
        let ratio =
            |over: &[f64], under: &[f64]| median(over.iter().zip(under).map(|(a, b)| a / b));
        let ceiling = rates(CEILING);
        writeln!(
            f,
            "{:<42} {:>10} {:>10} {:>11} {:>13} {:>13} {:>13} {:>11} {:>6} {:>10} {:>10}",
            "mode (medians of the rounds)",
            "msgs/s",
            "× ceiling",
            "worker CPU",
            "worker peak",
            "PostgreSQL",
            "RabbitMQ",
            "all CPU",
            "cores",
            "WAL",
            "WAL full"
        )?;
        writeln!(
            f,
            "{:<42} {:>10} {:>10} {:>11} {:>13} {:>13} {:>13} {:>11} {:>6} {:>10} {:>10}",
            "",
            "",
            "",
            "µs/msg",
            "RSS MiB",
            "CPU µs/msg",
            "CPU µs/msg",
            "µs/msg",
            "busy",
            "B/msg",
            "pages/msg"
        )?;
        for (mode, runs) in &self.rounds {
            let mode = mode.as_str();
            let median_of =
                |pick: fn(&Measurement) -> Option<f64>| median(runs.iter().filter_map(pick));
            let rate = median_of(|m| Some(m.rate)).unwrap_or(0.0);
            let of_ceiling = ratio(&rates(mode), &ceiling);
            let show = |value: Option<f64>, precision: usize| {
                value.map_or("-".to_owned(), |v| format!("{v:.precision$}"))
            };
            writeln!(
                f,
                "{:<42} {:>10.0} {:>10} {:>11} {:>13} {:>13} {:>13} {:>11} {:>6} {:>10} {:>10}",
                label(mode),
                rate,
                show(of_ceiling, 2),
                show(median_of(|m| m.cpu_us_per_message), 1),
                show(median_of(|m| m.peak_rss_mib), 1),
                show(median_of(|m| m.postgres_us_per_message), 1),
                show(median_of(|m| m.rabbitmq_us_per_message), 1),
                show(median_of(Measurement::all_cpu_us_per_message), 1),
                show(median_of(Measurement::cores_busy), 2),
                show(median_of(|m| m.wal_bytes_per_message), 0),
                show(median_of(|m| m.wal_fpi_per_message), 3),
            )?;
        }
        if let Some(times) = ratio(&rates(BATCH), &rates(PER_MESSAGE)) {
            writeln!(f, "batch / per-message: {times:.1} ×")?;
        }
        if let Some(times) = ratio(&rates(BATCH_OUTBOX), &rates(BATCH)) {
            writeln!(f, "batch, outbox on / off: {times:.2} ×")?;
        }
        let rabbitmq = |mode: &str| {
            self.runs(mode)
                .and_then(|runs| median(runs.iter().filter_map(|m| m.rabbitmq_us_per_message)))
        };
        if let (Some(on), Some(off), Some(alone)) = (
            rabbitmq(BATCH_OUTBOX),
            rabbitmq(BATCH),
            rabbitmq(PUBLISHED_ALONE),
        ) && self.credits_per_message > 0.0
        {
            let relayed = (on - off) / self.credits_per_message;
            writeln!(
                f,
                "RabbitMQ CPU per credit: relayed {relayed:.1} µs (outbox on less off), \
                 published alone {alone:.1} µs ({:.2} ×)",
                relayed / alone
            )?;
        }
        let all_cpu = |mode: &str| -> Vec<f64> {
            self.runs(mode)
                .map(|runs| {
                    runs.iter()
                        .filter_map(Measurement::all_cpu_us_per_message)
                        .collect()
                })
                .unwrap_or_default()
        };
        for (idem, contender) in [(PER_MESSAGE, TEXTBOOK), (BATCH, BATCHED)] {
            if let Some(throughput) = ratio(&rates(idem), &rates(contender)) {
                let against = label(contender)
                    .split_once(", ")
                    .map_or(contender, |(_, c)| c);
                write!(
                    f,
                    "{} / {against}: throughput {throughput:.2} ×",
                    label(idem)
                )?;
                if let Some(cpu) = ratio(&all_cpu(idem), &all_cpu(contender)) {
                    write!(f, ", all-process CPU per message {cpu:.2} ×")?;
                }
                writeln!(f)?;
            }
        }
        for (mode, _) in &self.rounds {
            if let Some(times) = mode
                .strip_suffix(REMOVING)
                .and_then(|without| ratio(&rates(mode), &rates(without)))
            {
                writeln!(f, "{} / without: {times:.2} ×", label(mode))?;
                continue;
            }
            if [TEXTBOOK, BATCHED].contains(&mode.as_str()) {
                continue;
            }
            for plain in [PER_MESSAGE, PER_MESSAGE_BASELINE, BATCH, BATCH_BASELINE] {
                if let Some(times) = mode
                    .strip_prefix(plain)
                    // A prefilled run of that build, not another build.
                    .filter(|rest| {
                        rest.strip_prefix(", ")
                            .and_then(|rest| rest.strip_suffix(" records before"))
                            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
                    })
                    .and_then(|_| ratio(&rates(mode), &rates(plain)))
                {
                    writeln!(f, "{} / on an empty table: {times:.2} ×", label(mode))?;
                }
            }
        }
        let cpu = |mode: &str| -> Vec<f64> {
            self.runs(mode)
                .map(|runs| runs.iter().filter_map(|m| m.cpu_us_per_message).collect())
                .unwrap_or_default()
        };
        for (build, baseline) in [
            (PER_MESSAGE, PER_MESSAGE_BASELINE),
            (BATCH, BATCH_BASELINE),
            (BATCH_OUTBOX, BATCH_OUTBOX_BASELINE),
        ] {
            if let (Some(throughput), Some(worker_cpu)) = (
                ratio(&rates(build), &rates(baseline)),
                ratio(&cpu(build), &cpu(baseline)),
            ) {
                writeln!(
                    f,
                    "{} / baseline build: throughput {throughput:.3} ×, worker CPU per message {worker_cpu:.3} ×",
                    label(build)
                )?;
            }
        }
        let tps = |runs: &[Pgbench]| runs.iter().map(|run| run.tps).collect::<Vec<_>>();
        let postgres = |runs: &[Pgbench]| median(runs.iter().filter_map(|run| run.postgres_us));
        for (name, runs) in [
            (
                "per-message transaction (the claim straight into the current epoch and the tally in one statement)",
                &self.pgbench,
            ),
            (
                "the same as the general path's five statements",
                &self.pgbench_general,
            ),
            (
                "the textbook transaction (BEGIN, record, upsert, COMMIT)",
                &self.pgbench_textbook,
            ),
        ] {
            if let Some(rate) = median(tps(runs).into_iter()) {
                let cpu = postgres(runs).map_or("-".to_owned(), |us| format!("{us:.0}"));
                writeln!(
                    f,
                    "pgbench, 16 clients, {name}: {rate:.0} tps, PostgreSQL CPU {cpu} µs/tx"
                )?;
            }
        }
        if let Some(times) = ratio(&rates(PER_MESSAGE), &tps(&self.pgbench)) {
            writeln!(
                f,
                "per-message mode / pgbench of its transaction: {times:.2} ×"
            )?;
        }
        if let Some(times) = ratio(&tps(&self.pgbench), &tps(&self.pgbench_textbook)) {
            writeln!(
                f,
                "pgbench, idem's transaction / the textbook's: {times:.2} × the tps"
            )?;
        }
        let cpu_ratio = median(
            self.pgbench
                .iter()
                .zip(&self.pgbench_textbook)
                .filter_map(|(idem, textbook)| Some(idem.postgres_us? / textbook.postgres_us?)),
        );
        if let Some(times) = cpu_ratio {
            writeln!(
                f,
                "pgbench, idem's transaction / the textbook's: {times:.2} × the PostgreSQL CPU"
            )?;
        }
        let rounds = self
            .rounds
            .iter()
            .map(|(_, runs)| runs.len())
            .max()
            .unwrap_or(0);
        write!(
            f,
            "rounds: {rounds}; every run checked: exact totals, one record per event, nothing dead-lettered"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::prefill_layout;

    #[test]
    fn a_prefill_is_laid_out_as_epochs_closed_by_size_leave_it() {
        // Closed epochs of at most the worker's share, the current one half
        // full, every record somewhere.
        assert_eq!(
            prefill_layout(20_000_000, None, 4_000_000),
            vec![3_600_000; 5]
                .into_iter()
                .chain([2_000_000])
                .collect::<Vec<_>>()
        );
        assert_eq!(prefill_layout(1_000, None, 4_000_000), vec![1_000]);
        assert_eq!(prefill_layout(5_000, None, 4_000), vec![3_000, 2_000]);
        // No opening by size: one epoch; epochs asked for: as many, even.
        assert_eq!(prefill_layout(7, None, 0), vec![7]);
        assert_eq!(prefill_layout(7, Some(3), 4_000_000), vec![3, 2, 2]);
    }
}
