//! The deduplication strategies the lab compares, each written the way a
//! team would write it: a few statements (or a Redis call) around the same
//! points effect, with the ack where that strategy puts it.

use redis::aio::MultiplexedConnection;
use tokio_postgres::Client;

use futures::future::BoxFuture;
use tokio_postgres::Transaction;

/// Why a strategy stopped handling a delivery.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The lab killed the consumer.
    Crash,
    /// A statement failed; the delivery is given back unless it was acked.
    Failed(String),
    /// The broker failed the lab.
    Broker(lapin::Error),
}

impl From<tokio_postgres::Error> for Stop {
    fn from(error: tokio_postgres::Error) -> Self {
        Stop::Failed(idem::store::describe(&error))
    }
}

impl From<redis::RedisError> for Stop {
    fn from(error: redis::RedisError) -> Self {
        Stop::Failed(error.to_string())
    }
}

/// The points statement a strategy runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Effect {
    /// Add the event's points.
    Add,
    /// Add them if the row's version is still this one.
    AddAt(i64),
}

/// Where a statement runs: on its own, or in a transaction.
pub(crate) enum On<'a, 'tx> {
    Session(&'a Client),
    Tx(&'a Transaction<'tx>),
}

impl<'a> From<&'a Client> for On<'a, 'static> {
    fn from(client: &'a Client) -> Self {
        On::Session(client)
    }
}

impl<'a, 'tx> From<&'a Transaction<'tx>> for On<'a, 'tx> {
    fn from(tx: &'a Transaction<'tx>) -> Self {
        On::Tx(tx)
    }
}

/// What a strategy does with one delivery besides its own statements: the
/// event it carries, the points statement, the ack, and the lab's hands on
/// what happens between its steps (a kill, a gate). The lab's runner holds
/// the delivery; the strategies know only this.
pub(crate) trait Hands: Sync {
    /// The event's id.
    fn event_id(&self) -> &str;
    /// The order its points go to.
    fn order_id(&self) -> &str;
    /// The event's Redis key.
    fn redis_key(&self) -> String;
    /// How long that key lives.
    fn redis_ttl_ms(&self) -> u64;
    /// The strategy finished `step`: the consumer dies here if the fault says so.
    fn after(&self, step: Step) -> Result<(), Stop>;
    /// The strategy has decided the event is new and is about to act on it.
    fn gate(&self) -> BoxFuture<'_, ()>;
    /// Runs the points statement `on` a session or a transaction (or,
    /// under the fault that makes it fail, one that fails); the rows it
    /// changed.
    fn effect<'a>(&'a self, on: On<'a, 'a>, effect: Effect) -> BoxFuture<'a, Result<u64, Stop>>;
    /// Acks the delivery.
    fn ack(&self) -> BoxFuture<'_, Result<(), Stop>>;
    /// A version check failed.
    fn conflict(&self);
}

/// A way to make a redelivered event's effect happen once (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// `SELECT` the record; if absent, add the points, then insert the
    /// record, each statement on its own.
    CheckThenAct,
    /// `SELECT … FOR UPDATE` of the record in the transaction that adds the
    /// points and inserts it.
    Pessimistic,
    /// Read the record and the points row's version in one statement; add
    /// the points with `UPDATE … WHERE version = $v` and insert the record
    /// in one transaction, again from the read when the version moved.
    Optimistic,
    /// idem's: `INSERT … ON CONFLICT DO NOTHING` of the record and the
    /// points in one transaction, ack after commit.
    Idem,
    /// `SET key 1 NX PX ttl` in Redis as the record, then the points.
    Redis,
    /// idem's transaction, but the message is acked when it arrives (what
    /// an auto-ack consumer does), before the commit.
    AckBeforeCommit,
    /// The record in one transaction, the points in a second.
    RecordThenEffect,
    /// The points in one transaction (after a check of the record), the
    /// record in a second.
    EffectThenRecord,
}

/// A point in a strategy's handling of one delivery, after which the lab
/// can kill the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// The record was looked up.
    Check,
    /// The record was written (or the Redis key set): the event is claimed.
    Claim,
    /// The points were added.
    Effect,
    /// The record was written after the points.
    Record,
    /// The transaction committed.
    Commit,
    /// The message was acked.
    Ack,
}

