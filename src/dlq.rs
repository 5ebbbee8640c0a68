//! Dead-letter triage: see what is in the dead-letter queue (a summary, a
//! filtered listing that says what a replay would do), replay what is worth
//! replaying, discard what is not.
//!
//! Nothing is lost: a dead-letter copy is acked only after its replay is
//! confirmed, or after the file it is discarded into is synced. Interrupted
//! at any moment, a message is at worst both replayed (or written) and still
//! dead-lettered; a replayed duplicate is absorbed by the consume record.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;

use crate::error::CommandResult;
use base64::Engine;
use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
};
use lapin::types::{AMQPValue, DeliveryTag, FieldTable};
use lapin::{BasicProperties, Channel, PublisherConfirm};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::broker::death::{Death, replay_headers, replays};
use crate::broker::{
    AmqpConfig, ConfirmChannel, ConnectionWatch, Nacks, Outgoing, Reconnects, Refusal, close,
    close_channel, connect_with_retry, queue_counts, ready_messages, settle,
};
use crate::duration::rfc3339;
use crate::handler::Handler;
use crate::progress::Progress;
use crate::store::dead_letters::{body_key, event_key};
use crate::store::{
    DatabaseConfig, DeadLetter, IndexFilter, IndexSummary, IndexTotals, LedgerEntry, ReadyError,
    Store, StoreError,
};

/// Which dead-letter queue, and how to reach the failure ledger.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DlqConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// The database holding the failure ledger and the consume records.
    pub database: DatabaseConfig,
    /// Whose ledger and records: the consumer group of the work queue.
    pub consumer_group: String,
    /// The dead-letter queue.
    pub dead_letter_queue: String,
    /// Which messages to act on.
    pub filter: Filter,
    /// Act on at most this many (of those that match).
    pub limit: Option<usize>,
    /// Look at every letter in the queue, even once as many as the
    /// dead-letter index counts as matching were found.
    pub every_letter: bool,
    /// How long to keep trying to (re)connect.
    pub patience: Duration,
}

impl DlqConfig {
    /// A pass over `dead_letter_queue`, the dead letters of
    /// `consumer_group`, taking every letter (no filter, no limit) and
    /// waiting at most `patience` for the servers.
    pub fn new(
        amqp: AmqpConfig,
        database: DatabaseConfig,
        consumer_group: impl Into<String>,
        dead_letter_queue: impl Into<String>,
        patience: Duration,
    ) -> Self {
        Self {
            amqp,
            database,
            consumer_group: consumer_group.into(),
            dead_letter_queue: dead_letter_queue.into(),
            filter: Filter::default(),
            limit: None,
            every_letter: false,
            patience,
        }
    }
}

/// Which dead letters an action takes; every part must hold. The default
/// takes them all.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// The reason of its latest death: `rejected`, `delivery_limit`, `expired`…
    pub reason: Option<String>,
    /// Its event id.
    pub event_id: Option<String>,
    /// Part of the ledger's last error (or, for a body the handler cannot
    /// decode, of why).
    pub error: Option<String>,
    /// Died longer ago than this.
    pub older_than: Option<Duration>,
    /// Died within this.
    pub newer_than: Option<Duration>,
    /// Only bodies the handler cannot decode (which can never apply).
    pub invalid: bool,
}

/// What to do with the dead letters that match.
#[derive(Debug, Clone)]
pub enum Action {
    /// Look: a listing (or a summary of it); nothing moves.
    List,
    /// Send each back to the queue it died in, with a fresh budget.
    Replay {
        /// At most this many replays per second.
        rate: Option<f64>,
        /// Replay bodies the handler cannot decode too (they die again at
        /// once); by default they stay where they are.
        include_invalid: bool,
    },
    /// Remove, each written first to this JSON-lines file (appended,
    /// synced before the message is acked).
    Discard {
        /// The file.
        file: PathBuf,
    },
    /// Set the dead-letter index to what the queue holds: every letter
    /// found is indexed, every row of a letter not found (and not written
    /// meanwhile) goes. Nothing moves; the filter is not consulted.
    Sync,
}

/// One dead letter, as an operator needs to see it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Its key in the dead-letter index.
    pub key: String,
    /// Its event id, when the body is a valid event.
    pub event_id: Option<String>,
    /// Why the handler cannot decode it, and how the body starts, when it
    /// cannot.
    pub invalid: Option<String>,
    /// Its latest death, if the broker recorded one.
    pub death: Option<Death>,
    /// How many times it was replayed before.
    pub replays: i64,
    /// What the failure ledger knows of it.
    pub failures: Option<LedgerEntry>,
    /// The last error the dead-letter index keeps for it, the ledger's when
    /// it died: what `--error` matches once a replay reset the ledger and
    /// was cut off before it took the letter.
    pub indexed_error: Option<String>,
    /// Whether this consumer group applied it already (a replay would only
    /// be acked as a duplicate); unknown for an invalid body or when the
    /// database could not be read.
    pub applied: Option<bool>,
}

/// What a run did.
#[derive(Debug, Default)]
pub struct Report {
    /// The queue.
    pub queue: String,
    /// Dead letters in the queue when the pass started.
    pub in_queue: usize,
    /// Dead letters looked at.
    pub seen: usize,
    /// The pass reached its limit: more letters may match than it acted on.
    pub limited: bool,
    /// Those that matched, when listing.
    pub listed: Vec<Entry>,
    /// Replayed and removed from the dead-letter queue.
    pub replayed: Vec<Entry>,
    /// Written to the file and removed from the dead-letter queue.
    pub discarded: Vec<Entry>,
    /// The file discards went to.
    pub file: Option<PathBuf>,
    /// Matched, but left where they are: invalid bodies a replay skips.
    pub skipped_invalid: usize,
    /// Could not be replayed, and why; they stay.
    pub failed: Vec<(Entry, String)>,
    /// Why the ledger or the consume records could not be read, if they
    /// could not.
    pub ledger_unavailable: Option<String>,
    /// Connections lost and reopened on the way.
    pub reconnects: usize,
    /// Replays the broker nacked and that were sent again on a fresh
    /// channel.
    pub nacks_retried: usize,
    /// What a sync did to the index.
    pub synced: Option<Synced>,
    /// Why the dead-letter index could not be told of what was replayed or
    /// discarded, if it could not (the next sync mends it).
    pub index_stale: Option<String>,
    /// Letters left in the queue by moving them to its tail (a copy,
    /// confirmed, then the original acked) so as to hold no more than a
    /// quorum queue hands out unacked.
    pub moved_to_tail: usize,
    /// Why the run stopped before the end of the queue, if it did: letters
    /// it could not move to the tail.
    pub stopped_early: Option<String>,
    /// Letters of the queue not looked at: the index agreed with the queue,
    /// and as many letters as it counts as matching were found.
    pub not_looked_at: usize,
}

/// What a sync did to the dead-letter index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Synced {
    /// Letters found in the queue, each indexed.
    pub indexed: usize,
    /// Rows removed: their letters were gone.
    pub removed: u64,
}

impl Report {
    /// True when everything that was attempted succeeded.
    pub fn succeeded(&self) -> bool {
        self.failed.is_empty() && self.stopped_early.is_none()
    }
}

