//! `idem reconcile`: the upstream's list of the events it sent, compared
//! with what idem recorded. Each event is applied, dead-lettered (in the
//! dead-letter queue), failing (in the failure ledger, attempts left) or
//! missing (never seen, or not yet: one still in the work queue shows as
//! missing until it is applied). For a handler whose effect is a tally, the
//! expected amount of every key is compared with its row.
//!
//! The export is read a chunk at a time, with one query per chunk and table:
//! millions of events take neither millions of queries nor their memory.
//! The dead-letter queue is read once, at the start (it is listed, not
//! emptied); the per-key totals are kept, one number per key.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::PathBuf;

use anyhow::Context;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::broker::{Outgoing, PublishOptions, Topology, publish_all};
use crate::dlq::{self, Action, DlqConfig};
use crate::handler::{Handler, Tally};

/// Invalid lines and differing totals shown in the summary.
pub const SHOWN: usize = 10;

/// What to compare, and what to do about it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReconcileConfig {
    /// The dead-letter queue, the database and the consumer group.
    pub dlq: DlqConfig,
    /// Where missing events are republished to.
    pub topology: Topology,
    /// The upstream's export: JSON lines (one body per line), or CSV with a
    /// header (each row becomes a JSON object of its columns; a column that
    /// reads as an integer is one).
    pub export: PathBuf,
    /// Where to write the report (JSON lines: one per event, and per line
    /// that is none, then one per key whose total differs); none: no file.
    pub report: Option<PathBuf>,
    /// Publish the missing events again, with confirms.
    pub republish_missing: bool,
    /// Events compared per query.
    pub chunk: usize,
}

impl ReconcileConfig {
    /// Events per chunk unless said otherwise.
    pub const DEFAULT_CHUNK: usize = 10_000;

    /// Compares the upstream's `export` with what `dlq`'s consumer group
    /// applied, on `topology`; writes no report and republishes nothing.
    pub fn new(dlq: DlqConfig, topology: Topology, export: impl Into<PathBuf>) -> Self {
        Self {
            dlq,
            topology,
            export: export.into(),
            report: None,
            republish_missing: false,
            chunk: Self::DEFAULT_CHUNK,
        }
    }
}

/// Where an event stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Its consume record exists: its effect was applied.
    Applied,
    /// In the dead-letter queue, with its last error (or the broker's
    /// reason).
    DeadLettered(String),
    /// Failing: the ledger counts its failures; it has attempts left.
    Failing {
        /// Failures so far.
        failures: i32,
        /// The last one's error.
        last_error: String,
    },
    /// Nowhere idem can see.
    Missing,
}

impl Fate {
    fn name(&self) -> &'static str {
        match self {
            Fate::Applied => "applied",
            Fate::DeadLettered(_) => "dead_lettered",
            Fate::Failing { .. } => "failing",
            Fate::Missing => "missing",
        }
    }
}

/// A key whose total is not what the export adds up to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TotalDiffers {
    /// The key (an order, for the points handler).
    pub key: String,
    /// What the export's events add up to.
    pub expected: i64,
    /// What the table holds.
    pub actual: i64,
}

/// What a reconciliation found.
#[derive(Debug, Default)]
pub struct Reconciliation {
    /// Distinct events in the export.
    pub events: u64,
    /// Of those, applied.
    pub applied: u64,
    /// Dead-lettered.
    pub dead_lettered: u64,
    /// Failing.
    pub failing: u64,
    /// Missing.
    pub missing: u64,
    /// Lines that are no event of the handler's contract.
    pub invalid: u64,
    /// The first [`SHOWN`] of them: line number and why (the report file
    /// has them all).
    pub invalid_lines: Vec<(u64, String)>,
    /// Lines that repeat an event of the same chunk.
    pub repeated: u64,
    /// Keys whose totals were compared.
    pub keys: u64,
    /// Of those, the ones that differ.
    pub totals_differ: Vec<TotalDiffers>,
    /// Missing events published again (confirmed).
    pub republished: u64,
    /// Where the report went.
    pub report: Option<PathBuf>,
}

impl Reconciliation {
    /// Everything the export lists was applied, and every total matches.
    pub fn matched(&self) -> bool {
        self.applied == self.events && self.invalid == 0 && self.totals_differ.is_empty()
    }
}

