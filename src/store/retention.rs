//! Retention of the consume records: epochs opened as time goes by, and
//! whole epochs dropped once they are older than the window (a partition
//! dropped at once: no row deleted one by one, nothing left to vacuum).
//! The ledger's and the outbox's rows that outlive the window go too.

use std::time::{Duration, SystemTime};

use deadpool_postgres::Pool;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::StoreError;

/// An epoch of the consume records: a partition of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epoch {
    /// Its number; the highest is the current one, which takes the claims.
    pub epoch: i32,
    /// When it was opened.
    pub opened_at: SystemTime,
    /// When the next one was opened: its newest record is older. `None`
    /// for the current epoch.
    pub closed_at: Option<SystemTime>,
}

/// The epochs, oldest first.
#[doc(hidden)]
pub async fn epochs(client: &Client) -> Result<Vec<Epoch>, StoreError> {
    let rows = client
        .query(
            "SELECT epoch, opened_at, lead(opened_at) OVER (ORDER BY epoch) \
             FROM mq_consume_epoch ORDER BY epoch",
            &[],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(Epoch {
                epoch: row.try_get(0)?,
                opened_at: row.try_get(1)?,
                closed_at: row.try_get(2)?,
            })
        })
        .collect()
}

/// What a pass of [`prune`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pruned {
    /// The epoch it opened, if the current one had been open for a whole
    /// epoch's length.
    pub opened: Option<i32>,
    /// The epochs it dropped, oldest first.
    pub dropped: Vec<i32>,
    /// Consume records in them (PostgreSQL's estimate, which VACUUM and
    /// ANALYZE keep close).
    pub records: i64,
    /// Failure ledger rows removed: events last failed before the cutoff,
    /// whose messages are no longer anywhere (a letter the dead-letter index
    /// still holds keeps its event's row, which `dlq` shows).
    pub ledger_rows: u64,
    /// Outbox rows removed: sent before the cutoff.
    pub outbox_rows: u64,
    /// Records of deaths whose given-up messages were sent, from before the
    /// cutoff, of letters the index no longer holds.
    pub given_up_rows: u64,
    /// Hours of the dead-letter tally (`mq_dead_letter_hourly`, the
    /// console's chart) that ended before the cutoff, of which the index
    /// holds no letter any more.
    pub hourly_rows: u64,
    /// Nothing was done: what a pass would do now (a dry run).
    pub dry_run: bool,
}

/// How a pass of [`prune`] goes.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct PruneConfig {
    /// What is older than this goes: a closed epoch once its newest record
    /// is, a ledger row last failed before, an outbox row sent before.
    pub older_than: Duration,
    /// How long an epoch stays current (how many records a claim inserts
    /// among, against how many epochs it looks into).
    pub epoch_length: Duration,
    /// Longest wait for a lock: opening an epoch waits for the claims in
    /// flight, dropping one for the statements that read it, and the
    /// claims that come meanwhile wait behind. Past it, the step is left
    /// to the next pass.
    pub lock_timeout: Duration,
    /// Keep this epoch and the later ones whatever their age: one holds
    /// the record of an event a message that can still come back carries
    /// (a dead letter's, say), and a replay after the drop would apply it
    /// again.
    pub keep_from: Option<i32>,
    /// Change nothing: count what a pass would remove.
    pub dry_run: bool,
    /// Keep every failure-ledger row and record of a death: the dead-letter
    /// queue holds letters the index does not know, which may need them.
    pub keep_ledger: bool,
}

impl PruneConfig {
    /// A pass that removes what is older than `older_than`, opening an
    /// epoch every `epoch_length`, waiting at most `lock_timeout` for a
    /// lock; it keeps no epoch beyond its age and every ledger row a
    /// removal leaves.
    pub fn new(older_than: Duration, epoch_length: Duration, lock_timeout: Duration) -> Self {
        Self {
            older_than,
            epoch_length,
            lock_timeout,
            keep_from: None,
            dry_run: false,
            keep_ledger: false,
        }
    }
}

/// Rows a chunk of a removal deletes: short transactions, no long lock.
const CHUNK: i64 = 10_000;

/// Key of the advisory lock that lets one pruner at a time work on a
/// schema: "idmp" in ASCII, and the schema's epoch table.
const PRUNER_LOCK: &str = "SELECT pg_try_advisory_lock(x'69646d70'::integer, \
                           'mq_consume_epoch'::regclass::oid::integer)";