/// Runs `action` over the dead letters that are in the queue when it starts
/// and match the filter, up to the limit. `handler` reads each body's event
/// id.
pub async fn run<H: Handler>(
    config: &DlqConfig,
    action: &Action,
    handler: &H,
    shutdown: &CancellationToken,
) -> CommandResult<Report> {
    run_showing(config, action, handler, &Progress::hidden(), shutdown).await
}

/// [`run`], counting in `progress` the dead letters looked at, of those in
/// the queue when it started.
#[doc(hidden)]
pub async fn run_showing<H: Handler>(
    config: &DlqConfig,
    action: &Action,
    handler: &H,
    progress: &Progress,
    shutdown: &CancellationToken,
) -> CommandResult<Report> {
    Ok(pass(config, action, handler, progress, shutdown).await?)
}

/// [`run_showing`].
async fn pass<H: Handler>(
    config: &DlqConfig,
    action: &Action,
    handler: &H,
    progress: &Progress,
    shutdown: &CancellationToken,
) -> anyhow::Result<Report> {
    let mut report = Report {
        queue: config.dead_letter_queue.clone(),
        file: match action {
            Action::Discard { file } => Some(file.clone()),
            _ => None,
        },
        ..Report::default()
    };
    let mut discards = match action {
        Action::Discard { file } => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)
                .with_context(|| format!("cannot open {} to discard into", file.display()))?,
        ),
        _ => None,
    };
    let store = Store::new(config.database.pool()?, config.consumer_group.clone());
    // The ledger and the consume records are read for every chunk, and
    // reset before every replay: a schema that lacks them is said up front.
    let server = config.database.describe();
    match store
        .wait_until_ready::<H>(&server, config.patience, shutdown)
        .await
    {
        Err(ReadyError::Interrupted) => return Ok(report),
        ready => ready?,
    }
    let mut reconnects = Reconnects::new(config.patience, "working through dead letters");
    let mut nacks = Nacks::new(config.patience);
    let mut consuming = None;
    loop {
        let done = report.replayed.len() + report.discarded.len() + report.listed.len();
        let connection =
            connect_with_retry(&config.amqp, "idem dlq", config.patience, shutdown).await?;
        let _watch = ConnectionWatch::start(&connection, "replaying dead letters");
        let pass = Pass {
            config,
            action,
            handler,
            progress,
            store: &store,
            discards: discards.as_mut(),
            report: &mut report,
            nacks: &mut nacks,
            held: Vec::new(),
            indexed_matches: None,
            matched: 0,
            consuming: &mut consuming,
        };
        let result = pass.run(&connection, shutdown).await;
        close(&connection).await;
        match result {
            Ok(()) => return Ok(report),
            Err(PassError::Ledger(error)) => {
                return Err(anyhow::Error::new(error).context(
                    "cannot reset the failure ledger before a replay (what was not replayed \
                     is still in the dead-letter queue)",
                ));
            }
            Err(PassError::File(error)) => {
                return Err(error.context(
                    "cannot write the discarded messages (what was not written is still in \
                     the dead-letter queue)",
                ));
            }
            Err(PassError::Broker(error)) if shutdown.is_cancelled() => {
                warn!(%error, "interrupted");
                return Ok(report);
            }
            Err(PassError::Broker(error)) => {
                let progressed =
                    report.replayed.len() + report.discarded.len() + report.listed.len() > done;
                reconnects
                    .after(&error, progressed, shutdown)
                    .await
                    .context("cannot work through the dead-letter queue (nothing was lost)")?;
                report.reconnects += 1;
            }
        }
    }
}

/// The dead-letter index of a group beside its queue.
#[derive(Debug, Clone)]
pub struct IndexState {
    /// The dead-letter queue.
    pub queue: String,
    /// The letters ready in it; `None` when it does not exist.
    pub in_queue: Option<u32>,
    /// What the index counts.
    pub totals: IndexTotals,
}

impl IndexState {
    /// True when the queue holds more letters than the index counts: some
    /// came by other ways than idem's worker (the broker's delivery limit,
    /// an idem older than the index). A queue holding fewer (a purge, a
    /// worker stopped between writing a letter and rejecting it) leaves the
    /// index counting too many, the safe side for the pruner's hold, until
    /// a sync.
    pub fn behind(&self) -> bool {
        self.in_queue
            .is_some_and(|ready| i64::from(ready) > self.totals.letters)
    }
}

/// Reads the dead-letter index's totals and the queue's depth (a passive
/// declare); takes no letter off the queue. Whether the index is
/// [behind](IndexState::behind) is for the caller to say: only a sync
/// (`idem dlq sync`, which browses every letter) brings it up.
pub async fn index_state<H: Handler>(
    config: &DlqConfig,
    shutdown: &CancellationToken,
) -> CommandResult<IndexState> {
    Ok(index_state_of::<H>(config, shutdown).await?)
}

/// [`index_state`].
async fn index_state_of<H: Handler>(
    config: &DlqConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<IndexState> {
    let store = Store::new(config.database.pool()?, config.consumer_group.clone());
    let server = config.database.describe();
    match store
        .wait_until_ready::<H>(&server, config.patience, shutdown)
        .await
    {
        Err(ReadyError::Interrupted) => anyhow::bail!("interrupted"),
        ready => ready?,
    }
    Ok(IndexState {
        queue: config.dead_letter_queue.clone(),
        in_queue: dead_letter_depth(config, shutdown).await?,
        totals: store.dead_letter_totals().await?,
    })
}

/// The letters ready in the dead-letter queue, by a passive declare;
/// `None` when it does not exist.
async fn dead_letter_depth(
    config: &DlqConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<u32>> {
    let connection =
        connect_with_retry(&config.amqp, "idem dlq", config.patience, shutdown).await?;
    let channel = connection.create_channel().await?;
    let counts = queue_counts(&channel, &config.dead_letter_queue).await.ok();
    if counts.is_some() {
        close_channel(&channel).await;
    }
    close(&connection).await;
    Ok(counts.map(|(ready, _)| ready))
}

/// `idem dlq summary`: the dead letters that match, counted from the index;
/// the queue is only counted. A limit does not apply to a count.
pub async fn summary<H: Handler>(
    config: &DlqConfig,
    shutdown: &CancellationToken,
) -> CommandResult<IndexedSummary> {
    Ok(summary_of::<H>(config, shutdown).await?)
}

/// [`summary`].
async fn summary_of<H: Handler>(
    config: &DlqConfig,
    shutdown: &CancellationToken,
) -> anyhow::Result<IndexedSummary> {
    let state = index_state_of::<H>(config, shutdown).await?;
    let store = Store::new(config.database.pool()?, config.consumer_group.clone());
    let summary = store
        .dead_letter_summary(&IndexFilter::from(&config.filter))
        .await?;
    Ok(IndexedSummary { state, summary })
}

/// The most last errors a summary lists, the commonest first: errors that
/// name their event would list every letter.
const ERRORS_SHOWN: usize = 20;

/// What `idem dlq summary` prints.
#[derive(Debug, Clone)]
pub struct IndexedSummary {
    /// The index beside the queue.
    pub state: IndexState,
    /// The letters that match, counted.
    pub summary: IndexSummary,
}

impl From<&Filter> for IndexFilter {
    fn from(filter: &Filter) -> Self {
        Self {
            reason: filter.reason.clone(),
            event_id: filter.event_id.clone(),
            error: filter.error.clone(),
            older_than: filter.older_than,
            newer_than: filter.newer_than,
            invalid: filter.invalid,
        }
    }
}

impl fmt::Display for IndexedSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let IndexedSummary { state, summary } = self;
        write!(
            f,
            "{} of {} dead-lettered message(s) in {} match",
            summary.letters,
            state.totals.letters,
            printable(&state.queue)
        )?;
        match state.in_queue {
            Some(ready) if state.behind() => write!(
                f,
                " (by the index; the queue holds {ready} ready, some the index does not know \
                 of: `{} dlq sync` adds them, browsing every letter)",
                crate::program::name()
            )?,
            Some(ready) if i64::from(ready) != state.totals.letters => write!(
                f,
                " (by the index; the queue holds {ready} ready: `{} dlq sync` sets the index \
                 to it)",
                crate::program::name()
            )?,
            _ => {}
        }
        fn counted(counts: &BTreeMap<String, i64>) -> Vec<(&String, &i64)> {
            let mut counts: Vec<(&String, &i64)> = counts.iter().collect();
            counts.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            counts
        }
        let reasons: Vec<String> = counted(&summary.reasons)
            .into_iter()
            .map(|(reason, n)| format!("{} {n}", printable(reason)))
            .collect();
        write!(f, "\n  by reason: {}", reasons.join(", "))?;
        write!(f, "\n  by last error:")?;
        let errors = counted(&summary.errors);
        for (error, n) in errors.iter().take(ERRORS_SHOWN) {
            write!(f, "\n    {n:>6}  {}", printable(error))?;
        }
        if errors.len() > ERRORS_SHOWN {
            let rest = &errors[ERRORS_SHOWN..];
            write!(
                f,
                "\n    {:>6}  in {} other last error(s) (`--error TEXT` narrows the summary)",
                rest.iter().map(|(_, n)| **n).sum::<i64>(),
                rest.len()
            )?;
        }
        let seconds = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        if let (Some(oldest), Some(newest)) = (summary.oldest, summary.newest) {
            write!(
                f,
                "\n  oldest {}, newest {}",
                rfc3339(seconds(oldest)),
                rfc3339(seconds(newest))
            )?;
        }
        write!(
            f,
            "\n  a replay would apply {}, find {} applied already; {} invalid or unknown \
             (applied as of each letter's death or the last sync: `{} dlq list` looks each \
             up now)",
            summary.would_apply,
            summary.applied,
            summary.invalid,
            crate::program::name()
        )
    }
}