impl Step {
    /// How the report names the moment after this step.
    pub fn after(self) -> &'static str {
        match self {
            Step::Check => "after the check",
            Step::Claim => "after the claim",
            Step::Effect => "after the points",
            Step::Record => "after the record",
            Step::Commit => "after the commit",
            Step::Ack => "after the ack",
        }
    }
}

/// The points of every event, one row per order; the record is per strategy.
const POINTS: &str = "CREATE TABLE points (
    order_id TEXT PRIMARY KEY,
    points   BIGINT NOT NULL DEFAULT 0,
    version  BIGINT NOT NULL DEFAULT 0
);";

/// A record table for the strategies that rely on their check: an index
/// to find a record, no unique key (with one, the strategy would be idem's
/// with extra statements).
const CHECKED_RECORD: &str = "CREATE TABLE consumed (event_id TEXT NOT NULL);
CREATE INDEX ON consumed (event_id);";

/// A record table with a unique key.
const UNIQUE_RECORD: &str = "CREATE TABLE consumed (event_id TEXT PRIMARY KEY);";

/// Rows, not one row: a record written twice by a race is there twice.
const SEEN: &str = "SELECT 1 FROM consumed WHERE event_id = $1";
const SEEN_FOR_UPDATE: &str = "SELECT 1 FROM consumed WHERE event_id = $1 FOR UPDATE";
const RECORD: &str = "INSERT INTO consumed (event_id) VALUES ($1)";
const CLAIM: &str = "INSERT INTO consumed (event_id) VALUES ($1) ON CONFLICT DO NOTHING";

impl Strategy {
    /// Every strategy, in the order of the report.
    pub const ALL: [Strategy; 8] = [
        Strategy::CheckThenAct,
        Strategy::Pessimistic,
        Strategy::Optimistic,
        Strategy::Idem,
        Strategy::Redis,
        Strategy::AckBeforeCommit,
        Strategy::RecordThenEffect,
        Strategy::EffectThenRecord,
    ];