/// One pass: opens an epoch if the current one is due, drops the closed
/// epochs whose newest record is older than `older_than`, oldest first,
/// and removes the ledger and outbox rows older than that. `None` if
/// another pruner is at work on the schema. The safety rule (a window no
/// shorter than a message can come back in) is the caller's.
pub async fn prune(pool: &Pool, config: &PruneConfig) -> Result<Option<Pruned>, StoreError> {
    // A connection of its own, closed when done: the lock is the session's,
    // and must not stay with a pooled connection if a step fails.
    let mut client = deadpool_postgres::Object::take(pool.get().await?);
    let locked: bool = client.query_one(PRUNER_LOCK, &[]).await?.try_get(0)?;
    if !locked {
        return Ok(None);
    }
    client
        .batch_execute(&format!(
            "SET lock_timeout = {}",
            config.lock_timeout.as_millis().max(1)
        ))
        .await?;
    let mut pruned = Pruned {
        dry_run: config.dry_run,
        ..Pruned::default()
    };
    // The database's clock, which dated the epochs and the rows.
    let now: SystemTime = client.query_one("SELECT now()", &[]).await?.try_get(0)?;
    let cutoff = now
        .checked_sub(config.older_than)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let epochs = epochs(&client).await?;
    if let Some(current) = epochs.last()
        && now
            .duration_since(current.opened_at)
            .is_ok_and(|open| open >= config.epoch_length)
    {
        pruned.opened = if config.dry_run {
            Some(current.epoch + 1)
        } else {
            unless_locked(open_epoch(&client).await)?
        };
    }
    for epoch in &epochs {
        match epoch.closed_at {
            Some(closed)
                if closed < cutoff && config.keep_from.is_none_or(|keep| epoch.epoch < keep) => {}
            _ => break,
        }
        let records = if config.dry_run {
            epoch_records(&client, epoch.epoch).await?
        } else {
            let Some(records) = unless_locked(drop_epoch(&mut client, epoch.epoch).await)? else {
                break;
            };
            records
        };
        pruned.records += records;
        pruned.dropped.push(epoch.epoch);
    }
    let removed = |removal: &'static Removal| removal.run(&client, cutoff, config.dry_run);
    if !config.keep_ledger {
        pruned.ledger_rows = removed(&LEDGER).await?;
        pruned.given_up_rows = removed(&GIVEN_UP).await?;
    }
    pruned.hourly_rows = removed(&HOURLY).await?;
    pruned.outbox_rows = removed(&OUTBOX).await?;
    Ok(Some(pruned))
}

/// The oldest epoch holding a record of one of `event_ids` in
/// `consumer_group`.
#[doc(hidden)]
pub async fn oldest_epoch_of(
    client: &Client,
    consumer_group: &str,
    event_ids: &[&str],
) -> Result<Option<i32>, StoreError> {
    Ok(client
        .query_one(
            "SELECT min(epoch) FROM mq_recorded($1::varchar[], $2::varchar)",
            &[&event_ids, &consumer_group],
        )
        .await?
        .try_get(0)?)
}

/// Opens the next epoch (`mq_open_epoch`), in a transaction of its own.
#[doc(hidden)]
pub async fn open_epoch(client: &Client) -> Result<i32, StoreError> {
    Ok(client
        .query_one("SELECT mq_open_epoch()", &[])
        .await?
        .try_get(0)?)
}

/// Opens the next epoch if the current one has taken `max_records` records
/// or more (`mq_rotate`, one opening at a time); returns it.
#[doc(hidden)]
pub async fn rotate(client: &Client, max_records: i64) -> Result<Option<i32>, StoreError> {
    Ok(client
        .query_one("SELECT mq_rotate($1)", &[&max_records])
        .await?
        .try_get(0)?)
}

/// The epochs at a glance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochSummary {
    /// Epochs, the current one included.
    pub epochs: i64,
    /// Closed epochs whose filter is stored.
    pub filtered: i64,
    /// Records the current epoch has taken ([`current_records`]).
    pub current_records: i64,
}

/// How many epochs there are, how many have a stored filter, and how many
/// records the current one has taken.
#[doc(hidden)]
pub async fn summary(client: &Client) -> Result<EpochSummary, StoreError> {
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM mq_consume_epoch), \
                    (SELECT count(*) FROM mq_consume_filter)",
            &[],
        )
        .await?;
    Ok(EpochSummary {
        epochs: row.try_get(0)?,
        filtered: row.try_get(1)?,
        current_records: current_records(client).await?,
    })
}

/// Records the current epoch has taken: the id sequence's progress since
/// it opened (an overestimate: a duplicate or a rollback spends an id, and
/// each session takes ids a thousand at a time).
#[doc(hidden)]
pub async fn current_records(client: &Client) -> Result<i64, StoreError> {
    Ok(client
        .query_one(
            "SELECT (SELECT last_value FROM mq_consume_record_id_seq) - first_id \
             FROM mq_consume_epoch ORDER BY epoch DESC LIMIT 1",
            &[],
        )
        .await?
        .try_get(0)?)
}

/// Drops a closed epoch's partition, and the epoch with it; returns the
/// records it held (the estimate).
async fn drop_epoch(client: &mut Client, epoch: i32) -> Result<i64, StoreError> {
    let partition = format!("mq_consume_record_{epoch}");
    let records = epoch_records(client, epoch).await?;
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("DROP TABLE {partition}")).await?;
    tx.execute("DELETE FROM mq_consume_epoch WHERE epoch = $1", &[&epoch])
        .await?;
    tx.commit().await?;
    Ok(records)
}

