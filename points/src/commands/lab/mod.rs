//! `idem lab`: the deduplication strategies a team might choose, side by
//! side on the same duplicated load with concurrent consumers, under the
//! same injected faults, and what each does to the effect.
//!
//! Every strategy has a schema (`<name>_<strategy>`), a queue
//! (`<name>.<strategy>`) and Redis keys (`<name>:<strategy>:…`) of its own,
//! made at the start and removed at the end. Every event credits an order
//! of its own with 100 points, so an order's points tell how often its
//! event was applied. The faults hit an event's first delivery only, so the
//! redelivery shows what the strategy left behind; the races are held open
//! by a gate rather than left to chance, so every run gives the same table.

mod run;
mod strategy;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

pub use idem::trial::Exactness;
pub use run::{Fault, Outcome};
pub use strategy::{Step, Strategy};

use idem::broker::{AmqpConfig, close, connect};
use idem::secret::SecretUrl;
use idem::store::{DatabaseConfig, is_identifier};
use idem::trial::{Load, Repeats};
use run::{Shape, Stage};

/// What the lab runs, and where.
#[derive(Debug, Clone)]
pub struct LabConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The database; every strategy gets a schema of its own in it.
    pub database: DatabaseConfig,
    /// Redis, for the strategy that keeps its record there.
    pub redis_url: SecretUrl,
    /// Start of the lab's schemas, queues and keys.
    pub name: String,
    /// The strategies to compare.
    pub strategies: Vec<Strategy>,
    /// Events per fault (and per step the consumer is killed after).
    pub events: usize,
    /// Copies of an event delivered at once, each to a consumer of its own.
    pub copies: usize,
    /// Messages of the fault-free load, 10 % duplicates among them.
    pub load: usize,
    /// Consumers of the fault-free load.
    pub consumers: usize,
    /// Times the fault-free load runs; the throughput is the median.
    pub rounds: usize,
    /// Prefetch of each consumer of the fault-free load (under the faults:
    /// one, so that a killed consumer takes back only the message it holds).
    pub prefetch: u16,
    /// Expiry of the Redis keys, as a team would set it: longer than any
    /// run of the lab.
    pub redis_ttl: Duration,
    /// Expiry of the Redis keys when a copy comes back after the TTL:
    /// short, so that the lab sees them expire.
    pub short_ttl: Duration,
    /// How long the gate holds a copy for the others to catch up; a copy
    /// that a lock holds back never does.
    pub gate_timeout: Duration,
    /// Seed of where the load's duplicates go.
    pub seed: u64,
    /// How long one run may take.
    pub patience: Duration,
}

impl LabConfig {
    /// The name of the lab's objects unless said otherwise.
    pub const DEFAULT_NAME: &'static str = "idem_lab";

    /// Every strategy, on `amqp`, `database` and the Redis at `redis_url`.
    pub fn new(amqp: AmqpConfig, database: DatabaseConfig, redis_url: SecretUrl) -> Self {
        Self {
            amqp,
            database,
            redis_url,
            name: Self::DEFAULT_NAME.into(),
            strategies: Strategy::ALL.to_vec(),
            events: 20,
            copies: 3,
            load: 2000,
            consumers: 4,
            rounds: 3,
            prefetch: 16,
            redis_ttl: Duration::from_secs(3600),
            short_ttl: Duration::from_secs(1),
            gate_timeout: Duration::from_millis(300),
            seed: 1,
            patience: Duration::from_secs(60),
        }
    }

    fn check(&self) -> anyhow::Result<()> {
        if !is_identifier(&self.name) {
            bail!(
                "--name `{}` is not a plain identifier (letters, digits, _; not starting with a digit)",
                self.name
            );
        }
        if self.copies < 2 {
            bail!("--copies must be at least 2: one copy cannot race");
        }
        if self.events == 0 || self.load == 0 || self.consumers == 0 || self.rounds == 0 {
            bail!("--events, --load, --consumers and --rounds must be at least 1");
        }
        Ok(())
    }
}