    /// Its name in `--strategies`, queues and keys.
    pub fn slug(self) -> &'static str {
        match self {
            Strategy::CheckThenAct => "check-then-act",
            Strategy::Pessimistic => "pessimistic",
            Strategy::Optimistic => "optimistic",
            Strategy::Idem => "idem",
            Strategy::Redis => "redis",
            Strategy::AckBeforeCommit => "ack-before-commit",
            Strategy::RecordThenEffect => "record-then-effect",
            Strategy::EffectThenRecord => "effect-then-record",
        }
    }

    /// Its name as an SQL identifier.
    pub fn identifier(self) -> String {
        self.slug().replace('-', "_")
    }

    /// How the report names it.
    pub fn title(self) -> &'static str {
        match self {
            Strategy::CheckThenAct => "1 check, then act",
            Strategy::Pessimistic => "2 SELECT … FOR UPDATE",
            Strategy::Optimistic => "3 version column",
            Strategy::Idem => "4 idem: unique record, same tx",
            Strategy::Redis => "5 Redis SET NX, then db",
            Strategy::AckBeforeCommit => "6 idem's tx, ack first",
            Strategy::RecordThenEffect => "7a record tx, then effect tx",
            Strategy::EffectThenRecord => "7b effect tx, then record tx",
        }
    }

    /// Whether the dedupe record is in Redis.
    pub fn uses_redis(self) -> bool {
        self == Strategy::Redis
    }

    /// The tables of its schema.
    pub(crate) fn schema(self) -> String {
        let record = match self {
            Strategy::CheckThenAct | Strategy::Pessimistic | Strategy::Optimistic => CHECKED_RECORD,
            Strategy::Idem
            | Strategy::AckBeforeCommit
            | Strategy::RecordThenEffect
            | Strategy::EffectThenRecord => UNIQUE_RECORD,
            Strategy::Redis => "",
        };
        format!("{POINTS}\n{record}")
    }

    /// The steps after which a consumer can die with something left half
    /// done (the last one, the ack or the commit, leaves nothing).
    pub fn crash_points(self) -> &'static [Step] {
        match self {
            Strategy::CheckThenAct | Strategy::EffectThenRecord => {
                &[Step::Check, Step::Effect, Step::Record]
            }
            Strategy::Pessimistic | Strategy::Optimistic => {
                &[Step::Check, Step::Effect, Step::Record, Step::Commit]
            }
            Strategy::Idem => &[Step::Claim, Step::Effect, Step::Commit],
            Strategy::Redis | Strategy::RecordThenEffect => &[Step::Claim, Step::Effect],
            Strategy::AckBeforeCommit => &[Step::Ack, Step::Claim, Step::Effect],
        }
    }

    /// Handles one delivery: the strategy's statements, the lab's faults
    /// between them (through `d`), and the ack where the strategy puts it.
    pub(crate) async fn handle(
        self,
        db: &mut Client,
        redis: &mut MultiplexedConnection,
        d: &impl Hands,
    ) -> Result<(), Stop> {
        let id = d.event_id();
        match self {
            Strategy::CheckThenAct | Strategy::EffectThenRecord => {
                let seen = !db.query(SEEN, &[&id]).await?.is_empty();
                d.after(Step::Check)?;
                if seen {
                    return d.ack().await;
                }
                d.gate().await;
                d.effect(On::from(&*db), Effect::Add).await?;
                d.after(Step::Effect)?;
                let record = if self == Strategy::CheckThenAct {
                    RECORD
                } else {
                    CLAIM
                };
                db.execute(record, &[&id]).await?;
                d.after(Step::Record)?;
                d.ack().await
            }
            Strategy::Pessimistic => {
                let tx = db.transaction().await?;
                let seen = !tx.query(SEEN_FOR_UPDATE, &[&id]).await?.is_empty();
                d.after(Step::Check)?;
                if !seen {
                    d.gate().await;
                    d.effect(On::from(&tx), Effect::Add).await?;
                    d.after(Step::Effect)?;
                    tx.execute(RECORD, &[&id]).await?;
                    d.after(Step::Record)?;
                }
                tx.commit().await?;
                d.after(Step::Commit)?;
                d.ack().await
            }
            Strategy::Optimistic => loop {
                // One statement, one snapshot: reading the record first and
                // the version in a second statement doubles an event whose
                // other copy commits in between (the lab's first version did).
                let row = db
                    .query_one(
                        "SELECT version, EXISTS (SELECT 1 FROM consumed WHERE event_id = $2) \
                         FROM points WHERE order_id = $1",
                        &[&d.order_id(), &id],
                    )
                    .await?;
                let (version, seen): (i64, bool) = (row.get(0), row.get(1));
                d.after(Step::Check)?;
                if seen {
                    return d.ack().await;
                }
                d.gate().await;
                let tx = db.transaction().await?;
                let updated = d.effect(On::from(&tx), Effect::AddAt(version)).await?;
                d.after(Step::Effect)?;
                if updated == 0 {
                    // The version moved: another delivery changed the row.
                    tx.rollback().await?;
                    d.conflict();
                    continue;
                }
                tx.execute(RECORD, &[&id]).await?;
                d.after(Step::Record)?;
                tx.commit().await?;
                d.after(Step::Commit)?;
                return d.ack().await;
            },
            Strategy::Idem => {
                claim_and_apply(db, d).await?;
                d.ack().await
            }
            Strategy::Redis => {
                let set: Option<String> = redis::cmd("SET")
                    .arg(d.redis_key())
                    .arg(1)
                    .arg("NX")
                    .arg("PX")
                    .arg(d.redis_ttl_ms())
                    .query_async(redis)
                    .await?;
                d.after(Step::Claim)?;
                if set.is_some() {
                    d.gate().await;
                    d.effect(On::from(&*db), Effect::Add).await?;
                    d.after(Step::Effect)?;
                }
                d.ack().await
            }
            Strategy::AckBeforeCommit => {
                d.ack().await?;
                d.after(Step::Ack)?;
                claim_and_apply(db, d).await
            }
            Strategy::RecordThenEffect => {
                let claimed = db.execute(CLAIM, &[&id]).await? == 1;
                d.after(Step::Claim)?;
                if claimed {
                    d.gate().await;
                    d.effect(On::from(&*db), Effect::Add).await?;
                    d.after(Step::Effect)?;
                }
                d.ack().await
            }
        }
    }
}

/// idem's transaction: the record with `ON CONFLICT DO NOTHING`, and the
/// points only if it went in; committed together.
async fn claim_and_apply(db: &mut Client, d: &impl Hands) -> Result<(), Stop> {
    let tx = db.transaction().await?;
    let claimed = tx.execute(CLAIM, &[&d.event_id()]).await? == 1;
    d.after(Step::Claim)?;
    if claimed {
        d.gate().await;
        d.effect(On::from(&tx), Effect::Add).await?;
        d.after(Step::Effect)?;
    }
    tx.commit().await?;
    d.after(Step::Commit)
}
