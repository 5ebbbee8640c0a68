//! `idem prune`: the retention of the consume records, under the design's
//! safety rule: keep a record at least as long as a message carrying its
//! event can come back. Once it is gone, such a message applies again.

use std::time::Duration;

use anyhow::{Context, anyhow};
use tokio_util::sync::CancellationToken;

use crate::broker;
use crate::dlq::{self, DlqConfig};
use crate::handler::Handler;
use crate::store::Store;
use crate::store::retention::{self, PruneConfig, Pruned};
use crate::target::Target;

/// `idem prune`'s settings.
#[derive(Debug, Clone)]
pub struct PruneSettings {
    /// The servers and the group: its work queue (what waits there while no
    /// worker consumes it may be older than the window), its dead-letter
    /// queue (whose letters an operator may still replay), and its retry
    /// policy (a message may come back as long after its first delivery as
    /// it waits through its attempts).
    pub target: Target,
    /// Remove what is older than this.
    pub older_than: Duration,
    /// Refuse a window shorter than this.
    pub min_retention: Duration,
    /// How long an epoch stays current.
    pub epoch_length: Duration,
    /// Longest wait for a lock (see [`PruneConfig::lock_timeout`]).
    pub lock_timeout: Duration,
    /// Change nothing: say what a pass would remove, and what it keeps.
    pub dry_run: bool,
}

impl PruneSettings {
    /// The shortest window allowed unless said otherwise: a week covers a
    /// weekend's outage and the operator's replay after it.
    pub const DEFAULT_MIN_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
    /// Claims wait behind an epoch being opened or dropped: not long.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(2);
    /// How often a worker's pruner prunes.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(3600);

    /// The length of an epoch: `given`, or half the window. Each epoch a
    /// claim looks into costs it a lookup per event, which costs more than
    /// a larger current epoch saves (docs/guide/performance.md): about three
    /// epochs live at a time, and records stay for one and a half windows
    /// at most.
    pub fn epoch_length(window: Duration, given: Option<Duration>) -> Duration {
        given.unwrap_or(window / 2)
    }

    /// The window must be no shorter than `min_retention`, and longer than
    /// a message takes through every retry.
    pub fn check_window(&self) -> crate::error::CommandResult<()> {
        let window = crate::duration::format_days(self.older_than);
        if self.older_than < self.min_retention {
            return Err(anyhow!(
                "a window of {window} is shorter than --min-retention ({}): a message that \
                 comes back after its record is removed applies again",
                crate::duration::format_days(self.min_retention)
            )
            .into());
        }
        let retries = self.target.topology.retry.longest_wait();
        if self.older_than <= retries {
            return Err(anyhow!(
                "a window of {window} is not longer than a message's retries wait in all ({}): a \
                 message still retrying could come back after its record is removed",
                crate::duration::format_days(retries)
            )
            .into());
        }
        Ok(())
    }
}

/// What `idem prune` did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// What went; `None` if another pruner was at work.
    pub pruned: Option<Pruned>,
    /// The epoch kept although older than the window, and how many dead
    /// letters carry an event recorded in it or later.
    pub held_back: Option<(i32, usize)>,
    /// Messages in the work queue, which no worker consumed: every epoch
    /// was kept.
    pub unconsumed: Option<u32>,
    /// The letters in the dead-letter queue and those the index counts,
    /// when the queue holds more: every epoch was kept.
    pub index_behind: Option<(u32, i64)>,
    /// The work queue, when it does not exist yet (no worker has run on
    /// this vhost): no message waits there.
    pub no_work_queue: Option<String>,
}

/// Checks the window against the safety rule, then prunes once.
pub async fn run<H: Handler>(
    settings: &PruneSettings,
    shutdown: &CancellationToken,
) -> crate::error::CommandResult<Outcome> {
    Ok(prune_once::<H>(settings, shutdown).await?)
}

/// [`run`].
async fn prune_once<H: Handler>(
    settings: &PruneSettings,
    shutdown: &CancellationToken,
) -> anyhow::Result<Outcome> {
    settings.check_window()?;
    // The dead letters an operator may replay: an event among them that
    // this group applied (another copy of it did) keeps its record. They
    // are read from the dead-letter index; where the queue holds letters
    // the index does not know of (from an older idem, or the broker's
    // delivery limit), every epoch is kept until a sync. That waits for
    // the database first, and says if it is not migrated.
    let target = &settings.target;
    let index = dlq::index_state::<H>(&DlqConfig::new(target.clone()), shutdown)
        .await
        .context("cannot tell which dead letters were applied, so nothing is pruned")?;
    let index_behind = index
        .behind()
        .then(|| (index.in_queue.unwrap_or(0), index.totals.letters));
    if shutdown.is_cancelled() {
        return Ok(Outcome::default());
    }
    let store = Store::new(target.database.pool()?, target.consumer_group.clone());
    let (for_letters, applied) = store.held_by_dead_letters().await?;
    let work_queue = work_queue(settings).await?;
    let (unconsumed, no_work_queue) = match work_queue {
        WorkQueue::Missing => (None, Some(target.topology.queue.clone())),
        WorkQueue::Unconsumed(messages) => (messages, None),
    };
    let pool = store.pool().clone();
    let client = pool.get().await?;
    let keep_from = if unconsumed.is_some() || index_behind.is_some() {
        retention::epochs(&client)
            .await?
            .first()
            .map(|epoch| epoch.epoch)
    } else {
        for_letters
    };
    drop(client);
    let config = PruneConfig {
        older_than: settings.older_than,
        epoch_length: settings.epoch_length,
        lock_timeout: settings.lock_timeout,
        keep_from,
        dry_run: settings.dry_run,
        keep_ledger: index_behind.is_some(),
    };
    let pruned = retention::prune(&pool, &config)
        .await
        .context("pruning the consume records")?;
    Ok(Outcome {
        pruned,
        held_back: for_letters.map(|epoch| (epoch, usize::try_from(applied).unwrap_or(usize::MAX))),
        unconsumed,
        index_behind,
        no_work_queue,
    })
}

