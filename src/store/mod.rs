//! Everything PostgreSQL: the pool, the migrations, and the transaction
//! that claims events and applies a handler's effect.
//!
//! The consume loop calls [`Applier::apply`] and never sees SQL.

mod apply;
mod claim;
mod config;
#[doc(hidden)]
pub mod console;
#[doc(hidden)]
pub mod dead_letters;
mod failure;
#[doc(hidden)]
pub mod filter;
mod flush;
mod ledger;
mod members;
pub mod migrate;
#[doc(hidden)]
pub mod outbox;
mod parked;
mod ready;
pub mod retention;
mod standbys;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use deadpool_postgres::Pool;

pub(crate) use apply::RERUN_PAUSE;
#[doc(hidden)]
pub use apply::{Applier, Claimed, Failure};
#[doc(hidden)]
pub use claim::{
    claim_and_tally_statement, digest, general_path_statements, recorded,
    straight_claim_and_tally_statement,
};
#[doc(hidden)]
pub use config::is_identifier;
pub use config::{ConfigError, DatabaseConfig};
pub(crate) use dead_letters::GivenUpMessages;
pub use dead_letters::{DeadLetter, Filter, GroupCount, IndexSummary, IndexTotals, Indexed};
pub use failure::StoreError;
#[doc(hidden)]
pub use failure::describe;
#[doc(hidden)]
pub use filter::Filters;
#[doc(hidden)]
pub use flush::Lanes;
pub use ledger::LedgerEntry;
pub use parked::{DiscardError, Parked, ParkedEvent, ParkedKey, ParkedTotals, Parking};
#[doc(hidden)]
pub use ready::until_answered;
pub use ready::{ReadyError, Replication};
pub use standbys::Standbys;

/// The consume records and the failure ledger of one consumer group.
#[derive(Clone)]
pub struct Store {
    /// Shared by every in-flight transaction of the worker.
    pool: Pool,
    /// Part of the consume record's key: each group applies an event once.
    consumer_group: String,
    /// The closed epochs' filters its claims consult: none until someone
    /// syncs them (a worker does), and then a claim looks into a closed
    /// epoch only for the events its filter may hold.
    filters: Arc<Filters>,
    /// Connections its claims share, committing without waiting for their
    /// own flush (a worker's store has them).
    lanes: Option<Lanes>,
    /// Most bytes of a dead letter's body the index keeps.
    kept_body_bytes: usize,
    /// The standbys a commit waits for before its deliveries are acked
    /// ([`Store::with_standbys`]); none: a commit is enough.
    standbys: Option<Arc<Standbys>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("consumer_group", &self.consumer_group)
            .field("pool", &self.pool.status())
            .field("filters", &self.filters)
            .field("lanes", &self.lanes.is_some())
            .finish()
    }
}

impl Store {
    /// A store for `consumer_group` over `pool`, with no filter yet.
    pub fn new(pool: Pool, consumer_group: impl Into<String>) -> Self {
        Self {
            pool,
            consumer_group: consumer_group.into(),
            filters: Arc::default(),
            lanes: None,
            kept_body_bytes: dead_letters::KEPT_BODY_BYTES,
            standbys: None,
        }
    }

    /// The same store, keeping at most `bytes` of each dead letter's body
    /// in the index (0: none, only its size and digest).
    pub fn with_kept_body_bytes(self, bytes: usize) -> Self {
        Self {
            kept_body_bytes: bytes,
            ..self
        }
    }

    /// The same store, its claims consulting `filters`.
    pub fn with_filters(self, filters: Arc<Filters>) -> Self {
        Self { filters, ..self }
    }

    /// The same store, the claims of a handler with a tally sent on
    /// `lanes`, committing without waiting for their own flush;
    /// [`Applier::apply`] returns once a flush on their lane is done.
    pub fn with_lanes(self, lanes: Lanes) -> Self {
        Self {
            lanes: Some(lanes),
            ..self
        }
    }

    /// The same store, a transaction whose deliveries are to be acked
    /// returning only once `standbys` have its commit
    /// ([`Standbys`]). Give lanes after this.
    pub fn with_standbys(self, standbys: Arc<Standbys>) -> Self {
        Self {
            standbys: Some(standbys),
            ..self
        }
    }

