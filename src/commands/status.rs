//! `idem status`: a consumer group at a glance. The work, wait and
//! dead-letter queues (depth and consumers), the consume records (count,
//! oldest, epochs), what a commit promises (replication), the failure
//! ledger, and the dead letters per reason.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;

use crate::broker::{Topology, close, close_channel, queue_counts};
use crate::dlq::printable;
use crate::duration::rfc3339;
use crate::handler::Handler;
use crate::store::retention::{self, EpochSummary};
use crate::store::{IndexTotals, ParkedTotals, ReadyError, Replication, Store, StoreError};
use crate::target::{OpenError, Target};

/// How many failure ledger rows a status looks at, at most: every dead
/// letter has one, and a status should cost the same with a million as
/// with ten.
pub const LEDGER_LOOK: i64 = 1_000;

/// One queue's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueState {
    /// The queue.
    pub name: String,
    /// Ready messages and consumers; `None` when the queue does not exist.
    pub counts: Option<(u32, u32)>,
}

/// What `idem status` saw.
#[derive(Debug)]
pub struct Status {
    /// The consumer group.
    pub consumer_group: String,
    /// The work queue, the wait queues, the dead-letter queue.
    pub queues: Vec<QueueState>,
    /// Consume records of the group, and when the oldest was written.
    pub records: (i64, Option<SystemTime>),
    /// What a commit promises: whether a standby has it once it returns
    /// (`None`: the server would not say).
    pub replication: Option<Replication>,
    /// The consume records' epochs (of every group in the schema).
    pub epochs: EpochSummary,
    /// Events of the group failing (a failure counted, neither applied nor
    /// dead-lettered), counted up to [`LEDGER_LOOK`]; `true` when there are
    /// more.
    pub failing: (i64, bool),
    /// The dead letters the index counts, per reason of their death, and
    /// when it was last synced.
    pub index: IndexTotals,
    /// The letters the dead-letter queue holds (ready); `None` when it does
    /// not exist.
    pub in_queue: Option<u32>,
    /// The keys parked behind a failed head, on an ordered queue (or where
    /// some are parked); `None` otherwise.
    pub parked: Option<ParkedTotals>,
}

/// Looks at the consumer group's queues and tables (waiting for the
/// servers at most the target's patience); moves nothing.
pub async fn run<H: Handler>(
    target: &Target,
    shutdown: &CancellationToken,
) -> crate::error::CommandResult<Status> {
    let look = async {
        let store = match target.ready_store::<H>(shutdown).await {
            Err(OpenError::Ready(ReadyError::Interrupted)) => anyhow::bail!("interrupted"),
            store => store?,
        };
        let tables = tables(&store).await?;
        let replication = store.replication().await;
        let connection = target.connect("idem status", shutdown).await?;
        let queues = queue_states(&connection, &target.topology).await?;
        close(&connection).await;
        let in_queue = queues
            .iter()
            .find(|queue| queue.name == target.topology.dead_letter_queue)
            .and_then(|queue| queue.counts)
            .map(|(ready, _)| ready);
        Ok(Status {
            consumer_group: target.consumer_group.clone(),
            queues,
            records: tables.records,
            replication,
            epochs: tables.epochs,
            failing: tables.failing,
            index: tables.index,
            in_queue,
            parked: Some(tables.parked)
                .filter(|parked| target.topology.is_ordered() || parked.keys > 0),
        })
    };
    Ok(look.await?)
}

/// What a status reads of the group's tables.
#[derive(Debug)]
pub(crate) struct Tables {
    /// [`Status::records`].
    pub(crate) records: (i64, Option<SystemTime>),
    /// [`Status::epochs`].
    pub(crate) epochs: EpochSummary,
    /// [`Status::failing`].
    pub(crate) failing: (i64, bool),
    /// [`Status::index`].
    pub(crate) index: IndexTotals,
    /// The group's parked keys.
    pub(crate) parked: ParkedTotals,
}