/// Compares the export with what idem recorded; see the module's text.
pub async fn run<H: Handler>(
    config: &ReconcileConfig,
    handler: &H,
    shutdown: &CancellationToken,
) -> crate::error::CommandResult<Reconciliation> {
    Ok(compare(config, handler, shutdown).await?)
}

/// [`run`].
async fn compare<H: Handler>(
    config: &ReconcileConfig,
    handler: &H,
    shutdown: &CancellationToken,
) -> anyhow::Result<Reconciliation> {
    let dead = dead_letters(config, handler, shutdown).await?;
    let pool = config.dlq.target.database.pool()?;
    let client = pool
        .get()
        .await
        .with_context(|| format!("reading {}", config.dlq.target.database.describe()))?;
    let file = std::fs::File::open(&config.export)
        .with_context(|| format!("cannot read {}", config.export.display()))?;
    let mut lines = Lines::new(BufReader::new(file), &config.export)?;
    let mut report = match &config.report {
        Some(path) => Some(BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot write {}", path.display()))?,
        )),
        None => None,
    };
    let tally = handler.tally();
    let mut totals: BTreeMap<String, i64> = BTreeMap::new();
    let mut found = Reconciliation {
        report: config.report.clone(),
        ..Reconciliation::default()
    };
    let group = config.dlq.target.consumer_group.as_str();
    loop {
        let chunk = lines.next_chunk(config.chunk.max(1))?;
        if chunk.is_empty() {
            break;
        }
        let mut events = Vec::with_capacity(chunk.len());
        let mut seen = HashSet::with_capacity(chunk.len());
        for (line, body) in chunk {
            match handler.decode(&body) {
                Ok(event) => {
                    let id = handler.event_id(&event).to_owned();
                    if !seen.insert(id.clone()) {
                        found.repeated += 1;
                        continue;
                    }
                    if let Some(tally) = &tally {
                        let (key, amount) = (tally.entry)(&event);
                        *totals.entry(key.to_owned()).or_default() += amount;
                    }
                    events.push((id, body));
                }
                Err(invalid) => {
                    found.invalid += 1;
                    if let Some(report) = report.as_mut() {
                        writeln!(
                            report,
                            "{}",
                            json!({"line": line, "invalid": invalid.reason()})
                        )?;
                    }
                    if found.invalid_lines.len() < SHOWN {
                        found.invalid_lines.push((line, invalid.to_string()));
                    }
                }
            }
        }
        let ids: Vec<&str> = events.iter().map(|(id, _)| id.as_str()).collect();
        let recorded = crate::store::recorded(&client, group, &ids).await?;
        let ledger = ledger_of(&client, group, &ids).await?;
        let mut missing = Vec::new();
        for (id, body) in events {
            let fate = fate_of(&id, &recorded, &dead, &ledger);
            found.count(&fate);
            if let Fate::Missing = fate {
                missing.push(body);
            }
            if let Some(report) = report.as_mut() {
                writeln!(report, "{}", event_line(&id, &fate))?;
            }
        }
        if config.republish_missing && !missing.is_empty() {
            found.republished += republish(config, missing, shutdown).await?;
        }
    }
    if let Some(tally) = &tally {
        found.keys = totals.len() as u64;
        found.totals_differ = compare_totals(&client, tally, &totals, config.chunk).await?;
    }
    if let Some(report) = report.as_mut() {
        for differs in &found.totals_differ {
            writeln!(
                report,
                "{}",
                json!({"key": differs.key, "expected": differs.expected, "actual": differs.actual})
            )?;
        }
        report.flush()?;
    }
    Ok(found)
}

/// The dead letters' event ids, with the broker's reason for each.
async fn dead_letters<H: Handler>(
    config: &ReconcileConfig,
    handler: &H,
    shutdown: &CancellationToken,
) -> anyhow::Result<HashMap<String, String>> {
    let listing = dlq::run(&config.dlq, &Action::List, handler, shutdown).await?;
    Ok(listing
        .listed
        .into_iter()
        .filter_map(|entry| {
            let reason = entry
                .death
                .as_ref()
                .map_or_else(|| "dead-lettered".to_owned(), |death| death.reason.clone());
            entry.event_id.map(|id| (id, reason))
        })
        .collect())
}