/// A sync's outcome, as a line.
struct SyncedIn<'a>(&'a str, &'a Synced);

impl fmt::Display for SyncedIn<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let SyncedIn(queue, synced) = self;
        write!(
            f,
            "synced the dead-letter index with {}: {} letter(s) found, {} row(s) of letters no \
             longer there removed",
            printable(queue),
            synced.indexed,
            synced.removed
        )
    }
}

#[derive(Debug, thiserror::Error)]
enum PassError {
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    #[error(transparent)]
    Ledger(#[from] StoreError),
    #[error(transparent)]
    File(anyhow::Error),
}

/// How long a command waits for what it gave back to be ready again.
const GIVE_BACK_WAIT: Duration = Duration::from_secs(5);

/// Most dead letters taken before they are acted on: one ledger statement,
/// one file sync, one wait for confirms per chunk.
const CHUNK: usize = 128;

/// Most dead letters a sync indexes in one statement.
const SYNC_CHUNK: usize = 1000;

/// Most letters a pass holds unacked while it goes on taking more: a
/// quorum queue sends a consumer without a prefetch limit no more than 2,000
/// unacked messages, and a sync chunk adds up to [`SYNC_CHUNK`] on top.
const HOLD: usize = 500;

/// The reason shown for a letter without a record of its death (`x-death`
/// or idem's).
const NO_DEATH: &str = "(no record of its death)";

/// A dead letter taken from the queue, not acked yet.
struct Letter {
    tag: DeliveryTag,
    delivery: Delivery,
    entry: Entry,
    /// Why the handler cannot decode the body, in its words alone (the
    /// entry's `invalid` adds how the body starts): what the index keeps.
    decode_error: Option<String>,
}

/// A letter taken from the queue that the pass leaves there: given back at
/// the end, or moved to the tail of the queue when too many are held.
struct Kept {
    tag: DeliveryTag,
    body: Vec<u8>,
    properties: BasicProperties,
}

impl From<Delivery> for Kept {
    fn from(delivery: Delivery) -> Self {
        Self {
            tag: delivery.delivery_tag,
            body: delivery.data,
            properties: delivery.properties,
        }
    }
}

/// One connection's worth of work.
struct Pass<'a, H> {
    config: &'a DlqConfig,
    action: &'a Action,
    handler: &'a H,
    progress: &'a Progress,
    store: &'a Store,
    discards: Option<&'a mut std::fs::File>,
    report: &'a mut Report,
    nacks: &'a mut Nacks,
    /// Letters taken but left in the queue, at most [`HOLD`] of them
    /// between chunks.
    held: Vec<Kept>,
    /// How many letters match, by the dead-letter index, when it agrees
    /// with the queue: the pass stops once it found them.
    indexed_matches: Option<usize>,
    /// Letters this pass found matching.
    matched: usize,
    /// While a pass consumes the dead-letter queue, how many consumers the
    /// queue had besides: once a pass lost its connection, the next waits
    /// for the broker to count no more (it gave back what the lost one
    /// held).
    consuming: &'a mut Option<u32>,
}