/// The group's records, epochs, failing events and dead-letter index: the
/// index, not the queue, so that it costs the same with a million dead
/// letters as with ten.
pub(crate) async fn tables(store: &Store) -> Result<Tables, StoreError> {
    Ok(Tables {
        records: store.records().await?,
        epochs: retention::summary(&*store.pool().get().await?).await?,
        failing: store.failing(LEDGER_LOOK).await?,
        index: store.dead_letter_totals().await?,
        parked: store.parked_totals().await?,
    })
}

/// Each queue of `topology` with its ready messages and consumers, by a
/// passive declare (`None`: not declared).
pub(crate) async fn queue_states(
    connection: &lapin::Connection,
    topology: &Topology,
) -> lapin::Result<Vec<QueueState>> {
    let mut queues = Vec::new();
    for name in topology.queues() {
        // A passive declare of a missing queue closes its channel: one each.
        let channel = connection.create_channel().await?;
        let counts = queue_counts(&channel, &name).await.ok();
        if counts.is_some() {
            close_channel(&channel).await;
        }
        queues.push(QueueState { name, counts });
    }
    Ok(queues)
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "consumer group {}", printable(&self.consumer_group))?;
        let width = self.queues.iter().map(|q| q.name.len()).max().unwrap_or(0);
        writeln!(
            f,
            "  {:<width$}  {:>9}  {:>9}",
            "queue", "ready", "consumers"
        )?;
        for queue in &self.queues {
            match queue.counts {
                Some((ready, consumers)) => writeln!(
                    f,
                    "  {:<width$}  {ready:>9}  {consumers:>9}",
                    printable(&queue.name)
                )?,
                None => writeln!(
                    f,
                    "  {:<width$}  (missing: the worker declares it)",
                    printable(&queue.name)
                )?,
            }
        }
        let (records, oldest) = self.records;
        write!(f, "  consume records    {records}")?;
        if let Some(oldest) = oldest.and_then(|t| t.duration_since(UNIX_EPOCH).ok()) {
            write!(f, " (oldest {})", rfc3339(oldest.as_secs()))?;
        }
        writeln!(f)?;
        if let Some(replication) = &self.replication {
            writeln!(f, "  database           {replication}")?;
        }
        let EpochSummary {
            epochs,
            filtered,
            current_records,
        } = self.epochs;
        writeln!(
            f,
            "  epochs             {epochs} ({filtered} closed with a filter; the current one has \
             handed out about {current_records} record ids, duplicates and rollbacks included)"
        )?;
        match self.failing {
            (failing, false) => writeln!(f, "  failure ledger     {failing} event(s) failing")?,
            (failing, true) => writeln!(
                f,
                "  failure ledger     {failing} or more event(s) failing (neither applied nor \
                 dead-lettered; more rows than a status reads)"
            )?,
        }
        if let Some(parked) = &self.parked {
            parked_line(f, parked)?;
        }
        let reasons: Vec<String> = self
            .index
            .reasons
            .iter()
            .map(|(reason, n)| format!("{} {n}", printable(reason)))
            .collect();
        write!(
            f,
            "  dead letters       {}",
            if reasons.is_empty() {
                "none".to_owned()
            } else {
                reasons.join(", ")
            }
        )?;
        let synced = match self.index.synced_at {
            Some(at) => match at.duration_since(UNIX_EPOCH) {
                Ok(at) => format!("last synced {}", rfc3339(at.as_secs())),
                Err(_) => "synced".to_owned(),
            },
            None => "never synced".to_owned(),
        };
        match self.in_queue {
            Some(ready) if i64::from(ready) != self.index.letters => write!(
                f,
                " (by the index, {synced}; the dead-letter queue holds {ready} ready: \
                 `{} dlq sync` sets the index to it)",
                crate::program::name()
            ),
            _ => write!(f, " (by the index, {synced})"),
        }
    }
}

/// The parked keys of an ordered queue, in one line.
fn parked_line(f: &mut fmt::Formatter<'_>, parked: &ParkedTotals) -> fmt::Result {
    write!(
        f,
        "  parked keys        {} key(s) holding {} event(s)",
        parked.keys, parked.events
    )?;
    if let Some(oldest) = parked
        .oldest
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
    {
        write!(
            f,
            " (oldest parked {}; `{} parked` lists them)",
            rfc3339(oldest.as_secs()),
            crate::program::name()
        )?;
    }
    writeln!(f)
}