/// A column of the report: the runs it adds up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    /// [`Fault::None`].
    Load,
    /// [`Fault::SameEventAtOnce`].
    AtOnce,
    /// [`Fault::Killed`], after any step.
    Killed,
    /// [`Fault::EffectFails`].
    EffectFails,
    /// [`Fault::ComesBackAfterTtl`].
    AfterTtl,
}

impl Column {
    /// Every column, in the order of the report.
    pub const ALL: [Column; 5] = [
        Column::Load,
        Column::AtOnce,
        Column::Killed,
        Column::EffectFails,
        Column::AfterTtl,
    ];

    fn holds(self, fault: Fault) -> bool {
        matches!(
            (self, fault),
            (Column::Load, Fault::None)
                | (Column::AtOnce, Fault::SameEventAtOnce)
                | (Column::Killed, Fault::Killed(_))
                | (Column::EffectFails, Fault::EffectFails)
                | (Column::AfterTtl, Fault::ComesBackAfterTtl)
        )
    }
}

/// One strategy's runs.
#[derive(Debug, Clone)]
pub struct Row {
    /// The strategy.
    pub strategy: Strategy,
    /// Every fault it ran under, in order.
    pub runs: Vec<(Fault, Outcome)>,
}

impl Row {
    /// What the runs of `column` did to the effect, added up.
    pub fn tally(&self, column: Column) -> Exactness {
        let mut tally = Exactness::default();
        for (_, outcome) in self.runs.iter().filter(|(f, _)| column.holds(*f)) {
            tally.add(outcome.tally);
        }
        tally
    }

    /// Messages per second of the fault-free load, the median of its rounds.
    pub fn throughput(&self) -> Option<f64> {
        let mut rates: Vec<f64> = self
            .runs
            .iter()
            .filter(|(fault, _)| *fault == Fault::None)
            .map(|(_, o)| o.messages as f64 / o.elapsed.as_secs_f64().max(1e-9))
            .collect();
        rates.sort_by(f64::total_cmp);
        rates.get(rates.len() / 2).copied()
    }

    /// Never doubled nor lost an event, under any fault.
    pub fn clean(&self) -> bool {
        self.runs.iter().all(|(_, o)| o.tally.clean())
    }

    /// Version conflicts read again, in every run.
    pub fn conflicts(&self) -> u64 {
        self.runs.iter().map(|(_, o)| o.conflicts).sum()
    }

    /// What went wrong, and under which fault (or step); the rounds of
    /// the load added up.
    pub fn causes(&self) -> Vec<String> {
        let mut faults: Vec<(Fault, Exactness)> = Vec::new();
        for (fault, outcome) in &self.runs {
            match faults.iter_mut().find(|(f, _)| f == fault) {
                Some((_, tally)) => tally.add(outcome.tally),
                None => faults.push((*fault, outcome.tally)),
            }
        }
        faults
            .into_iter()
            .filter(|(_, tally)| !tally.clean())
            .map(|(fault, tally)| {
                let mut said = Vec::new();
                if tally.twice > 0 {
                    said.push(format!("{} of {} applied twice", tally.twice, tally.events));
                }
                if tally.lost > 0 {
                    said.push(format!("{} of {} lost", tally.lost, tally.events));
                }
                format!("{}: {}", describe(fault), said.join(", "))
            })
            .collect()
    }
}

fn describe(fault: Fault) -> String {
    match fault {
        Fault::None => "the fault-free load".into(),
        Fault::SameEventAtOnce => "the same event at once".into(),
        Fault::Killed(step) => format!("consumer killed {}", step.after()),
        Fault::EffectFails => "the points statement failing".into(),
        Fault::ComesBackAfterTtl => "a copy coming back after the key's TTL".into(),
    }
}

/// What the lab saw.
#[derive(Debug, Clone)]
pub struct LabReport {
    /// One row per strategy, in the order asked.
    pub rows: Vec<Row>,
    /// Events per fault.
    pub events: usize,
    /// Copies of an event at once.
    pub copies: usize,
    /// Messages of the fault-free load.
    pub load: usize,
    /// Its consumers.
    pub consumers: usize,
    /// Its rounds.
    pub rounds: usize,
}

