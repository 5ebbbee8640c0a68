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
    /// per-message mode, a batched consumer beside batch mode (with the
    /// settings of [`BatchedPeer`]).
    pub contenders: bool,
    /// The batched contender's settings.
    pub peer: BatchedPeer,
    /// Beside each of idem's modes, the same load on a queue ordered per
    /// order over this many slots (each event's key in its header), and in
    /// batch mode once more with one key poisoned: its first event fails
    /// every attempt, so its key is parked while every other key flows.
    pub ordered: Option<u16>,
    /// Beside each of idem's modes, the same load with the worker's
    /// `--ack-after-standbys` set to this.
    pub ack_after_standbys: Option<u32>,
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

pub(super) const CEILING: &str = "1 ceiling (ack multiple, no database)";
pub(super) const PER_MESSAGE: &str = "2 per-message";
pub(super) const PER_MESSAGE_BASELINE: &str = "2 per-message, baseline build";
pub(super) const BATCH: &str = "3 batch";
pub(super) const BATCH_BASELINE: &str = "3 batch, baseline build";
pub(super) const PER_MESSAGE_ORDERED: &str = "2 per-message, ordered per key";
pub(super) const BATCH_ORDERED: &str = "3 batch, ordered per key";
pub(super) const BATCH_POISONED: &str = "3 batch, ordered, one key poisoned";
pub(super) const PER_MESSAGE_STANDBYS: &str = "2 per-message, acked after the standbys";
pub(super) const BATCH_STANDBYS: &str = "3 batch, acked after the standbys";
pub(super) const BATCH_OUTBOX: &str = "4 batch, outbox on (applied and sent)";
pub(super) const BATCH_OUTBOX_BASELINE: &str = "4 batch, outbox on, baseline build";
pub(super) const PUBLISHED_ALONE: &str = "5 credits published alone, per credit";
/// idem's consume records, where the bench counts a worker's progress.
pub(super) const IDEM_RECORDS: &str = "mq_consume_record";
pub(super) const TEXTBOOK: &str = "2 per-message, textbook consumer";
pub(super) const BATCHED: &str = "3 batch, straightforward batched consumer";

/// Where the bench's credits go (the outbox run's).
pub(super) fn credited_queue(topology: &Topology) -> String {
    format!("{}.credited", topology.queue)
}

/// A mode's key without the digit that orders the printout.
pub(super) fn label(key: &str) -> &str {
    key.split_once(' ').map_or(key, |(_, name)| name)
}

/// This build's worker under `keys[0]` and, when there is one, the
/// baseline's under `keys[1]`, the baseline first every other round: what
/// runs second may find the servers warmer, or tired.
pub(super) fn builds<'c>(
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
pub(super) fn over(mode: &str, prefill: u64) -> String {
    match prefill {
        0 => mode.to_owned(),
        n => format!("{mode}, {n} records before"),
    }
}

/// The suffix of a run's key during which the oldest day was removed.
pub(super) const REMOVING: &str = ", a day removed";

/// What a worker run measures, besides the mode.
#[derive(Debug, Clone, Copy)]
pub(super) struct Run {
    /// Where the run's consume records are: idem's, or a contender's.
    pub(super) records: &'static str,
    /// The run's consume records are those whose id is above it.
    pub(super) floor: i64,
    /// The run is done once every outgoing message is sent too.
    pub(super) outbox: bool,
    /// Half-way through, the oldest of this many prefilled days is removed.
    pub(super) removal: Option<usize>,
    /// The poisoned key's events fail ([`Bench::poison`]): the run is done
    /// once every other key's are applied and its later ones parked.
    pub(super) poisoned: bool,
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
pub(super) async fn remove_oldest_day(
    pool: Pool,
    epochs: usize,
) -> anyhow::Result<(Vec<i32>, Duration)> {
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
    pub(super) fn runs(&self, key: &str) -> Option<&Vec<Measurement>> {
        self.rounds
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, runs)| runs)
    }

    pub(super) fn push(&mut self, key: String, measured: Measurement) {
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

mod pgbench;
mod probes;
mod report;
mod run;

use pgbench::*;
use probes::*;
use run::Bench;

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

/// The batched contender's settings, swept to find its best
/// (`--peer-batch-size`, `--peer-in-flight`, `--peer-prefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchedPeer {
    /// Deliveries per transaction (or what came within 5 ms).
    pub batch_size: usize,
    /// Batches in flight on its pool.
    pub in_flight: usize,
    /// Its consumer's prefetch.
    pub prefetch: u16,
}
