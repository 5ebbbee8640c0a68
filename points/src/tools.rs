//! What only the points binary has: `demo`, `bench`, `lab`, and `publish`'s
//! sources of its own (one event from flags, a generated load),
//! on top of the commands every handler's binary gets from [`idem::cli`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use tokio_util::sync::CancellationToken;

use idem::broker::Exchange;
use idem::cli::{
    AmqpArgs, Commands, DatabaseArgs, PublishSources, SettingError, Wait, WorkerFlags, WorkerStart,
    choice,
};
use idem::secret::SecretUrl;
use idem::vars;
use idem::worker::{Mode, WorkerConfig, WorkerError};
use idem_points::commands::bench::{self, BenchConfig};
use idem_points::commands::contender::{self, Contender, ContenderConfig};
use idem_points::commands::lab::{LabConfig, Strategy};
use idem_points::commands::publish::Source;
use idem_points::commands::{demo, lab};
use idem_points::generate::LoadSpec;
use idem_points::points::{PaymentSucceeded, Points};

/// The points binary's own subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Tools {
    /// Run the whole story on local services, on data of its own, and report.
    Demo(DemoArgs),
    /// Measure throughput against the broker's ceiling, on data of its own.
    Bench(Box<BenchArgs>),
    /// Run the deduplication strategies a team might choose side by side,
    /// under the same faults, and show what each does to the effect.
    Lab(LabArgs),
    /// What `bench` measures idem against: the consumer a team writes
    /// instead (`textbook`, a transaction per message; `batched`, one per
    /// batch), until SIGTERM.
    #[command(hide = true)]
    Contender(ContenderArgs),
}