impl LabReport {
    /// The row of `strategy`, if it ran.
    pub fn row(&self, strategy: Strategy) -> Option<&Row> {
        self.rows.iter().find(|row| row.strategy == strategy)
    }
}

/// Runs every strategy of `config` under every fault; removes what it made.
pub async fn run(config: &LabConfig) -> anyhow::Result<LabReport> {
    config.check()?;
    let mut admin = config.database.clone();
    admin.schema = None;
    admin.pool_size = 1;
    let admin = admin.pool()?;
    // Every service answers before anything of theirs is changed.
    let client = admin.get().await.context("cannot reach PostgreSQL")?;
    let connection = Arc::new(connect(&config.amqp, "idem lab").await?);
    let redis = redis_client(&config.redis_url)?;
    let mut ping = redis
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("cannot reach Redis at {}", config.redis_url.redacted()))?;
    let _: String = redis::cmd("PING").query_async(&mut ping).await?;
    drop(client);

    let mut rows = Vec::new();
    let mut result = Ok(());
    for &strategy in &config.strategies {
        let stage = Stage {
            strategy,
            queue: format!("{}.{}", config.name, strategy.slug()),
            pool: {
                let mut database = config
                    .database
                    .clone()
                    .with_schema(schema(config, strategy));
                database.pool_size = config.consumers.max(config.copies) + 2;
                database.pool()?
            },
            redis: redis.clone(),
            amqp: config.amqp.clone(),
            connection: connection.clone(),
            key_prefix: format!("{}:{}", config.name, strategy.slug()),
            redis_ttl: config.redis_ttl,
            short_ttl: config.short_ttl,
            gate_timeout: config.gate_timeout,
            patience: config.patience,
        };
        let ran = async {
            reset(&admin, &connection, config, &stage).await?;
            runs(&stage, config).await
        }
        .await;
        match ran {
            Ok(runs) => rows.push(Row { strategy, runs }),
            Err(e) => {
                result = Err(e.context(format!("strategy {}", strategy.slug())));
                break;
            }
        }
    }
    let removed = remove(&admin, &connection, config).await;
    close(&connection).await;
    result?;
    removed?;
    Ok(LabReport {
        rows,
        events: config.events,
        copies: config.copies,
        load: config.load,
        consumers: config.consumers,
        rounds: config.rounds,
    })
}

/// A client for `url`; an error names what is wrong without echoing the
/// string, which may be all secret.
fn redis_client(url: &SecretUrl) -> anyhow::Result<redis::Client> {
    if url.expose().starts_with("rediss:") {
        bail!("REDIS_URL: the lab speaks to Redis without TLS (redis://), not rediss://");
    }
    redis::Client::open(url.expose()).map_err(|_| {
        anyhow::anyhow!("REDIS_URL is not a Redis URL (redis://[[user]:password@]host[:port][/db])")
    })
}

/// One strategy under every fault, one after the other.
async fn runs(stage: &Stage, config: &LabConfig) -> anyhow::Result<Vec<(Fault, Outcome)>> {
    let faulty = Shape {
        events: config.events,
        load: Load {
            repeats: Repeats::once(config.seed),
            consumers: 2,
        },
        prefetch: 1,
    };
    let load = Shape {
        events: ((config.load as f64) / 1.1).round().max(1.0) as usize,
        load: Load {
            repeats: Repeats {
                extra: 0.1,
                ..faulty.load.repeats
            },
            consumers: config.consumers,
        },
        prefetch: config.prefetch,
    };
    let mut plan: Vec<_> = (0..config.rounds)
        .map(|round| (Fault::None, format!("load-{round}"), load.clone()))
        .collect();
    plan.push((
        Fault::SameEventAtOnce,
        "at-once".to_owned(),
        Shape {
            load: Load {
                repeats: Repeats {
                    copies: config.copies,
                    ..faulty.load.repeats
                },
                consumers: config.copies,
            },
            ..faulty.clone()
        },
    ));
    for &step in stage.strategy.crash_points() {
        plan.push((
            Fault::Killed(step),
            format!("killed-{step:?}").to_lowercase(),
            faulty.clone(),
        ));
    }
    plan.push((Fault::EffectFails, "fails".to_owned(), faulty.clone()));
    plan.push((Fault::ComesBackAfterTtl, "after-ttl".to_owned(), faulty));
    let mut outcomes = Vec::new();
    for (fault, label, shape) in plan {
        let outcome = stage
            .run(fault, &label, &shape)
            .await
            .with_context(|| describe(fault))?;
        outcomes.push((fault, outcome));
    }
    Ok(outcomes)
}