/// Publishes `bodies` to the topology's exchange with confirms; returns how
/// many were confirmed.
async fn republish(
    config: &ReconcileConfig,
    bodies: Vec<Vec<u8>>,
    shutdown: &CancellationToken,
) -> anyhow::Result<u64> {
    let messages: Vec<Outgoing> = bodies
        .into_iter()
        .map(|body| config.topology.event(body))
        .collect();
    let options = PublishOptions {
        window: PublishOptions::DEFAULT_WINDOW,
        patience: config.dlq.target.patience,
    };
    let report = publish_all(&config.dlq.target.amqp, &messages, &options, shutdown).await?;
    anyhow::ensure!(
        report.all_confirmed(),
        "republishing: {} of {} missing events confirmed",
        report.confirmed,
        messages.len()
    );
    Ok(report.confirmed as u64)
}

/// The keys whose row differs from `totals`, a chunk of keys per query.
impl Reconciliation {
    /// Counts an event of the export whose fate is `fate`.
    fn count(&mut self, fate: &Fate) {
        self.events += 1;
        match fate {
            Fate::Applied => self.applied += 1,
            Fate::DeadLettered(_) => self.dead_lettered += 1,
            Fate::Failing { .. } => self.failing += 1,
            Fate::Missing => self.missing += 1,
        }
    }
}

/// The failure ledger's rows of `ids`: failures and last error by event id.
async fn ledger_of(
    client: &deadpool_postgres::Object,
    group: &str,
    ids: &[&str],
) -> Result<HashMap<String, (i32, String)>, tokio_postgres::Error> {
    client
        .query(
            "SELECT event_id::text, failures, last_error FROM mq_failure_ledger \
             WHERE consumer_group = $2 AND event_id = ANY($1::varchar[])",
            &[&ids, &group],
        )
        .await?
        .iter()
        .map(|row| Ok((row.try_get(0)?, (row.try_get(1)?, row.try_get(2)?))))
        .collect()
}

/// What became of event `id`: recorded (applied), among the dead letters
/// (with the ledger's error, or the letter's reason), failing in the
/// ledger, or nowhere.
fn fate_of(
    id: &str,
    recorded: &HashSet<String>,
    dead: &HashMap<String, String>,
    ledger: &HashMap<String, (i32, String)>,
) -> Fate {
    if recorded.contains(id) {
        Fate::Applied
    } else if let Some(reason) = dead.get(id) {
        Fate::DeadLettered(
            ledger
                .get(id)
                .map_or_else(|| reason.clone(), |(_, error)| error.clone()),
        )
    } else if let Some((failures, last_error)) = ledger.get(id) {
        Fate::Failing {
            failures: *failures,
            last_error: last_error.clone(),
        }
    } else {
        Fate::Missing
    }
}

async fn compare_totals<E>(
    client: &deadpool_postgres::Object,
    tally: &Tally<E>,
    totals: &BTreeMap<String, i64>,
    chunk: usize,
) -> anyhow::Result<Vec<TotalDiffers>> {
    let Tally {
        table, key, amount, ..
    } = tally;
    // The names are the handler's, checked as plain identifiers.
    for name in [table, key, amount] {
        anyhow::ensure!(
            crate::store::is_identifier(name),
            "tally name `{name}` is not a plain identifier"
        );
    }
    let query = format!("SELECT {key}::text, {amount} FROM {table} WHERE {key} = ANY($1)");
    let statement = client.prepare(&query).await?;
    let keys: Vec<&String> = totals.keys().collect();
    let mut differ = Vec::new();
    for keys in keys.chunks(chunk.max(1)) {
        let rows = client.query(&statement, &[&keys]).await?;
        let actual: HashMap<String, i64> = rows
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<Result<_, tokio_postgres::Error>>()?;
        for key in keys {
            let expected = totals[*key];
            let actual = actual.get(*key).copied().unwrap_or(0);
            if expected != actual {
                differ.push(TotalDiffers {
                    key: (*key).clone(),
                    expected,
                    actual,
                });
            }
        }
    }
    Ok(differ)
}