impl Commands<Points> for Tools {
    fn log_filter(&self) -> &'static str {
        match self {
            // Their reports are the output; the workers' lines are noise.
            Tools::Demo(_) | Tools::Bench(_) | Tools::Lab(_) | Tools::Contender(_) => {
                "warn,lapin=off,tokio_postgres=warn"
            }
        }
    }

    async fn run(self, _: &Points, shutdown: CancellationToken) -> anyhow::Result<ExitCode> {
        match self {
            Tools::Bench(args) => {
                let report = bench::run(&args.config()?, &shutdown).await?;
                println!("{report}");
            }
            Tools::Demo(args) if args.clean => {
                println!(
                    "{}",
                    demo::clean(args.amqp.config(), args.database.config(1)).await?
                );
            }
            Tools::Demo(args) => {
                let report = demo::run(args.amqp.config(), args.database.config(4)).await?;
                println!("{report}");
            }
            Tools::Lab(args) => {
                let report = lab::run(&args.config()).await?;
                println!("{report}");
            }
            Tools::Contender(args) => {
                let (contender, config) = args.config();
                contender::run(contender, &config, &shutdown).await?;
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// The points worker's own flag.
#[derive(Debug, Args)]
pub(crate) struct Credits {
    /// Send a `points.credited` message for every credit, through the
    /// outbox, to this topic exchange (`points.events`, say), which the
    /// worker declares; its consumers bind their queues to it [default:
    /// send nothing].
    #[arg(long, env = vars::CREDITS_EXCHANGE)]
    pub(crate) credits_exchange: Option<String>,
}

impl WorkerFlags<Points> for Credits {
    async fn start(
        self,
        handler: std::sync::Arc<Points>,
        worker: WorkerStart,
    ) -> Result<(), WorkerError> {
        match self.credits_exchange {
            Some(exchange) => {
                let mut worker = worker;
                worker.config.outgoing.push(Exchange::topic(&exchange));
                worker.run(handler.announcing(exchange)).await
            }
            None => worker.run(handler).await,
        }
    }
}

/// The points service's own sources for `publish`, beside idem's `--file`:
/// exactly one of --event-id, --file, --count.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("source").required(true).args(["event_id", "file", "count"]))]
pub(crate) struct Payments {
    /// Publish one event with this id (with --order-id and --points).
    #[arg(long, requires_all = ["order_id", "points"])]
    pub(crate) event_id: Option<String>,
    /// Order of the single event.
    #[arg(long)]
    pub(crate) order_id: Option<String>,
    /// Points of the single event.
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) points: Option<i64>,
    /// Publish this many generated events.
    #[arg(long)]
    pub(crate) count: Option<usize>,
    /// With --count: share of messages that repeat an earlier event.
    #[arg(long, default_value_t = 0.1, value_parser = parse_ratio)]
    pub(crate) duplicate_ratio: f64,
    /// With --count: orders the events are spread over.
    #[arg(long, default_value_t = 100)]
    pub(crate) orders: usize,
    /// With --count: seed of the generator (default: the time).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// With --count: start of the generated ids (default: `load-<seed>`).
    #[arg(long)]
    pub(crate) prefix: Option<String>,
}

/// `demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Remove what the demo leaves behind (its schema, queues and
    /// exchanges) instead of running it.
    #[arg(long)]
    pub(crate) clean: bool,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
}

/// `contender`.
#[derive(Debug, Args)]
pub(crate) struct ContenderArgs {
    /// Which consumer.
    #[arg(value_parser = choice(&Contender::ALL, Contender::as_arg))]
    pub(crate) contender: Contender,
    /// The queue to consume.
    #[arg(long, env = vars::QUEUE)]
    pub(crate) queue: String,
    /// The consumer's prefetch.
    #[arg(long, default_value_t = 500)]
    pub(crate) prefetch: u16,
    /// Textbook: deliveries handled at once; batched: batches in flight.
    #[arg(long, default_value_t = 16)]
    pub(crate) in_flight: usize,
    /// Batched: most deliveries per transaction.
    #[arg(long, default_value_t = 100)]
    pub(crate) batch_size: usize,
    /// Batched: how long a batch waits for more after its first delivery.
    #[arg(long, default_value = "5ms")]
    pub(crate) batch_wait: Wait,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
}

impl ContenderArgs {
    fn config(&self) -> (Contender, ContenderConfig) {
        (
            self.contender,
            ContenderConfig {
                amqp: self.amqp.config(),
                database: self.database.config(self.in_flight),
                queue: self.queue.clone(),
                prefetch: self.prefetch,
                in_flight: self.in_flight,
                batch_size: self.batch_size,
                batch_wait: self.batch_wait.0,
            },
        )
    }
}

/// `bench`.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Messages per run, duplicates included.
    #[arg(long, default_value_t = 200_000)]
    pub(crate) messages: usize,
    /// Share of duplicates in the load.
    #[arg(long, default_value_t = 0.1, value_parser = parse_ratio)]
    pub(crate) duplicate_ratio: f64,
    /// Orders the events are spread over.
    #[arg(long, default_value_t = 1000)]
    pub(crate) orders: usize,
    /// Random UUIDs as the load's event ids (as many producers use)
    /// instead of sequential ones.
    #[arg(long)]
    pub(crate) uuid_ids: bool,
    /// Consume records already in the table before a worker run (random
    /// UUID ids; loaded, then indexed, then checkpointed); several sizes,
    /// comma-separated, run each worker once per size in every round.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub(crate) prefill: Vec<u64>,
    /// The epochs (days of a retention window) the prefilled records are
    /// spread over, the last of them current: the worker inserts into a
    /// day's records and looks into the others through their filters
    /// [default: as the worker's opening by size leaves them: closed epochs
    /// of --epoch-records each, the current one half full].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefill_epochs: Option<u16>,
    /// The workers' --epoch-records [default: theirs].
    #[arg(long)]
    pub(crate) epoch_records: Option<u64>,
    /// Over each prefill, also a run during which the oldest day of the
    /// prefilled records is removed, as `idem prune` does.
    #[arg(long)]
    pub(crate) prune_during: bool,
    /// Prefetch of every consumer measured.
    #[arg(long, default_value_t = Mode::Batch.tuning().prefetch)]
    pub(crate) prefetch: u16,
    /// Batch mode: deliveries per transaction.
    #[arg(long, default_value_t = Mode::Batch.tuning().batch_size)]
    pub(crate) batch_size: usize,
    /// Batch mode: wait for a batch to fill.
    #[arg(long, default_value_t = Wait(WorkerConfig::DEFAULT_BATCH_WAIT))]
    pub(crate) batch_wait: Wait,
    /// Batch mode: transactions in flight.
    #[arg(long, default_value_t = Mode::Batch.tuning().max_in_flight)]
    pub(crate) batch_in_flight: usize,
    /// Per-message mode: transactions in flight.
    #[arg(long, default_value_t = Mode::PerMessage.tuning().max_in_flight)]
    pub(crate) per_message_in_flight: usize,
    /// Rounds; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// Also run pgbench at 16 clients with per-message mode's transaction, the
    /// general path's and the textbook's (BEGIN, record, upsert, COMMIT),
    /// each with PostgreSQL's CPU per transaction.
    #[arg(long)]
    pub(crate) pgbench: bool,
    /// Also run batch mode announcing every credit through the outbox (its
    /// relay in the worker), counted done once every message is sent too.
    #[arg(long)]
    pub(crate) outbox: bool,
    /// The batched peer: deliveries per transaction (the default, with 2
    /// in flight, was the fastest of a sweep: see the guide's
    /// *Performance*).
    #[arg(long, default_value_t = 1000)]
    pub(crate) peer_batch_size: usize,
    /// The batched peer: batches in flight.
    #[arg(long, default_value_t = 2)]
    pub(crate) peer_in_flight: usize,
    /// The batched peer: its prefetch [default: --prefetch].
    #[arg(long)]
    pub(crate) peer_prefetch: Option<u16>,
    /// Leave out the consumers a team would write instead, which run by
    /// default beside per-message mode (the textbook transaction per
    /// message) and batch mode (a transaction per --peer-batch-size
    /// deliveries or 5 ms).
    #[arg(long)]
    pub(crate) no_contenders: bool,
    /// Beside each of idem's modes, the same load on a queue ordered per
    /// order over this many slots, and in batch mode once more with one
    /// order poisoned (its first event fails every attempt): the cost of
    /// order, and of a parked key to every other key.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) ordered: Option<u16>,
    /// Beside each of idem's modes, the same load once more with the
    /// worker's --ack-after-standbys N: against a primary with standbys
    /// (give every host in the database URL), the cost of acking only what
    /// N standbys have flushed.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub(crate) ack_after_standbys: Option<u32>,
    /// What to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ceiling,per-message,batch",
        value_parser = choice(&bench::Mode::ALL, |mode| mode.as_flag())
    )]
    pub(crate) modes: Vec<bench::Mode>,
    /// Another build of idem whose worker is measured beside this one's, in
    /// the same rounds (a build of the main branch, say).
    #[arg(long)]
    pub(crate) baseline: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
}