    /// The standbys its commits wait for, if any.
    pub fn standbys(&self) -> Option<&Arc<Standbys>> {
        self.standbys.as_ref()
    }

    /// Returns once the standbys the store waits for, if any, have what
    /// `client`'s session committed last.
    pub(crate) async fn replicated(
        &self,
        client: &deadpool_postgres::ClientWrapper,
    ) -> Result<(), StoreError> {
        match &self.standbys {
            Some(standbys) => standbys.have_commits_of(client).await,
            None => Ok(()),
        }
    }

    /// The lanes of its claims, if it has them.
    pub fn lanes(&self) -> Option<&Lanes> {
        self.lanes.as_ref()
    }

    /// The closed epochs' filters its claims consult.
    pub fn filters(&self) -> &Arc<Filters> {
        &self.filters
    }

    /// The pool the store's statements run on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The consumer group whose records this store keeps.
    pub fn consumer_group(&self) -> &str {
        &self.consumer_group
    }

    /// Counts a genuine failure of `event_id`, in a transaction of its own
    /// (the failed one rolled back); returns how many there were.
    pub async fn record_failure(&self, event_id: &str, error: &str) -> Result<u32, StoreError> {
        let client = self.pool.get().await?;
        let failures = ledger::record(&client, event_id, &self.consumer_group, error).await?;
        Ok(u32::try_from(failures).unwrap_or(0))
    }

    /// The events among `event_ids` that already failed `max_failures` times.
    pub async fn exhausted(
        &self,
        event_ids: &[&str],
        max_failures: u32,
    ) -> Result<Vec<String>, StoreError> {
        let client = self.pool.get().await?;
        let max = i32::try_from(max_failures).unwrap_or(i32::MAX);
        Ok(ledger::exhausted(&client, event_ids, &self.consumer_group, max).await?)
    }

    /// The recorded failures of each of `event_ids` that has some.
    pub async fn ledger_entries(
        &self,
        event_ids: &[&str],
    ) -> Result<HashMap<String, LedgerEntry>, StoreError> {
        if event_ids.is_empty() {
            return Ok(HashMap::new());
        }
        let client = self.pool.get().await?;
        Ok(ledger::entries(&client, event_ids, &self.consumer_group).await?)
    }