/// A step that timed out waiting for a lock is left to the next pass.
pub(crate) fn unless_locked<T>(step: Result<T, StoreError>) -> Result<Option<T>, StoreError> {
    match step {
        Ok(done) => Ok(Some(done)),
        Err(error) if error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            tracing::info!(%error, "a pruning step waited too long for a lock: left to the next pass");
            Ok(None)
        }
        Err(error) => Err(error),
    }
}

/// Runs `statement` (`$1` the cutoff, `$2` the chunk) until it removes
/// nothing; returns the rows removed.
/// About how many consume records epoch `epoch` holds: PostgreSQL's
/// estimate, or a count for a partition never analyzed.
async fn epoch_records(client: &Client, epoch: i32) -> Result<i64, StoreError> {
    let partition = format!("mq_consume_record_{epoch}");
    let estimate: f32 = client
        .query_one(
            "SELECT reltuples FROM pg_class WHERE oid = $1::text::regclass",
            &[&partition],
        )
        .await?
        .try_get(0)?;
    // A table never analyzed says -1: counted then (autovacuum analyzes
    // a large one soon enough).
    if estimate >= 0.0 {
        return Ok(estimate as i64);
    }
    Ok(client
        .query_one(&format!("SELECT count(*) FROM {partition}"), &[])
        .await?
        .try_get(0)?)
}

/// Rows of one table that a pass removes once older than the window: those
/// `condition` (of `row`, the window's start `$1`) holds for.
struct Removal {
    table: &'static str,
    /// What a row is found by again: its primary key, or `ctid`.
    key: &'static str,
    condition: &'static str,
}

/// Failure ledger rows of events last failed before the window, whose
/// letters are not in the dead-letter queue (`dlq` shows theirs).
static LEDGER: Removal = Removal {
    table: "mq_failure_ledger",
    key: "ctid",
    condition: "row.last_failed_at < $1 AND NOT EXISTS (SELECT FROM mq_dead_letter AS letter \
                WHERE letter.consumer_group = row.consumer_group \
                  AND letter.letter_key = 'event ' || row.event_id)",
};

/// Outbox rows sent before the window: a relay removes what it sent; rows
/// marked sent were left by older relays, which marked them instead.
static OUTBOX: Removal = Removal {
    table: "mq_outbox",
    key: "id",
    condition: "row.sent_at < $1",
};

/// Records of deaths whose given-up messages were sent, before the window,
/// of letters no longer in the index: a late copy of a letter still in the
/// queue dies without sending again only while its death's record is there.
static GIVEN_UP: Removal = Removal {
    table: "mq_given_up",
    key: "ctid",
    condition: "row.given_up_at < $1 AND NOT EXISTS (SELECT FROM mq_dead_letter AS letter \
                WHERE letter.consumer_group = row.consumer_group \
                  AND letter.letter_key = row.letter_key)",
};

/// Hours of the dead-letter tally that ended before the window, of which
/// the index holds no letter: the console charts letters per hour over the
/// last days, and a letter still in the index keeps its hour.
static HOURLY: Removal = Removal {
    table: "mq_dead_letter_hourly",
    key: "ctid",
    condition: "row.hour + interval '1 hour' <= $1 AND NOT EXISTS (SELECT FROM mq_dead_letter AS letter \
                WHERE letter.consumer_group = row.consumer_group \
                  AND letter.dead_at >= row.hour \
                  AND letter.dead_at < row.hour + interval '1 hour')",
};

impl Removal {
    /// Removes the rows older than `cutoff` a chunk at a time, or only
    /// counts them (`dry_run`); how many.
    async fn run(
        &self,
        client: &Client,
        cutoff: SystemTime,
        dry_run: bool,
    ) -> Result<u64, StoreError> {
        let Removal {
            table,
            key,
            condition,
        } = self;
        if dry_run {
            let count: i64 = client
                .query_one(
                    &format!("SELECT count(*) FROM {table} AS row WHERE {condition}"),
                    &[&cutoff],
                )
                .await?
                .try_get(0)?;
            return Ok(u64::try_from(count).unwrap_or(0));
        }
        remove_in_chunks(
            client,
            &format!(
                "DELETE FROM {table} WHERE {key} = ANY(ARRAY(\
                     SELECT {key} FROM {table} AS row WHERE {condition} LIMIT $2))"
            ),
            cutoff,
        )
        .await
    }
}

async fn remove_in_chunks(
    client: &Client,
    statement: &str,
    cutoff: SystemTime,
) -> Result<u64, StoreError> {
    let statement = client.prepare(statement).await?;
    let mut removed = 0;
    loop {
        let chunk = client.execute(&statement, &[&cutoff, &CHUNK]).await?;
        removed += chunk;
        if chunk < CHUNK as u64 {
            return Ok(removed);
        }
    }
}