/// `lab`.
#[derive(Debug, Args)]
pub(crate) struct LabArgs {
    /// Events per fault (and per step a consumer is killed after).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) events: u32,
    /// Copies of an event delivered at once, each to its own consumer.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub(crate) copies: u32,
    /// Messages of the fault-free load (10 % duplicates), for the throughput.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub(crate) load: u32,
    /// Consumers of the fault-free load.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) consumers: u32,
    /// Rounds of the fault-free load; the median throughput is shown.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=99))]
    pub(crate) rounds: u32,
    /// Prefetch of each consumer of the fault-free load.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefetch: u16,
    /// Expiry of the Redis strategy's keys, as a team would set it.
    #[arg(long, default_value = "1h")]
    pub(crate) redis_ttl: Wait,
    /// Their expiry when the lab lets a copy come back after it.
    #[arg(long, default_value = "1s")]
    pub(crate) short_ttl: Wait,
    /// The strategies to run, by name; default: all.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = choice(&Strategy::ALL, Strategy::slug)
    )]
    pub(crate) strategies: Vec<Strategy>,
    /// Seed of where the load's duplicates go.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Start of the lab's schemas, queues and Redis keys (replaced at each run).
    #[arg(long, default_value = LabConfig::DEFAULT_NAME)]
    pub(crate) name: String,
    /// Redis URL (a password in it is never printed).
    #[arg(
        long,
        env = vars::REDIS_URL,
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    pub(crate) redis_url: String,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
}