    /// How many consume records this consumer group has, and when the
    /// oldest was written.
    pub async fn records(&self) -> Result<(i64, Option<SystemTime>), StoreError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT count(*), min(consumed_at) FROM mq_consume_record WHERE consumer_group = $1",
                &[&self.consumer_group],
            )
            .await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }

    /// How many events of this consumer group are failing: a failure
    /// counted in the ledger, neither applied since nor dead-lettered (the
    /// dead-letter index holds none of their letters); looking at no more
    /// than `at_most` of them (a status costs the same whatever the ledger
    /// holds); `true` with the count when there were more to look at.
    pub async fn failing(&self, at_most: i64) -> Result<(i64, bool), StoreError> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                // Not the rows of events recorded since (see `ledger::EXHAUSTED`).
                "WITH looked AS MATERIALIZED (\
                     SELECT event_id FROM mq_failure_ledger AS ledger WHERE consumer_group = $1 \
                     AND NOT EXISTS (SELECT FROM mq_dead_letter AS letter \
                         WHERE letter.consumer_group = $1 \
                           AND letter.letter_key = 'event ' || ledger.event_id) \
                     LIMIT $2::bigint + 1) \
                 SELECT count(*) FILTER (WHERE event_id NOT IN (\
                            SELECT recorded.event_id FROM mq_recorded(\
                                ARRAY(SELECT event_id FROM looked), $1) AS recorded)), \
                        count(*) > $2::bigint \
                 FROM looked",
                &[&self.consumer_group, &at_most],
            )
            .await?;
        let (count, more): (i64, bool) = (row.try_get(0)?, row.try_get(1)?);
        Ok((count.min(at_most), more))
    }

    /// Which of `event_ids` this consumer group applied already.
    pub async fn recorded(&self, event_ids: &[&str]) -> Result<HashSet<String>, StoreError> {
        if event_ids.is_empty() {
            return Ok(HashSet::new());
        }
        let client = self.pool.get().await?;
        Ok(claim::recorded(&client, &self.consumer_group, event_ids).await?)
    }

    /// Counts one more copy of each of `letters` in the dead-letter index:
    /// they are about to be dead-lettered.
    pub async fn index_dead_letters(&self, letters: &[DeadLetter]) -> Result<(), StoreError> {
        self.dead_lettered(letters, &[]).await
    }

    /// [`Store::index_dead_letters`], and in the same transaction the
    /// messages the handler sends when it is given up on, for each death
    /// no copy sent them for before.
    pub(crate) async fn dead_lettered(
        &self,
        letters: &[DeadLetter],
        given_up: &[GivenUpMessages],
    ) -> Result<(), StoreError> {
        if letters.is_empty() {
            return Ok(());
        }
        let mut client = self.pool.get().await?;
        if given_up.iter().all(|death| death.messages.is_empty()) {
            return Ok(dead_letters::write(
                &client,
                &self.consumer_group,
                letters,
                None,
                self.kept_body_bytes,
            )
            .await?);
        }
        let tx = client.transaction().await?;
        dead_letters::write(
            &tx,
            &self.consumer_group,
            letters,
            None,
            self.kept_body_bytes,
        )
        .await?;
        dead_letters::write_given_up(&tx, &self.consumer_group, given_up).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Takes one copy of each of `keys` off the dead-letter index: their
    /// letters were replayed or discarded.
    pub async fn dead_letters_taken(&self, keys: &[&str]) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let client = self.pool.get().await?;
        Ok(dead_letters::take(&client, &self.consumer_group, keys).await?)
    }

    /// What the dead-letter index keeps of each of `keys` it has: the last
    /// error (the ledger's when the letter died, kept after a replay resets
    /// the ledger) and the failure group.
    pub async fn dead_letters_indexed(
        &self,
        keys: &[&str],
    ) -> Result<HashMap<String, Indexed>, StoreError> {
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let client = self.pool.get().await?;
        Ok(dead_letters::indexed(&client, &self.consumer_group, keys).await?)
    }

    /// Indexes letters a sync found, each one copy; a row last touched
    /// before `started` (the sync's start) is set, not added to.
    pub async fn sync_dead_letters(
        &self,
        letters: &[DeadLetter],
        started: SystemTime,
    ) -> Result<(), StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::write(
            &client,
            &self.consumer_group,
            letters,
            Some(started),
            self.kept_body_bytes,
        )
        .await?)
    }

    /// Ends a sync that started at `started` and found `letters` letters:
    /// the rows of letters it did not find go. Returns how many went.
    pub async fn dead_letters_synced(
        &self,
        started: SystemTime,
        letters: i64,
    ) -> Result<u64, StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::synced(&client, &self.consumer_group, started, letters).await?)
    }

    /// The database's clock, now.
    pub async fn clock(&self) -> Result<SystemTime, StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::now(&client).await?)
    }

    /// The oldest epoch holding a record of an event of this group that has
    /// a dead letter in the index, and how many such events there are.
    pub async fn held_by_dead_letters(&self) -> Result<(Option<i32>, i64), StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::held_epoch(&client, &self.consumer_group).await?)
    }

    /// The dead-letter index's count of letters, and when it was last
    /// synced with the queue.
    pub async fn dead_letter_totals(&self) -> Result<IndexTotals, StoreError> {
        let client = self.pool.get().await?;
        Ok(dead_letters::totals(&client, &self.consumer_group).await?)
    }

    /// The dead letters of the index that match `filter`, counted.
    pub async fn dead_letter_summary(&self, filter: &Filter) -> Result<IndexSummary, StoreError> {
        let mut client = self.pool.get().await?;
        // Planned for the filter given: idem's connections plan generically
        // (for the worker's statements), which would read every row here
        // for the filters that are not there.
        let transaction = client.transaction().await?;
        transaction
            .batch_execute("SET LOCAL plan_cache_mode = force_custom_plan")
            .await?;
        let summary = dead_letters::summary(&transaction, &self.consumer_group, filter).await?;
        transaction.commit().await?;
        Ok(summary)
    }

    /// Forgets the failures of `event_ids`: a replay starts a fresh budget.
    pub async fn reset_ledger(&self, event_ids: &[&str]) -> Result<(), StoreError> {
        if event_ids.is_empty() {
            return Ok(());
        }
        let client = self.pool.get().await?;
        Ok(ledger::reset(&client, event_ids, &self.consumer_group).await?)
    }
}
