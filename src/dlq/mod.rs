//! Dead-letter triage: see what is in the dead-letter queue (a summary, a
//! filtered listing that says what a replay would do), replay what is worth
//! replaying, discard what is not.
//!
//! Nothing is lost: a dead-letter copy is acked only after its replay is
//! confirmed, or after the file it is discarded into is synced. Interrupted
//! at any moment, a message is at worst both replayed (or written) and still
//! dead-lettered; a replayed duplicate is absorbed by the consume record.

use std::path::PathBuf;

use anyhow::Context;

use crate::error::CommandResult;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::broker::death::Death;
use crate::broker::{
    ConnectionWatch, Nacks, Reconnects, close, close_channel, connect_with_retry, queue_counts,
};
use crate::handler::Handler;
use crate::progress::Progress;
use crate::store::{IndexSummary, IndexTotals, LedgerEntry, ReadyError, Store};
use crate::target::{OpenError, Target};

/// Which dead-letter queue, and how to reach the failure ledger.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DlqConfig {
    /// The servers and the consumer group whose dead letters these are (its
    /// topology's dead-letter queue), and how long to keep trying to
    /// (re)connect.
    pub target: Target,
    /// Which messages to act on.
    pub filter: Filter,
    /// Act on at most this many (of those that match).
    pub limit: Option<usize>,
    /// Look at every letter in the queue, even once as many as the
    /// dead-letter index counts as matching were found.
    pub every_letter: bool,
}

impl DlqConfig {
    /// A pass over the dead-letter queue of `target`, taking every letter
    /// (no filter, no limit).
    pub fn new(target: Target) -> Self {
        Self {
            target,
            filter: Filter::default(),
            limit: None,
            every_letter: false,
        }
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue(&self) -> &str {
        &self.target.topology.dead_letter_queue
    }
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
    /// Replay as [`Action::Replay`] does, every letter that matches (the
    /// filter names one), with its body replaced by `body`: an operator's
    /// edit, which the handler decodes as the event `event_id`. The copy
    /// carries [`REPLACES_HEADER`](crate::broker::death::REPLACES_HEADER),
    /// naming the letter it replaces; the letter is acked once the broker
    /// confirmed the copy.
    ReplayEdited {
        /// The edited body.
        body: Vec<u8>,
        /// Its event id, whose budget of attempts starts afresh.
        event_id: String,
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
    /// Its failure group in the dead-letter index, when looked up (a
    /// filter by group asks for it).
    pub group: Option<uuid::Uuid>,
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
    /// Copies of letters this run had replayed or discarded, back in the
    /// queue because a lost connection took their acks: acked, not acted
    /// on again.
    pub acked_again: usize,
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
        queue: config.dead_letter_queue().to_owned(),
        file: match action {
            Action::Discard { file } => Some(file.clone()),
            _ => None,
        },
        ..Report::default()
    };
    let mut discards = match action {
        Action::Discard { file } => Some(
            crate::files::append_private(file)
                .with_context(|| format!("cannot open {} to discard into", file.display()))?,
        ),
        _ => None,
    };
    // The ledger and the consume records are read for every chunk, and
    // reset before every replay: a schema that lacks them is said up front.
    let store = match config.target.ready_store::<H>(shutdown).await {
        Err(OpenError::Ready(ReadyError::Interrupted)) => return Ok(report),
        store => store?,
    };
    let mut reconnects = Reconnects::new(config.target.patience, "working through dead letters");
    let mut nacks = Nacks::new(config.target.patience);
    let mut consuming = None;
    let mut acted = std::collections::HashSet::new();
    loop {
        let done = report.replayed.len() + report.discarded.len() + report.listed.len();
        let connection = connect_with_retry(
            &config.target.amqp,
            "idem dlq",
            config.target.patience,
            shutdown,
        )
        .await?;
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
            acted: &mut acted,
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
    let store = match config.target.ready_store::<H>(shutdown).await {
        Err(OpenError::Ready(ReadyError::Interrupted)) => anyhow::bail!("interrupted"),
        store => store?,
    };
    Ok(IndexState {
        queue: config.dead_letter_queue().to_owned(),
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
    let connection = connect_with_retry(
        &config.target.amqp,
        "idem dlq",
        config.target.patience,
        shutdown,
    )
    .await?;
    let channel = connection.create_channel().await?;
    let counts = queue_counts(&channel, config.dead_letter_queue())
        .await
        .ok();
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
    let store = Store::new(
        config.target.database.pool()?,
        config.target.consumer_group.clone(),
    );
    let summary = store.dead_letter_summary(&config.filter).await?;
    // A schema before order per key, or none parked: nothing to say.
    let parked = store
        .parked_totals()
        .await
        .ok()
        .filter(|parked| parked.keys > 0);
    Ok(IndexedSummary {
        state,
        summary,
        parked,
    })
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
    /// On an ordered queue, the keys parked, when there are any: some of
    /// them behind a letter of this queue.
    pub parked: Option<crate::store::ParkedTotals>,
}

mod export;
mod pass;
mod taking;
#[cfg(test)]
mod tests;
mod text;

pub use crate::store::Filter;
use export::*;
use pass::*;
use taking::*;
pub use text::{Printed, View, printable};