impl<H: Handler> Pass<'_, H> {
    async fn run(
        mut self,
        connection: &lapin::Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
        let getter = connection.create_channel().await?;
        if let Some(others) = *self.consuming {
            await_released(
                &getter,
                &self.config.dead_letter_queue,
                others,
                self.config.patience,
            )
            .await?;
            *self.consuming = None;
        }
        // Replays and moves to the tail go on one confirm channel, opened
        // for the first of either.
        let mut publisher = match self.action {
            Action::Replay { .. } => Some(ConfirmChannel::open(connection).await?),
            _ => None,
        };
        // Each pass looks again: what an earlier one held, or acted on
        // without its ack reaching the broker, is back.
        self.report.seen = 0;
        self.report.listed.clear();
        self.report.failed.clear();
        self.report.skipped_invalid = 0;
        let mut pacer = self.action.pacer();
        // A sync counts again from its own start: what an earlier pass
        // wrote is set, not added to.
        let sync_started = match self.action {
            Action::Sync => {
                self.report.synced = Some(Synced::default());
                Some(self.store.clock().await?)
            }
            _ => None,
        };
        // At most what is in the queue when the pass starts: what dies while
        // it runs (a replay that fails again, say) is for the next run.
        let mut taking =
            Taking::start(&getter, &self.config.dead_letter_queue, self.consuming).await?;
        self.progress.set_total(taking.left as u64);
        self.report.in_queue = taking.left;
        self.report.limited = false;
        self.report.not_looked_at = 0;
        self.indexed_matches = self.indexed_matches(taking.left).await;
        while !shutdown.is_cancelled() && self.wanted() != Some(0) && !self.found_all() {
            let chunk_size = if matches!(self.action, Action::Sync) {
                SYNC_CHUNK
            } else {
                CHUNK
            };
            let mut chunk: Vec<Letter> = taking
                .next_chunk(&getter, chunk_size)
                .await?
                .into_iter()
                .map(|delivery| self.letter(delivery))
                .collect();
            if chunk.is_empty() {
                break;
            }
            self.report.seen += chunk.len();
            self.progress.inc(chunk.len() as u64);
            let matched = match sync_started {
                Some(started) => {
                    self.index(chunk, started).await?;
                    Vec::new()
                }
                None => {
                    self.look_up(&mut chunk).await;
                    self.matching(chunk)
                }
            };
            match self.action {
                Action::List => {
                    for letter in matched {
                        self.report.listed.push(letter.entry.clone());
                        self.held.push(letter.delivery.into());
                    }
                }
                Action::Replay {
                    include_invalid, ..
                } => {
                    let (valid, invalid): (Vec<_>, Vec<_>) = matched
                        .into_iter()
                        .partition(|letter| letter.entry.event_id.is_some());
                    let mut replay = valid;
                    if *include_invalid {
                        replay.extend(invalid);
                    } else {
                        self.report.skipped_invalid += invalid.len();
                        self.held
                            .extend(invalid.into_iter().map(|letter| letter.delivery.into()));
                    }
                    if let Some(publisher) = &mut publisher {
                        self.replay(&getter, connection, publisher, replay, &mut pacer, shutdown)
                            .await?;
                    }
                }
                Action::Discard { .. } => self.discard(&getter, matched).await?,
                // Indexed above, whatever the filter.
                Action::Sync => {}
            }
            if taking.left == 0 {
                break;
            }
            if self.held.len() >= HOLD {
                let publisher = match &mut publisher {
                    Some(publisher) => publisher,
                    None => publisher.insert(ConfirmChannel::open(connection).await?),
                };
                self.move_to_tail(&getter, connection, publisher, shutdown)
                    .await?;
                if self.held.len() >= HOLD {
                    break;
                }
            }
        }
        if self.found_all() {
            self.report.not_looked_at = taking.left;
        } else if self.wanted() == Some(0) {
            self.report.limited = true;
        }
        taking.stop(&getter).await?;
        if let Some(started) = sync_started
            && !shutdown.is_cancelled()
            && self.report.stopped_early.is_none()
        {
            let letters = i64::try_from(self.report.seen).unwrap_or(i64::MAX);
            let removed = self.store.dead_letters_synced(started, letters).await?;
            self.report.synced.get_or_insert_default().removed = removed;
        }
        if matches!(self.action, Action::Replay { .. } | Action::Discard { .. }) {
            // A quorum queue loses acks sent just before their channel
            // closes (the close returns what the queue has not settled
            // yet; seen on 3.10 and 4.0): a get on the same channel is
            // answered only once the queue has applied every ack before it.
            if let Some(message) = getter
                .basic_get(
                    self.config.dead_letter_queue.as_str().into(),
                    BasicGetOptions { no_ack: false },
                )
                .await?
            {
                self.held.push(message.delivery.into());
            }
        }
        if let Some(last) = self.held.iter().map(|kept| kept.tag).max() {
            // Give back what was listed, skipped or not replayed (in place
            // on 4.x; 3.10 puts what is given back at the end of a quorum
            // queue).
            getter
                .basic_nack(
                    last,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await?;
        }
        close_channel(&getter).await;
        if let Some(publisher) = &publisher {
            close_channel(publisher.channel()).await;
        }
        self.await_given_back(connection).await
    }

    /// Waits, a few seconds at most, until the queue holds at least as
    /// many ready messages as were given back: a quorum queue makes them
    /// ready again a moment after the nack, and the next command should see
    /// every dead letter.
    async fn await_given_back(&self, connection: &lapin::Connection) -> Result<(), PassError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let given_back = u32::try_from(self.held.len()).unwrap_or(u32::MAX);
        let channel = connection.create_channel().await?;
        let deadline = Instant::now() + GIVE_BACK_WAIT;
        while ready_messages(&channel, &self.config.dead_letter_queue).await? < given_back
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        close_channel(&channel).await;
        Ok(())
    }

    /// How many letters match, by the dead-letter index, if it counts as
    /// many letters as the queue holds (`in_queue`, when the pass started)
    /// and can answer the filter (no filter by time: the index's clock and
    /// the letters' headers may differ by a second). A pass that found
    /// them stops: where the broker cannot take a letter out of the middle
    /// of a queue, that spares taking the rest. A letter that came by
    /// another way than idem's worker (the broker's delivery limit, an
    /// older idem) makes the queue hold more than the index counts, unless
    /// a row whose letter is gone (a worker stopped between the two, a
    /// purge) makes up for it: `idem dlq sync` sets the index right, and
    /// `--every-letter` looks at every letter whatever the index says.
    async fn indexed_matches(&self, in_queue: usize) -> Option<usize> {
        let filter = &self.config.filter;
        if self.config.every_letter
            || matches!(self.action, Action::Sync)
            || filter.older_than.is_some()
            || filter.newer_than.is_some()
        {
            return None;
        }
        let totals = self.store.dead_letter_totals().await.ok()?;
        if usize::try_from(totals.letters).ok()? != in_queue {
            return None;
        }
        let summary = self
            .store
            .dead_letter_summary(&IndexFilter::from(filter))
            .await
            .ok()?;
        usize::try_from(summary.letters).ok()
    }

    /// True once the pass found as many matching letters as the index
    /// counts.
    fn found_all(&self) -> bool {
        self.indexed_matches.is_some_and(|n| self.matched >= n)
    }

    /// How many more may be acted on; `None` without a limit.
    fn wanted(&self) -> Option<usize> {
        let acted = self.report.listed.len()
            + self.report.replayed.len()
            + self.report.discarded.len()
            + self.report.skipped_invalid
            + self.report.failed.len();
        self.config.limit.map(|limit| limit.saturating_sub(acted))
    }

    fn letter(&self, delivery: Delivery) -> Letter {
        let headers = delivery.properties.headers().as_ref();
        let (event_id, invalid, decode_error) = match decoded_id(self.handler, &delivery.data) {
            Ok(id) => (Some(id), None, None),
            Err(why) => (None, Some(described(&why, &delivery.data)), Some(why)),
        };
        Letter {
            tag: delivery.delivery_tag,
            entry: Entry {
                key: event_id
                    .as_deref()
                    .map_or_else(|| body_key(&delivery.data), event_key),
                event_id,
                invalid,
                death: Death::latest(headers),
                replays: replays(headers),
                failures: None,
                indexed_error: None,
                applied: None,
            },
            delivery,
            decode_error,
        }
    }

    /// Fills in what the ledger and the consume records know of `chunk`'s
    /// events: one statement each for the chunk. When the database cannot
    /// be read, says so once and goes on without.
    async fn look_up(&mut self, chunk: &mut [Letter]) {
        let ids: Vec<&str> = chunk
            .iter()
            .filter_map(|letter| letter.entry.event_id.as_deref())
            .collect();
        let keys: Vec<&str> = chunk
            .iter()
            .map(|letter| letter.entry.key.as_str())
            .collect();
        let found = async {
            let ledger = self.store.ledger_entries(&ids).await?;
            let recorded = self.store.recorded(&ids).await?;
            let indexed = match self.config.filter.error {
                Some(_) => self.store.dead_letter_errors(&keys).await?,
                None => HashMap::new(),
            };
            Ok::<_, StoreError>((ledger, recorded, indexed))
        }
        .await;
        let (ledger, recorded, mut indexed) = match found {
            Ok(found) => found,
            Err(error) => {
                self.report
                    .ledger_unavailable
                    .get_or_insert_with(|| error.to_string());
                return;
            }
        };
        for letter in chunk {
            if let Some(id) = &letter.entry.event_id {
                // Several dead copies of one event share its ledger row.
                letter.entry.failures = ledger.get(id).cloned();
                letter.entry.applied = Some(recorded.contains(id));
            }
            letter.entry.indexed_error = indexed.remove(&letter.entry.key);
        }
    }

    /// The letters that match the filter, up to the limit; the others are
    /// held.
    fn matching(&mut self, chunk: Vec<Letter>) -> Vec<Letter> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let mut wanted = self.wanted();
        let mut matched = Vec::new();
        for letter in chunk {
            if wanted != Some(0)
                && !self.found_all()
                && self.config.filter.matches(&letter.entry, now)
            {
                wanted = wanted.map(|n| n - 1);
                self.matched += 1;
                matched.push(letter);
            } else {
                self.held.push(letter.delivery.into());
            }
        }
        matched
    }

    /// Resets the ledger of the letters' events, sends their replays (at
    /// the pacer's rate), and acks each dead-letter copy whose replay the
    /// broker confirmed. What the broker nacks goes again on a fresh
    /// channel of `connection`, which replaces `publisher`, within the
    /// patience.
    async fn replay(
        &mut self,
        getter: &Channel,
        connection: &lapin::Connection,
        publisher: &mut ConfirmChannel,
        letters: Vec<Letter>,
        pacer: &mut Option<Pacer>,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
        // A replay starts a fresh budget of attempts: the reset goes first.
        let ids: Vec<&str> = letters
            .iter()
            .filter_map(|letter| letter.entry.event_id.as_deref())
            .collect();
        self.store.reset_ledger(&ids).await?;
        let mut replays = Vec::with_capacity(letters.len());
        for letter in letters {
            let Some(queue) = letter.entry.death.as_ref().map(|d| d.queue.clone()) else {
                self.report.failed.push((
                    letter.entry,
                    "no record of its death (x-death or idem's): cannot tell which queue it \
                     died in"
                        .into(),
                ));
                self.held.push(letter.delivery.into());
                continue;
            };
            let original = letter.delivery.properties;
            let properties = original
                .clone()
                .with_headers(replay_headers(original.headers().as_ref()));
            let message = Outgoing {
                // The default exchange routes by queue name: the replay goes
                // to the queue it died in, not to every queue bound for it.
                exchange: String::new(),
                routing_key: queue,
                body: letter.delivery.data,
                properties,
            };
            replays.push(((letter.tag, letter.entry, original), message));
        }
        let outcomes = self
            .send_confirmed(connection, publisher, replays, pacer.as_mut(), shutdown)
            .await?;
        let mut taken = Vec::new();
        for ((tag, entry, original), message, outcome) in outcomes {
            match outcome {
                Ok(()) => {
                    getter.basic_ack(tag, BasicAckOptions::default()).await?;
                    taken.push(entry.key.clone());
                    self.report.replayed.push(entry);
                }
                Err(refusal) => self.not_replayed(tag, entry, message, original, &refusal),
            }
        }
        self.taken(&taken).await;
        Ok(())
    }

    /// Sends each message on `publisher` (at the pacer's rate) and returns
    /// it, with its item, once the broker confirmed or refused it. What the
    /// broker nacks goes again on a fresh channel of `connection`, which
    /// replaces `publisher`, until the broker has confirmed nothing for the
    /// patience: a nack is often passing (a queue's leader changing, its
    /// length limit), and a channel that saw one may see nothing else.
    async fn send_confirmed<T>(
        &mut self,
        connection: &lapin::Connection,
        publisher: &mut ConfirmChannel,
        items: Vec<(T, Outgoing)>,
        pacer: Option<&mut Pacer>,
        shutdown: &CancellationToken,
    ) -> Result<Vec<(T, Outgoing, Result<(), Refusal>)>, PassError> {
        let mut sent = match pacer {
            Some(pacer) => {
                let mut sent = Vec::with_capacity(items.len());
                for (item, message) in items {
                    pacer.wait().await;
                    let confirm = publisher.send(&message).await?;
                    sent.push((item, message, confirm));
                }
                sent
            }
            None => send_all(publisher, items).await?,
        };
        let mut done = Vec::with_capacity(sent.len());
        loop {
            let mut nacked = Vec::new();
            let mut progressed = false;
            for (item, message, confirm) in sent {
                match settle(confirm).await? {
                    Err(Refusal::Nacked) => nacked.push((item, message)),
                    outcome => {
                        progressed |= outcome.is_ok();
                        done.push((item, message, outcome));
                    }
                }
            }
            if nacked.is_empty() {
                return Ok(done);
            }
            if !self.nacks.again(nacked.len(), progressed, shutdown).await {
                done.extend(
                    nacked
                        .into_iter()
                        .map(|(item, message)| (item, message, Err(Refusal::Nacked))),
                );
                return Ok(done);
            }
            self.report.nacks_retried += nacked.len();
            close_channel(publisher.channel()).await;
            *publisher = ConfirmChannel::open(connection).await?;
            sent = send_all(publisher, nacked).await?;
        }
    }

    /// Moves the letters held to the tail of the queue, where the pass,
    /// which stops at the count it started with, does not meet them again:
    /// a copy of each (body, properties and headers, `x-death` included),
    /// and once the broker confirmed it, an ack of the original. Killed
    /// between the two, a letter is in the queue twice; replayed twice, its
    /// event is applied once. A copy the broker refuses (nacks past the
    /// patience, returns) leaves its letter held, and the run stops early,
    /// saying why.
    async fn move_to_tail(
        &mut self,
        getter: &Channel,
        connection: &lapin::Connection,
        publisher: &mut ConfirmChannel,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
        let copies = std::mem::take(&mut self.held)
            .into_iter()
            .map(|kept| {
                let copy = Outgoing {
                    exchange: String::new(),
                    routing_key: self.config.dead_letter_queue.clone(),
                    body: kept.body,
                    properties: kept.properties,
                };
                (kept.tag, copy)
            })
            .collect();
        let outcomes = self
            .send_confirmed(connection, publisher, copies, None, shutdown)
            .await?;
        for (tag, copy, outcome) in outcomes {
            match outcome {
                Ok(()) => {
                    getter.basic_ack(tag, BasicAckOptions::default()).await?;
                    self.report.moved_to_tail += 1;
                }
                Err(refusal) => {
                    self.report.stopped_early.get_or_insert_with(|| {
                        format!(
                            "a copy of a letter to the tail of the queue {refusal}: too many \
                             letters held to take more"
                        )
                    });
                    self.held.push(Kept {
                        tag,
                        body: copy.body,
                        properties: copy.properties,
                    });
                }
            }
        }
        Ok(())
    }

    /// Leaves a dead letter in its queue, saying why its replay failed.
    fn not_replayed(
        &mut self,
        tag: DeliveryTag,
        entry: Entry,
        message: Outgoing,
        original: BasicProperties,
        why: &Refusal,
    ) {
        self.report.failed.push((
            entry,
            format!("replay to queue '{}' {why}", message.routing_key),
        ));
        self.held.push(Kept {
            tag,
            body: message.body,
            properties: original,
        });
    }

    /// Writes the letters to the discard file, syncs it, then acks each.
    async fn discard(&mut self, getter: &Channel, letters: Vec<Letter>) -> Result<(), PassError> {
        if letters.is_empty() {
            return Ok(());
        }
        let Some(file) = self.discards.as_deref_mut() else {
            unreachable!("a discard opens its file before the pass");
        };
        let mut lines = Vec::new();
        for letter in &letters {
            serde_json::to_writer(&mut lines, &discarded(&self.report.queue, letter))
                .map_err(|e| PassError::File(e.into()))?;
            lines.push(b'\n');
        }
        file.write_all(&lines)
            .and_then(|()| file.sync_data())
            .map_err(|e| PassError::File(e.into()))?;
        let mut taken = Vec::with_capacity(letters.len());
        for letter in letters {
            getter
                .basic_ack(letter.tag, BasicAckOptions::default())
                .await?;
            taken.push(letter.entry.key.clone());
            self.report.discarded.push(letter.entry);
        }
        self.taken(&taken).await;
        Ok(())
    }

    /// Takes the letters of `keys`, acked, off the index. A failure leaves
    /// rows the next sync removes: it is reported, and the run goes on.
    async fn taken(&mut self, keys: &[String]) {
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        if let Err(error) = self.store.dead_letters_taken(&keys).await {
            warn!(%error, letters = keys.len(), "cannot take replayed or discarded letters off the dead-letter index");
            self.report
                .index_stale
                .get_or_insert_with(|| error.to_string());
        }
    }

    /// Indexes a sync's chunk, each letter as one copy (a row touched
    /// before `started` is set to what the sync finds), and holds it.
    async fn index(&mut self, chunk: Vec<Letter>, started: SystemTime) -> Result<(), PassError> {
        let letters: Vec<DeadLetter> = chunk
            .iter()
            .map(|letter| {
                let death = letter.entry.death.as_ref();
                DeadLetter {
                    key: letter.entry.key.clone(),
                    event_id: letter.entry.event_id.clone(),
                    queue: death.map_or_else(String::new, |d| d.queue.clone()),
                    reason: death.map_or_else(|| NO_DEATH.to_owned(), |d| d.reason.clone()),
                    // As the worker words it, without how the body starts.
                    error: letter.decode_error.clone(),
                    invalid: letter.entry.invalid.is_some(),
                    dead_at: death
                        .and_then(|d| d.time)
                        .map(|t| UNIX_EPOCH + Duration::from_secs(t)),
                }
            })
            .collect();
        self.store.sync_dead_letters(&letters, started).await?;
        self.report.synced.get_or_insert_default().indexed += letters.len();
        self.held
            .extend(chunk.into_iter().map(|letter| letter.delivery.into()));
        Ok(())
    }
}