/// What the work queue holds that no worker consumes.
enum WorkQueue {
    /// It does not exist: no worker declared it yet, nothing waits.
    Missing,
    /// Messages that wait there with no worker consuming them (`None`:
    /// none, or they are consumed).
    Unconsumed(Option<u32>),
}

/// How many messages wait in the work queue with no worker consuming them:
/// a worker down for longer than the window leaves copies there older than
/// it, which would apply again once their records are gone. `None` when
/// the queue is empty or consumed (its messages are then as old as the
/// workers' lag).
async fn work_queue(settings: &PruneSettings) -> anyhow::Result<WorkQueue> {
    let queue = &settings.target.topology.queue;
    let connection = broker::connect(&settings.target.amqp, "idem prune").await?;
    let counts = async {
        let channel = connection.create_channel().await?;
        broker::queue_counts(&channel, queue).await
    }
    .await;
    broker::close(&connection).await;
    let (messages, consumers) = match counts {
        Err(error) if broker::not_found(&error) => return Ok(WorkQueue::Missing),
        counts => counts.with_context(|| format!("cannot read the work queue {queue}"))?,
    };
    Ok(WorkQueue::Unconsumed(
        (messages > 0 && consumers == 0).then_some(messages),
    ))
}

/// A worker's pruner: [`run`] every `interval` until `shutdown`. A pass that
/// fails is logged and the next one tries again: the worker goes on.
pub async fn keep_pruning<H: Handler>(
    settings: PruneSettings,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        match run::<H>(&settings, &shutdown).await {
            Ok(outcome) => match &outcome.pruned {
                Some(pruned) if pruned.opened.is_some() || !pruned.dropped.is_empty() => {
                    tracing::info!(
                        opened = pruned.opened,
                        dropped = ?pruned.dropped,
                        records = pruned.records,
                        ledger_rows = pruned.ledger_rows,
                        outbox_rows = pruned.outbox_rows,
                        held_back = outcome.held_back.map(|(epoch, _)| epoch),
                        "pruned the consume records"
                    );
                }
                _ if outcome.index_behind.is_some() => tracing::warn!(
                    %outcome,
                    "kept every epoch until `{} dlq sync` indexes the dead letters",
                    crate::program::name()
                ),
                _ => tracing::debug!(%outcome, "nothing to prune"),
            },
            Err(error) => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "pruning failed; the next pass tries again"
                );
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(pruned) = &self.pruned else {
            return write!(f, "another pruner is at work on this schema: nothing done");
        };
        let (open, drop, remove) = if pruned.dry_run {
            ("would open", "would drop", "would remove")
        } else {
            ("opened", "dropped", "removed")
        };
        if pruned.dry_run {
            writeln!(f, "a dry run: nothing is changed")?;
        }
        if let Some(epoch) = pruned.opened {
            writeln!(f, "{open} epoch {epoch}")?;
        }
        match pruned.dropped.as_slice() {
            [] => writeln!(f, "no epoch older than the window")?,
            epochs => writeln!(
                f,
                "{drop} epoch{} {} (about {} consume records)",
                if epochs.len() == 1 { "" } else { "s" },
                epochs
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                pruned.records
            )?,
        }
        if let Some(queue) = &self.no_work_queue {
            writeln!(
                f,
                "there is no work queue {queue} yet (no worker has run on this vhost): no \
                 message waits in it"
            )?;
        }
        if let Some(messages) = self.unconsumed {
            writeln!(
                f,
                "kept every epoch: {messages} message(s) wait in the work queue and no worker \
                 consumes it, and they may be older than the window"
            )?;
        }
        if let Some((ready, indexed)) = self.index_behind {
            writeln!(
                f,
                "kept every epoch and the failure ledger: the dead-letter queue holds {ready} \
                 letter(s), the index knows of {indexed}; `{} dlq sync` tells which of the \
                 others carry events applied already",
                crate::program::name()
            )?;
        }
        if let Some((epoch, letters)) = self.held_back {
            writeln!(
                f,
                "kept epoch {epoch} and later: {letters} dead letter(s) carry events applied \
                 there, and a replay would apply them again once their records are gone"
            )?;
        }
        write!(
            f,
            "{remove} {} failure ledger row(s), {} sent outbox row(s), {} record(s) of \
             given-up messages sent and {} hour(s) of the dead-letter tally, older than the \
             window (a letter still in the dead-letter queue keeps its event's ledger row, its \
             death's record and its hour)",
            pruned.ledger_rows, pruned.outbox_rows, pruned.given_up_rows, pruned.hourly_rows
        )
    }
}