impl LabArgs {
    /// Settings of `lab`.
    pub(crate) fn config(&self) -> LabConfig {
        let mut config = LabConfig::new(
            self.amqp.config(),
            self.database.config(1),
            SecretUrl::new(self.redis_url.clone()),
        );
        if !self.strategies.is_empty() {
            config.strategies = self.strategies.clone();
        }
        LabConfig {
            events: self.events as usize,
            copies: self.copies as usize,
            load: self.load as usize,
            consumers: self.consumers as usize,
            rounds: self.rounds as usize,
            prefetch: self.prefetch,
            redis_ttl: self.redis_ttl.0,
            short_ttl: self.short_ttl.0,
            seed: self.seed,
            name: self.name.clone(),
            ..config
        }
    }
}

impl PublishSources<Points> for Payments {
    fn bodies(&self, _: &Points) -> Result<Option<Vec<Vec<u8>>>, SettingError> {
        let source = if let (Some(event_id), Some(order_id), Some(points)) =
            (&self.event_id, &self.order_id, self.points)
        {
            let event = PaymentSucceeded {
                event_id: event_id.clone(),
                order_id: order_id.clone(),
                points,
            };
            // The same rules as the worker's, so a flag typo fails here.
            PaymentSucceeded::parse(&event.to_body())
                .map_err(|invalid| SettingError::new(format!("the event is invalid: {invalid}")))?;
            Source::One(event)
        } else if let Some(count) = self.count {
            let seed = self.seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
            });
            Source::Generated(LoadSpec {
                count,
                duplicate_ratio: self.duplicate_ratio,
                orders: self.orders,
                seed,
                prefix: self
                    .prefix
                    .clone()
                    .unwrap_or_else(|| format!("load-{seed}")),
            })
        } else {
            return Ok(None);
        };
        Ok(Some(source.bodies()))
    }
}

impl BenchArgs {
    /// Settings of `bench`.
    pub(crate) fn config(&self) -> Result<BenchConfig, SettingError> {
        let worker_binary = std::env::current_exe().map_err(|e| {
            SettingError::new(format!("cannot find the idem binary to run workers: {e}"))
        })?;
        if let Some(baseline) = &self.baseline
            && !baseline.is_file()
        {
            return Err(SettingError::new(format!(
                "--baseline {}: no such file",
                baseline.display()
            )));
        }
        if self.outbox && !self.modes.contains(&bench::Mode::Batch) {
            return Err(SettingError::new(
                "--outbox measures batch mode: add batch to --modes",
            ));
        }
        // The report takes each size's runs for rounds, one per round.
        if let Some(size) = self
            .prefill
            .iter()
            .enumerate()
            .find_map(|(i, size)| self.prefill[..i].contains(size).then_some(size))
        {
            return Err(SettingError::new(format!(
                "--prefill gives {size} twice: give each size once, and --rounds to repeat them"
            )));
        }
        Ok(BenchConfig {
            amqp: self.amqp.config(),
            database: self.database.config(2),
            messages: self.messages,
            duplicate_ratio: self.duplicate_ratio,
            orders: self.orders,
            uuid_ids: self.uuid_ids,
            prefill: self.prefill.clone(),
            prefill_epochs: self.prefill_epochs,
            epoch_records: self.epoch_records,
            prune_during: self.prune_during,
            prefetch: self.prefetch,
            batch_size: self.batch_size,
            batch_wait: self.batch_wait.0,
            batch_in_flight: self.batch_in_flight,
            per_message_in_flight: self.per_message_in_flight,
            rounds: self.rounds.max(1),
            pgbench: self.pgbench,
            outbox: self.outbox,
            contenders: !self.no_contenders,
            peer: bench::BatchedPeer {
                batch_size: self.peer_batch_size.max(1),
                in_flight: self.peer_in_flight.max(1),
                prefetch: self.peer_prefetch.unwrap_or(self.prefetch),
            },
            modes: self.modes.clone(),
            ordered: self.ordered,
            ack_after_standbys: self.ack_after_standbys,
            worker_binary,
            baseline_binary: self.baseline.clone(),
        })
    }
}

fn parse_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!("'{text}' is not a ratio between 0 and 1")),
    }
}