impl Filter {
    /// True when `entry` passes every part of the filter; `now` in seconds
    /// since the Unix epoch.
    pub fn matches(&self, entry: &Entry, now: u64) -> bool {
        let death = entry.death.as_ref();
        let time = death.and_then(|death| death.time);
        let reason = self
            .reason
            .as_ref()
            .is_none_or(|reason| death.is_some_and(|death| &death.reason == reason));
        let event_id = self
            .event_id
            .as_ref()
            .is_none_or(|id| entry.event_id.as_ref() == Some(id));
        let error = self.error.as_ref().is_none_or(|part| {
            let failure = entry.failures.as_ref().map(|f| f.last_error.as_str());
            failure
                .or(entry.indexed_error.as_deref())
                .or(entry.invalid.as_deref())
                .is_some_and(|text| text.contains(part.as_str()))
        });
        let age = |limit: &Duration| time.map(|time| now.saturating_sub(time) > limit.as_secs());
        let older = self
            .older_than
            .as_ref()
            .is_none_or(|limit| age(limit) == Some(true));
        let newer = self
            .newer_than
            .as_ref()
            .is_none_or(|limit| age(limit) == Some(false));
        let invalid = !self.invalid || entry.invalid.is_some();
        reason && event_id && error && older && newer && invalid
    }
}