fn schema(config: &LabConfig, strategy: Strategy) -> String {
    format!("{}_{}", config.name, strategy.identifier())
}

/// A new schema with the strategy's tables, and an empty queue.
async fn reset(
    admin: &deadpool_postgres::Pool,
    connection: &lapin::Connection,
    config: &LabConfig,
    stage: &Stage,
) -> anyhow::Result<()> {
    let schema = schema(config, stage.strategy);
    let client = admin.get().await?;
    client
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
             SET search_path = {schema}; {} RESET search_path;",
            stage.strategy.schema()
        ))
        .await
        .with_context(|| format!("cannot create schema {schema}"))?;
    let channel = connection.create_channel().await?;
    channel
        .queue_delete(stage.queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    channel
        .queue_declare(
            stage.queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    idem::broker::close_channel(&channel).await;
    Ok(())
}

/// Drops every strategy's schema and queue.
async fn remove(
    admin: &deadpool_postgres::Pool,
    connection: &lapin::Connection,
    config: &LabConfig,
) -> anyhow::Result<()> {
    let client = admin.get().await?;
    let channel = connection.create_channel().await?;
    for &strategy in &config.strategies {
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {} CASCADE",
                schema(config, strategy)
            ))
            .await?;
        channel
            .queue_delete(
                format!("{}.{}", config.name, strategy.slug())
                    .as_str()
                    .into(),
                QueueDeleteOptions::default(),
            )
            .await?;
    }
    idem::broker::close_channel(&channel).await;
    Ok(())
}

impl fmt::Display for LabReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "idem lab: {} events per fault (per step, when a consumer is killed), \
             {} copies of each at once;",
            self.events, self.copies
        )?;
        writeln!(
            f,
            "a {}-message load (10 % duplicates) on {} consumers, median of {} rounds. \
             Cells: events applied twice / events lost.",
            self.load, self.consumers, self.rounds
        )?;
        writeln!(f)?;
        let header = format!(
            "{:<30} {:<17}  {:<10} {:<10} {:<10} {:<10}",
            "", "fault-free load", "same event", "consumer", "effect", "copy back"
        );
        writeln!(f, "{}", header.trim_end())?;
        let header = format!(
            "{:<30} {:>7}  {:<8}  {:<10} {:<10} {:<10} {:<10}",
            "strategy", "msgs/s", "2× / lost", "at once", "killed", "fails", "after TTL"
        );
        writeln!(f, "{}", header.trim_end())?;
        for row in &self.rows {
            let cell = |column| {
                let tally = row.tally(column);
                format!("{} / {}", tally.twice, tally.lost)
            };
            let line = format!(
                "{:<30} {:>7.0}  {:<8}  {:<10} {:<10} {:<10} {:<10}",
                row.strategy.title(),
                row.throughput().unwrap_or(0.0),
                cell(Column::Load),
                cell(Column::AtOnce),
                cell(Column::Killed),
                cell(Column::EffectFails),
                cell(Column::AfterTtl),
            );
            writeln!(f, "{}", line.trim_end())?;
        }
        writeln!(f)?;
        writeln!(f, "What caused it:")?;
        for row in &self.rows {
            let causes = row.causes();
            let mut said = if causes.is_empty() {
                "nothing doubled, nothing lost".to_owned()
            } else {
                causes.join("; ")
            };
            if row.conflicts() > 0 {
                said.push_str(&format!(
                    " ({} version conflicts, read again)",
                    row.conflicts()
                ));
            }
            writeln!(f, "  {}: {said}", row.strategy.title())?;
        }
        Ok(())
    }
}