fn event_line(id: &str, status: &Fate) -> Value {
    let mut line = json!({"eventId": id, "status": status.name()});
    match status {
        Fate::DeadLettered(error) => line["lastError"] = json!(error),
        Fate::Failing {
            failures,
            last_error,
        } => {
            line["failures"] = json!(failures);
            line["lastError"] = json!(last_error);
        }
        Fate::Applied | Fate::Missing => {}
    }
    line
}

/// The export's bodies, with their line numbers: JSON lines as they are,
/// CSV rows as JSON objects of their columns.
struct Lines<R: BufRead> {
    format: Format<R>,
    line: u64,
}

enum Format<R: BufRead> {
    Json(R),
    Csv(Box<csv::Reader<R>>, csv::StringRecord),
}

impl<R: BufRead> Lines<R> {
    /// CSV when the file's name ends in `.csv`, JSON lines otherwise.
    fn new(reader: R, path: &std::path::Path) -> anyhow::Result<Self> {
        let csv = path
            .extension()
            .is_some_and(|extension| extension.eq_ignore_ascii_case("csv"));
        let format = if csv {
            let mut reader = csv::Reader::from_reader(reader);
            let header = reader.headers().context("the CSV header")?.clone();
            Format::Csv(Box::new(reader), header)
        } else {
            Format::Json(reader)
        };
        Ok(Self {
            format,
            line: u64::from(csv),
        })
    }

    /// Up to `n` more bodies; none at the end.
    fn next_chunk(&mut self, n: usize) -> anyhow::Result<Vec<(u64, Vec<u8>)>> {
        let mut chunk = Vec::with_capacity(n.min(100_000));
        while chunk.len() < n {
            self.line += 1;
            let line = self.line;
            match &mut self.format {
                Format::Json(reader) => {
                    let mut text = Vec::new();
                    if reader.read_until(b'\n', &mut text)? == 0 {
                        break;
                    }
                    while text.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                        text.pop();
                    }
                    if text.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    chunk.push((line, text));
                }
                Format::Csv(reader, header) => {
                    let mut record = csv::StringRecord::new();
                    if !reader
                        .read_record(&mut record)
                        .with_context(|| format!("line {line} of the CSV export"))?
                    {
                        break;
                    }
                    let object: serde_json::Map<String, Value> = header
                        .iter()
                        .zip(record.iter())
                        .map(|(name, value)| {
                            let value = value
                                .parse::<i64>()
                                .map_or_else(|_| json!(value), |number| json!(number));
                            (name.to_owned(), value)
                        })
                        .collect();
                    chunk.push((line, serde_json::to_vec(&object)?));
                }
            }
        }
        Ok(chunk)
    }
}

impl fmt::Display for Reconciliation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} events in the export: {} applied, {} dead-lettered, {} failing, {} missing",
            self.events, self.applied, self.dead_lettered, self.failing, self.missing
        )?;
        if self.repeated > 0 {
            writeln!(
                f,
                "{} lines repeat an event listed just before",
                self.repeated
            )?;
        }
        if self.invalid > 0 {
            writeln!(
                f,
                "{} lines are no event of the handler's contract:",
                self.invalid
            )?;
            for (line, why) in &self.invalid_lines {
                writeln!(f, "  line {line}: {}", dlq::printable(why))?;
            }
        }
        if self.keys > 0 {
            writeln!(
                f,
                "{} keys: {} at the export's total, {} not",
                self.keys,
                self.keys - self.totals_differ.len() as u64,
                self.totals_differ.len()
            )?;
            for differs in self.totals_differ.iter().take(SHOWN) {
                writeln!(
                    f,
                    "  {}: expected {}, found {}",
                    dlq::printable(&differs.key),
                    differs.expected,
                    differs.actual
                )?;
            }
            if self.totals_differ.len() > SHOWN {
                writeln!(f, "  … and {} more", self.totals_differ.len() - SHOWN)?;
            }
        }
        if self.republished > 0 {
            writeln!(
                f,
                "republished {} missing events (confirmed); the worker applies them once",
                self.republished
            )?;
        }
        if let Some(path) = &self.report {
            writeln!(f, "report: {}", path.display())?;
        }
        if self.matched() {
            write!(f, "everything matches")
        } else {
            write!(f, "not everything matches")
        }
    }
}