/// How long a pass waits for a letter before it asks whether the queue
/// still holds one for it.
const QUIET: Duration = Duration::from_secs(1);

/// Takes the letters a dead-letter queue holds when a pass starts, through
/// a consumer without a prefetch limit: the broker sends them as fast as it
/// reads them, where a `basic.get` costs a round trip per letter (and on a
/// quorum queue an entry in its log). Every letter taken stays unacked, so
/// in the queue, until the pass acks it or gives it back; what the consumer
/// received beyond the count goes back when the channel closes.
struct Taking {
    consumer: Option<lapin::Consumer>,
    queue: String,
    /// Letters still to take of those in the queue at the start.
    left: usize,
}

impl Taking {
    /// Counts the queue (a passive declare) and, when it holds letters,
    /// starts consuming it on `channel`, with `consuming` set to the
    /// consumers it had before.
    async fn start(
        channel: &Channel,
        queue: &str,
        consuming: &mut Option<u32>,
    ) -> lapin::Result<Self> {
        let (ready, consumers) = queue_counts(channel, queue).await?;
        let left = ready as usize;
        let consumer = if left == 0 {
            None
        } else {
            *consuming = Some(consumers);
            Some(
                channel
                    .basic_consume(
                        queue.into(),
                        "idem-dlq".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await?,
            )
        };
        Ok(Self {
            consumer,
            queue: queue.to_owned(),
            left,
        })
    }

    /// Up to `size` letters: it waits for the first, then takes what has
    /// arrived. Empty once every letter counted at the start is taken, or
    /// when none comes and the queue has none ready (another client took
    /// some meanwhile).
    async fn next_chunk(&mut self, channel: &Channel, size: usize) -> lapin::Result<Vec<Delivery>> {
        let mut chunk = Vec::new();
        let Some(consumer) = &mut self.consumer else {
            return Ok(chunk);
        };
        while chunk.len() < size && self.left > 0 {
            let next = if chunk.is_empty() {
                match tokio::time::timeout(QUIET, consumer.next()).await {
                    Ok(next) => next,
                    Err(_) if ready_messages(channel, &self.queue).await? == 0 => {
                        self.left = 0;
                        break;
                    }
                    Err(_) => continue,
                }
            } else {
                match consumer.next().now_or_never() {
                    Some(next) => next,
                    None => break,
                }
            };
            let Some(delivery) = next else {
                return Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
                    lapin::ChannelState::Closed,
                    "the dead-letter consumer ended",
                )));
            };
            chunk.push(delivery?);
            self.left -= 1;
        }
        Ok(chunk)
    }

    /// Cancels the consumer; what it received and the pass did not take
    /// stays unacked until the pass gives it back or closes the channel.
    async fn stop(self, channel: &Channel) -> lapin::Result<()> {
        if let Some(consumer) = self.consumer {
            channel
                .basic_cancel(consumer.tag(), BasicCancelOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// Waits, `patience` at most, until `queue` has no more than `others`
/// consumers: the broker has noticed that a lost connection's consumer is
/// gone, and given back every letter it held. (It notices when the socket
/// closes, or after a missed heartbeat when the network went.) A pass that
/// counted the queue before would end without them.
async fn await_released(
    channel: &Channel,
    queue: &str,
    others: u32,
    patience: Duration,
) -> lapin::Result<()> {
    let deadline = Instant::now() + patience;
    let mut told = false;
    while queue_counts(channel, queue).await?.1 > others {
        if Instant::now() >= deadline {
            warn!(
                "RabbitMQ still holds the dead letters the lost connection had taken; \
                 they are back in {queue} once it notices the loss, for another run"
            );
            return Ok(());
        }
        if !told {
            info!(
                "waiting for RabbitMQ to give back the dead letters the lost connection had taken"
            );
            told = true;
        }
        tokio::time::sleep(RELEASE_POLL).await;
    }
    Ok(())
}

/// How often a pass looks whether the broker gave back a lost connection's
/// letters.
const RELEASE_POLL: Duration = Duration::from_millis(50);

/// Paces replays to a rate.
struct Pacer {
    interval: Duration,
    next: Instant,
}

impl Action {
    fn pacer(&self) -> Option<Pacer> {
        match self {
            Action::Replay {
                rate: Some(rate), ..
            } if *rate > 0.0 => Some(Pacer {
                interval: Duration::from_secs_f64(1.0 / rate),
                next: Instant::now(),
            }),
            _ => None,
        }
    }
}

impl Pacer {
    async fn wait(&mut self) {
        tokio::time::sleep_until(self.next).await;
        // Late (the broker was slow), it does not make up with a burst.
        self.next = self.next.max(Instant::now()) + self.interval;
    }
}

/// Sends each item's message on `publisher`, all at once, each with its
/// confirm still to come; the first send that fails (the channel is gone)
/// fails them all.
async fn send_all<T>(
    publisher: &ConfirmChannel,
    items: Vec<(T, Outgoing)>,
) -> Result<Vec<(T, Outgoing, PublisherConfirm)>, lapin::Error> {
    let confirms = publisher
        .send_all(items.iter().map(|(_, message)| message))
        .await;
    items
        .into_iter()
        .zip(confirms)
        .map(|((item, message), confirm)| Ok((item, message, confirm?)))
        .collect()
}

/// Most characters of an invalid body shown in its place.
const BODY_SHOWN: usize = 80;

/// Why `body` is invalid, and how it starts.
fn described(invalid: &str, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut start: String = text.chars().take(BODY_SHOWN).collect();
    if text.chars().nth(BODY_SHOWN).is_some() {
        start.push('…');
    }
    format!("{invalid}; the body starts {start:?}")
}

/// The event id of `body`, or why the handler cannot decode it, in the
/// handler's words alone: what the worker writes into the dead-letter index
/// (bodies that fail alike share a line of the summary).
fn decoded_id(handler: &impl Handler, body: &[u8]) -> Result<String, String> {
    handler
        .decode(body)
        .and_then(|event| {
            let id = handler.event_id(&event);
            crate::handler::check_event_id(id).map(|()| id.to_owned())
        })
        .map_err(|invalid| invalid.to_string())
}

/// What the discard file keeps of a letter: everything needed to publish it
/// again by hand.
fn discarded(queue: &str, letter: &Letter) -> Value {
    let entry = &letter.entry;
    let properties = &letter.delivery.properties;
    let body = &letter.delivery.data;
    let mut line = json!({
        "discarded_at": rfc3339(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()),
        "dead_letter_queue": queue,
        "event_id": entry.event_id,
        "invalid": entry.invalid,
        "death": entry.death.as_ref().map(|death| json!({
            "queue": death.queue,
            "reason": death.reason,
            "count": death.count,
            "time": death.time.map(rfc3339),
            "exchange": death.exchange,
            "routing_keys": death.routing_keys,
        })),
        "replays": entry.replays,
        "failures": entry.failures.as_ref().map(|f| f.failures),
        "last_error": entry.failures.as_ref().map(|f| f.last_error.clone()),
        "properties": properties_json(properties),
    });
    let body = match std::str::from_utf8(body) {
        Ok(text) => ("body", Value::String(text.to_owned())),
        Err(_) => (
            "body_base64",
            Value::String(base64::engine::general_purpose::STANDARD.encode(body)),
        ),
    };
    if let Value::Object(fields) = &mut line {
        fields.insert(body.0.to_owned(), body.1);
    }
    line
}

fn properties_json(properties: &BasicProperties) -> Value {
    json!({
        "content_type": properties.content_type().as_ref().map(|v| v.to_string()),
        "message_id": properties.message_id().as_ref().map(|v| v.to_string()),
        "timestamp": properties.timestamp(),
        "app_id": properties.app_id().as_ref().map(|v| v.to_string()),
        "headers": properties.headers().as_ref().map(table_json),
    })
}

fn table_json(table: &FieldTable) -> Value {
    Value::Object(
        table
            .inner()
            .iter()
            .map(|(key, value)| (key.to_string(), value_json(value)))
            .collect(),
    )
}

fn value_json(value: &AMQPValue) -> Value {
    match value {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Float(n) => json!(n),
        AMQPValue::Double(n) => json!(n),
        AMQPValue::Timestamp(t) => json!(t),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => json!(s.to_string()),
        AMQPValue::FieldArray(array) => {
            Value::Array(array.as_slice().iter().map(value_json).collect())
        }
        AMQPValue::FieldTable(table) => table_json(table),
        AMQPValue::Void => Value::Null,
        other => json!(format!("{other:?}")),
    }
}

/// `text` with its control characters escaped (`\u{1b}`, `\0`), so that a
/// body or an id cannot drive the terminal it is printed on.
#[doc(hidden)]
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.event_id, &self.invalid) {
            (Some(id), _) => write!(f, "{}", printable(id))?,
            (None, Some(why)) => write!(f, "(invalid: {})", printable(why))?,
            (None, None) => write!(f, "(no event id)")?,
        }
        match &self.death {
            Some(death) => {
                write!(
                    f,
                    "  queue={} reason={} count={}",
                    printable(&death.queue),
                    printable(&death.reason),
                    death.count
                )?;
                if let Some(time) = death.time {
                    write!(f, " at={}", rfc3339(time))?;
                }
            }
            None => write!(f, "  (no record of its death)")?,
        }
        if self.replays > 0 {
            write!(f, " replays={}", self.replays)?;
        }
        match self.applied {
            Some(false) => write!(f, "  a replay would apply it")?,
            Some(true) => write!(
                f,
                "  applied already: a replay would be acked as a duplicate"
            )?,
            None => {}
        }
        if let Some(failures) = &self.failures {
            write!(
                f,
                "\n    failed {} time(s), last error: {}",
                failures.failures,
                printable(&failures.last_error)
            )?;
        }
        Ok(())
    }
}

impl Report {
    /// The dead letters replayed, per queue they went back to.
    pub fn replayed_per_queue(&self) -> BTreeMap<&str, usize> {
        let mut queues = BTreeMap::new();
        for entry in &self.replayed {
            if let Some(death) = &entry.death {
                *queues.entry(death.queue.as_str()).or_default() += 1;
            }
        }
        queues
    }
}

/// What `idem dlq` shows: a report of [`run`], or the counts of
/// [`summary`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// A report, one entry per line.
    Listing,
    /// Counts only, from the dead-letter index ([`summary`]); a [`Printed`]
    /// report shows its entries whatever the view.
    Summary,
}

/// A report as `idem dlq` prints it.
pub struct Printed<'a> {
    /// The report.
    pub report: &'a Report,
    /// How.
    pub view: View,
}

impl fmt::Display for Printed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let report = self.report;
        let queue = printable(&report.queue);
        if !report.replayed.is_empty() || !report.failed.is_empty() {
            let per_queue: Vec<String> = report
                .replayed_per_queue()
                .iter()
                .map(|(queue, n)| format!("{n} to {}", printable(queue)))
                .collect();
            write!(
                f,
                "replayed {} message(s) from {queue}",
                report.replayed.len()
            )?;
            if !per_queue.is_empty() {
                write!(f, " ({})", per_queue.join(", "))?;
            }
            if report.nacks_retried > 0 {
                write!(
                    f,
                    "; {} nacked by the broker and sent again",
                    report.nacks_retried
                )?;
            }
        } else if let Some(file) = &report.file {
            write!(
                f,
                "discarded {} message(s) from {queue} into {}",
                report.discarded.len(),
                file.display()
            )?;
        } else if let Some(synced) = &report.synced {
            write!(f, "{}", SyncedIn(&report.queue, synced))?;
        } else {
            if report.limited {
                write!(
                    f,
                    "the first {} dead-lettered message(s) in {queue} that match (the limit), \
                     of the {} looked at; the queue holds {} (nothing moved)",
                    report.listed.len(),
                    report.seen,
                    report.in_queue
                )?;
            } else {
                write!(
                    f,
                    "{} of {} dead-lettered message(s) in {queue} match (nothing moved)",
                    report.listed.len(),
                    report.in_queue
                )?;
            }
            for entry in &report.listed {
                write!(f, "\n  {entry}")?;
            }
        }
        if report.skipped_invalid > 0 {
            write!(
                f,
                "; {} invalid body(ies) skipped (--include-invalid replays them)",
                report.skipped_invalid
            )?;
        }
        if !report.failed.is_empty() {
            write!(
                f,
                "; {} could not be replayed and stay there",
                report.failed.len()
            )?;
            for (entry, why) in &report.failed {
                write!(f, "\n  {entry}: {}", printable(why))?;
            }
        }
        if report.moved_to_tail > 0 {
            write!(
                f,
                "\n  ({} letter(s) left in the queue went to its tail: a pass holds at most {HOLD} \
                 unacked, and moves the ones it keeps beyond that)",
                report.moved_to_tail
            )?;
        }
        if let Some(why) = &report.stopped_early {
            write!(
                f,
                "\n  (stopped before the end of the queue: {}; the rest is still there)",
                printable(why)
            )?;
        }
        if report.not_looked_at > 0 {
            write!(
                f,
                "\n  ({} letter(s) not looked at: the dead-letter index, which counts every \
                 letter in the queue, counts no more matches; --every-letter looks at each)",
                report.not_looked_at
            )?;
        }
        if let Some(error) = &report.index_stale {
            write!(
                f,
                "\n  (the dead-letter index could not be told: {}; `{} dlq sync` mends it)",
                printable(error),
                crate::program::name()
            )?;
        }
        if let Some(error) = &report.ledger_unavailable {
            write!(
                f,
                "\n  (the failure ledger could not be read: {})",
                printable(error)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::Invalid;

    /// The event id of a body the handler can apply; for one it cannot,
    /// why and how it starts (an entry's `invalid`).
    fn event_id(handler: &impl Handler, body: &[u8]) -> Result<String, String> {
        decoded_id(handler, body).map_err(|invalid| described(&invalid, body))
    }

    /// `{"eventId": …, "points": N}`, N above 0.
    struct Credits;

    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Credit {
        event_id: String,
        points: i64,
    }

    impl Handler for Credits {
        type Event = Credit;

        const NAME: &'static str = "credits";

        fn decode(&self, body: &[u8]) -> Result<Credit, Invalid> {
            let credit: Credit = serde_json::from_slice(body)?;
            if credit.points <= 0 {
                return Err(Invalid::new(format!(
                    "field `points` must be above 0, got {}",
                    credit.points
                )));
            }
            Ok(credit)
        }

        fn event_id<'e>(&self, event: &'e Credit) -> &'e str {
            &event.event_id
        }
    }

    #[test]
    fn an_invalid_body_is_shown_with_why_and_how_it_starts() {
        let handler = Credits;
        assert_eq!(
            event_id(&handler, br#"{"eventId":"e-1","orderId":"o","points":2}"#),
            Ok("e-1".to_owned())
        );
        assert_eq!(
            event_id(&handler, br#"{"eventId":"e-2","orderId":"o","points":-1}"#),
            Err(r#"field `points` must be above 0, got -1; the body starts "{\"eventId\":\"e-2\",\"orderId\":\"o\",\"points\":-1}""#.to_owned())
        );
        let long = event_id(&handler, "x".repeat(100).as_bytes());
        assert!(
            long.is_err_and(|described| described.ends_with(&format!("{}…\"", "x".repeat(79))))
        );
    }

    #[test]
    fn control_characters_never_reach_the_terminal() {
        assert_eq!(printable("plain"), "plain");
        assert_eq!(printable("a\u{1b}[2Jb\0c"), "a\\u{1b}[2Jb\\0c");
    }

    fn entry(reason: &str, time: u64, error: Option<&str>) -> Entry {
        Entry {
            key: event_key("e"),
            event_id: Some("e".into()),
            invalid: None,
            death: Some(Death {
                queue: "work".into(),
                reason: reason.into(),
                count: 1,
                time: Some(time),
                exchange: "x".into(),
                routing_keys: vec![],
            }),
            replays: 0,
            failures: error.map(|error| LedgerEntry {
                failures: 5,
                first_failed_at: SystemTime::UNIX_EPOCH,
                last_failed_at: SystemTime::UNIX_EPOCH,
                last_error: error.into(),
            }),
            indexed_error: None,
            applied: Some(false),
        }
    }

    #[test]
    fn every_part_of_a_filter_must_hold() {
        let now = 10_000;
        let old = entry("rejected", now - 7200, Some("order 1 is poisoned"));
        let recent = entry("delivery_limit", now - 60, None);
        let filter = |f: Filter| (f.matches(&old, now), f.matches(&recent, now));
        assert_eq!(filter(Filter::default()), (true, true));
        let by_reason = Filter {
            reason: Some("rejected".into()),
            ..Filter::default()
        };
        assert_eq!(filter(by_reason), (true, false));
        let by_error = Filter {
            error: Some("poisoned".into()),
            ..Filter::default()
        };
        let by_error_again = by_error.clone();
        assert_eq!(filter(by_error), (true, false));
        let older = Filter {
            older_than: Some(Duration::from_secs(3600)),
            ..Filter::default()
        };
        assert_eq!(filter(older), (true, false));
        let newer = Filter {
            newer_than: Some(Duration::from_secs(3600)),
            ..Filter::default()
        };
        assert_eq!(filter(newer), (false, true));
        let both = Filter {
            reason: Some("rejected".into()),
            newer_than: Some(Duration::from_secs(3600)),
            ..Filter::default()
        };
        assert_eq!(filter(both), (false, false));
        let invalid = Filter {
            invalid: true,
            ..Filter::default()
        };
        assert_eq!(filter(invalid.clone()), (false, false));
        // Once a replay reset its ledger, the index still says why it died.
        let replayed_and_cut_off = Entry {
            failures: None,
            indexed_error: Some("order 1 is poisoned".into()),
            ..old.clone()
        };
        assert!(by_error_again.matches(&replayed_and_cut_off, now));
        let garbage = Entry {
            event_id: None,
            invalid: Some("not JSON".into()),
            ..old.clone()
        };
        assert!(invalid.matches(&garbage, now));
    }
}
