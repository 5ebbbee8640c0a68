//! The claim-and-apply transaction: consume records for a batch's events,
//! the handler's effect for those that went in, and the failure ledger's
//! rows cleared, all committed together or not at all.

use std::fmt;
use std::sync::Arc;

use tokio_postgres::error::SqlState;

use super::outbox::{self, Rows};
use super::{ConfigError, Store, StoreError, claim, describe, is_identifier, ledger};
use crate::caught;
use crate::handler::{BoxError, Detailed, FailureKind, Handler, HandlerError, Outbox, Tally};
use crate::probe::{self, Point, Verdict};

/// The first pause before a transaction a flush did not confirm runs
/// again; it doubles with each run after.
pub(crate) const RERUN_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// Why a transaction did not commit, and whose fault that is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Failure {
    /// Whether the message failed or the infrastructure did.
    pub kind: FailureKind,
    /// What went wrong, as the failure ledger keeps it.
    pub reason: String,
    /// What the handler said of it beyond the reason
    /// ([`HandlerError::permanent_for`]), for the log line only.
    pub detail: Option<String>,
}

impl Failure {
    /// A failure of `kind`, for `reason`.
    pub fn new(kind: FailureKind, reason: impl Into<String>) -> Self {
        Self {
            kind,
            reason: reason.into(),
            detail: None,
        }
    }

    /// A failure of `kind` the handler reported with `error`: its reason,
    /// and its detail when it gave one.
    fn of(kind: FailureKind, error: &BoxError) -> Self {
        match error.downcast_ref::<Detailed>() {
            Some(detailed) => Self {
                detail: Some(detailed.detail().to_owned()),
                ..Self::new(kind, detailed.reason())
            },
            None => Self::new(kind, error.to_string()),
        }
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        Self::new(error.kind(), error.to_string())
    }
}

/// Which events of one transaction went in: their effect was applied now
/// (the others were applied before, by this consumer group).
#[derive(Debug, Default)]
pub struct Claimed<'a> {
    /// The transaction's distinct event ids, sorted, and whether each went in.
    ids: Vec<(&'a str, bool)>,
}

impl<'a> Claimed<'a> {
    fn new(ids: &[&'a str]) -> Self {
        Self {
            ids: ids.iter().map(|id| (*id, false)).collect(),
        }
    }

    fn went_in(&mut self, id: &str) {
        if let Ok(index) = self.ids.binary_search_by(|(known, _)| (*known).cmp(id)) {
            self.ids[index].1 = true;
        }
    }

    fn is_in(&self, id: &str) -> bool {
        self.ids
            .binary_search_by(|(known, _)| (*known).cmp(id))
            .is_ok_and(|index| self.ids[index].1)
    }

    /// Went in here or in `earlier`, a run of the same transaction whose
    /// commit may not have reached disk.
    fn or(mut self, earlier: Self) -> Self {
        for ((_, went_in), (_, before)) in self.ids.iter_mut().zip(earlier.ids) {
            *went_in |= before;
        }
        self
    }

    /// The event ids that went in.
    fn ids_in(&self) -> Vec<&'a str> {
        self.ids
            .iter()
            .filter(|(_, went_in)| *went_in)
            .map(|(id, _)| *id)
            .collect()
    }

    /// True the first time it is asked about an event that went in:
    /// a second copy of the same event in the same batch is a duplicate.
    pub fn take(&mut self, event_id: &str) -> bool {
        match self.ids.binary_search_by(|(id, _)| (*id).cmp(event_id)) {
            Ok(index) => std::mem::replace(&mut self.ids[index].1, false),
            Err(_) => false,
        }
    }
}

/// A committed transaction whose deliveries may be acked once
/// [`Applier::flushed`] says it is on disk.
pub(crate) struct Committed<'a> {
    /// Which events went in.
    pub(crate) claimed: Claimed<'a>,
    /// Committed without waiting for its flush: the earliest epoch its
    /// records can be in.
    unflushed: Option<i32>,
}

impl<'a> Committed<'a> {
    /// This run of a transaction after `earlier` runs of it, whose commits
    /// may not have reached disk: what went in in any of them, to be found
    /// on disk before the deliveries are acked.
    pub(crate) fn after(self, earlier: Option<Self>) -> Self {
        let Some(earlier) = earlier else {
            return self;
        };
        Self {
            claimed: self.claimed.or(earlier.claimed),
            unflushed: match (self.unflushed, earlier.unflushed) {
                (Some(now), Some(before)) => Some(now.min(before)),
                (now, before) => now.or(before),
            },
        }
    }
}

/// A statement that claims, as it is and committing without waiting for
/// its flush ([`claim::unflushed`]).
struct Claim {
    flushed: String,
    unflushed: String,
}

impl Claim {
    fn new(statement: String) -> Self {
        Self {
            unflushed: claim::unflushed(&statement),
            flushed: statement,
        }
    }

    fn text(&self, unflushed: bool) -> &str {
        if unflushed {
            &self.unflushed
        } else {
            &self.flushed
        }
    }
}

/// Runs a handler's effect under idem's consume records, for one consumer
/// group. Built once per worker: the statements are fixed then.
pub struct Applier<H: Handler> {
    store: Store,
    handler: Arc<H>,
    /// The handler's tally and the one statement that claims and applies
    /// it, when the handler has one: `[without, with]` the ledger clear.
    tally: Option<(Tally<H::Event>, [Claim; 2])>,
    /// The same for one event claimed straight into the current epoch.
    straight: Option<Claim>,
    /// The same statements writing the outbox rows of the events too, when
    /// the handler has a tally and sends messages.
    tally_and_send: Option<[Claim; 2]>,
    /// The claim of the general path.
    claim: String,
    /// The general path's outbox rows, when the handler sends messages.
    send: Option<String>,
    /// Asked before each commit, when a check armed one.
    probe: probe::Armed,
}

impl<H: Handler> fmt::Debug for Applier<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Applier")
            .field("handler", &H::NAME)
            .field("store", &self.store)
            .field("tally", &self.tally.as_ref().map(|(tally, _)| tally))
            .finish()
    }
}

impl<H: Handler> Applier<H> {
    /// An applier of `handler` over `store`. A tally whose names are not
    /// plain identifiers is refused.
    pub fn new(store: Store, handler: Arc<H>) -> Result<Self, ConfigError> {
        let tally = match handler.tally() {
            Some(tally) => {
                for name in [tally.table, tally.key, tally.amount] {
                    if !is_identifier(name) {
                        return Err(ConfigError::Tally {
                            handler: H::NAME,
                            name: name.to_owned(),
                        });
                    }
                }
                let statements = [false, true]
                    .map(|clear| Claim::new(claim::claim_and_tally_statement(&tally, clear)));
                Some((tally, statements))
            }
            None => None,
        };
        let tally_and_send = tally
            .as_ref()
            .filter(|_| H::SENDS_MESSAGES)
            .map(|(tally, _)| {
                [false, true]
                    .map(|clear| Claim::new(claim::claim_tally_and_send_statement(tally, clear)))
            });
        let straight = tally
            .as_ref()
            .map(|(tally, _)| Claim::new(claim::straight_claim_and_tally_statement(tally)));
        Ok(Self {
            store,
            handler,
            tally,
            straight,
            tally_and_send,
            claim: claim::claim_statement(),
            send: H::SENDS_MESSAGES.then(outbox::insert_statement),
            probe: None,
        })
    }

    /// The same applier, asking `probe` before each commit.
    pub(crate) fn probed(self, probe: probe::Armed) -> Self {
        Self { probe, ..self }
    }

    /// What the probe says before the commit of the transaction of `ids`:
    /// an error when it fails the transaction.
    async fn before_commit(&self, ids: &[&str]) -> Result<(), Failure> {
        match probe::reach(&self.probe, Point::BeforeCommit, ids).await {
            Verdict::Go => Ok(()),
            Verdict::Fail { kind, reason } => Err(Failure::new(kind, reason)),
        }
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// In one transaction: records each distinct event of `events` for this
    /// consumer group, applies the effect of those that went in (the others
    /// were applied before), and clears their failure-ledger rows. Of two
    /// copies of an event, the first in `events` is the one applied. Returns
    /// the events that went in. On error nothing is applied: the records
    /// roll back with the effect. A panic on the way (in the handler, or in
    /// idem) is a failure of the message, as any other. The messages the
    /// events that went in send ([`Handler::outgoing`]) are written to the
    /// outbox in the same transaction.
    ///
    /// With lanes ([`Store::with_lanes`]) a handler with a tally commits
    /// without waiting for its flush, and this returns once a flush has
    /// found what went in; when a flush did not (the record was lost, or
    /// the flush failed) it runs the transaction again.
    pub async fn apply<'e>(&self, events: &[&'e H::Event]) -> Result<Claimed<'e>, Failure> {
        self.apply_flushed(events, false).await
    }

    /// [`Applier::apply`] for events none of whose deliveries may follow an
    /// earlier attempt ([`crate::broker::death::may_follow_an_attempt`]):
    /// only a failed attempt writes the failure ledger, so a handler with a
    /// tally does not look there. A row left by another copy of an event,
    /// one that failed while this one was applied, is ignored once the
    /// event is recorded, and pruned with the records.
    pub async fn apply_first_deliveries<'e>(
        &self,
        events: &[&'e H::Event],
    ) -> Result<Claimed<'e>, Failure> {
        self.apply_flushed(events, true).await
    }

    async fn apply_flushed<'e>(
        &self,
        events: &[&'e H::Event],
        first_deliveries: bool,
    ) -> Result<Claimed<'e>, Failure> {
        let (mut earlier, mut pause) = (None, RERUN_PAUSE);
        loop {
            let committed = self.commit(events, first_deliveries).await?.after(earlier);
            if self.flushed(&committed).await {
                return Ok(committed.claimed);
            }
            // Not at once: a flush that keeps failing would spin.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RERUN_PAUSE * 100);
            earlier = Some(committed);
        }
    }

    /// [`Applier::apply`] (or, with `first_deliveries`,
    /// [`Applier::apply_first_deliveries`]) up to its commit, which may not
    /// be on disk yet: [`Applier::flushed`] says.
    pub(crate) async fn commit<'e>(
        &self,
        events: &[&'e H::Event],
        first_deliveries: bool,
    ) -> Result<Committed<'e>, Failure> {
        let (claimed, unflushed) = caught::future(self.attempt(events, !first_deliveries))
            .await
            .unwrap_or_else(|panic| {
                Err(Failure::new(
                    FailureKind::Message,
                    format!("the transaction {panic}"),
                ))
            })?;
        Ok(Committed { claimed, unflushed })
    }

    /// Whether what `committed` put in is on disk, once it is: at once for
    /// a commit that waited for its own flush, once the next flush has
    /// found its records for one that did not. False when a record was not
    /// found, or the flush failed: the transaction must run again.
    pub(crate) async fn flushed(&self, committed: &Committed<'_>) -> bool {
        let (Some(from_epoch), Some(lanes)) = (committed.unflushed, self.store.lanes()) else {
            return true;
        };
        let ids = committed.claimed.ids_in();
        let digests = claim::digests(self.store.consumer_group(), &ids);
        lanes.flushed(digests, from_epoch).await
    }

    /// One try at the batch, by the path its handler and the batch allow:
    /// a tally handler's claim and effect in one statement (for a single
    /// event that the filters clear, straight into its epoch first), any
    /// other handler's `apply` in a transaction after the claim. The
    /// claimed events, and the epoch a flush must find their records from
    /// when the statement committed without waiting for its own.
    async fn attempt<'e>(
        &self,
        events: &[&'e H::Event],
        clear_ledger: bool,
    ) -> Result<(Claimed<'e>, Option<i32>), Failure> {
        let batch = Batch::of(&*self.handler, &self.store, events);
        match &self.tally {
            Some((tally, statements)) => {
                self.claim_with_tally(&batch, tally, statements, clear_ledger)
                    .await
            }
            None => self
                .claim_and_apply(&batch)
                .await
                .map(|claimed| (claimed, None)),
        }
    }

    /// The claim, the tally and the outbox rows in one statement, which
    /// commits on its own: unflushed on a lane when a flush can find its
    /// records, else on a connection of its own.
    async fn claim_with_tally<'e>(
        &self,
        batch: &Batch<'_, 'e, H::Event>,
        tally: &Tally<H::Event>,
        statements: &[Claim; 2],
        clear_ledger: bool,
    ) -> Result<(Claimed<'e>, Option<i32>), Failure> {
        let database = |error| self.database_failure(&error);
        // Nothing is committed before the statement.
        self.before_commit(&batch.ids).await?;
        let lanes = self
            .store
            .lanes()
            .filter(|lanes| lanes.usable() && batch.consulted.by_digest_from.is_some());
        let from_epoch = lanes.and(batch.consulted.by_digest_from);
        let unflushed = lanes.is_some();
        let (lane, pooled);
        let client: &deadpool_postgres::ClientWrapper = match lanes {
            Some(lanes) => {
                lane = lanes.lane().await?;
                &lane
            }
            None => {
                pooled = self.store.pool.get().await.map_err(StoreError::from)?;
                &pooled
            }
        };
        let (keys, amounts) = tally.entries(&batch.distinct);
        // Only the rows of events that go in are written: the statement
        // joins them to its claim.
        let sent = Rows::of(
            batch.group,
            outbox_of(&*self.handler, &batch.ids, &batch.distinct),
        );
        if !clear_ledger
            && sent.is_empty()
            && let Some(claimed) = self
                .claim_straight(client, batch, &keys, &amounts, unflushed)
                .await?
        {
            if !unflushed {
                self.store.replicated(client).await?;
            }
            return Ok((claimed, from_epoch));
        }
        let mut params = batch.claim_params().to_vec();
        params.push(&keys);
        params.push(&amounts);
        let statement = match &self.tally_and_send {
            Some(sending) if !sent.is_empty() => {
                params.extend(sent.params());
                sending[usize::from(clear_ledger)].text(unflushed)
            }
            _ => statements[usize::from(clear_ledger)].text(unflushed),
        };
        let statement = client.prepare_cached(statement).await.map_err(database)?;
        let rows = client.query(&statement, &params).await.map_err(database)?;
        // Unflushed, the flush that finds the records waits for the standbys.
        if !unflushed {
            self.store.replicated(client).await?;
        }
        Ok((claimed(&batch.ids, &rows).map_err(database)?, from_epoch))
    }

    /// One event the filters clear, inserted straight into the epoch they
    /// believe current, its amount added in the same statement: the
    /// claimed event, or `None` when the claim must decide (a duplicate or
    /// a digest clash, an epoch closed since the filters were synced, a
    /// batch of more than one event, no straight statement).
    async fn claim_straight<'e>(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        batch: &Batch<'_, 'e, H::Event>,
        keys: &[&str],
        amounts: &[i64],
        unflushed: bool,
    ) -> Result<Option<Claimed<'e>>, Failure> {
        let database = |error| self.database_failure(&error);
        let (Some(straight), Some(epoch), [id], [digest], [key], [amount]) = (
            &self.straight,
            batch.consulted.straight,
            batch.ids.as_slice(),
            batch.digests.as_slice(),
            keys,
            amounts,
        ) else {
            return Ok(None);
        };
        let statement = client
            .prepare_cached(straight.text(unflushed))
            .await
            .map_err(database)?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
            [id, &batch.group, digest, &epoch, key, amount];
        match client.query(&statement, &params).await {
            // In: applied.
            Ok(rows) if !rows.is_empty() => {
                self.store.filters.went_straight();
                Ok(Some(claimed(&batch.ids, &rows).map_err(database)?))
            }
            // Not in: a duplicate, or a digest clash, which the claim
            // tells apart.
            Ok(_) => Ok(None),
            // The epoch closed (or was dropped) since the filters were
            // synced: its partition refused the record.
            Err(error) if refused_by_closed_epoch(&error) => {
                self.store.filters.not_straight();
                Ok(None)
            }
            Err(error) => Err(database(error)),
        }
    }

    /// The general path: the claim, then the handler's `apply` for the
    /// events that went in and their outbox rows, the ledger cleared, and
    /// the commit, in one transaction.
    async fn claim_and_apply<'e>(
        &self,
        batch: &Batch<'_, 'e, H::Event>,
    ) -> Result<Claimed<'e>, Failure> {
        let handler = &*self.handler;
        let database = |error| self.database_failure(&error);
        let mut client = self.store.pool.get().await.map_err(StoreError::from)?;
        let tx = client.transaction().await.map_err(database)?;
        let statement = tx.prepare_cached(&self.claim).await.map_err(database)?;
        let rows = tx
            .query(&statement, &batch.claim_params())
            .await
            .map_err(database)?;
        let claimed = claimed(&batch.ids, &rows).map_err(database)?;
        let fresh: Vec<&H::Event> = batch
            .distinct
            .iter()
            .copied()
            .filter(|event| claimed.is_in(handler.event_id(event)))
            .collect();
        if !fresh.is_empty() {
            let fresh_ids: Vec<&str> = fresh.iter().map(|event| handler.event_id(event)).collect();
            let mut outbox = outbox_of(handler, &fresh_ids, &fresh);
            handler
                .apply(&tx, &fresh, &mut outbox)
                .await
                .map_err(|error| self.handler_failure(error))?;
            let sent = Rows::of(batch.group, outbox);
            if let Some(send) = self.send.as_ref().filter(|_| !sent.is_empty()) {
                let statement = tx.prepare_cached(send).await.map_err(database)?;
                tx.execute(&statement, &sent.params())
                    .await
                    .map_err(database)?;
            }
        }
        // Also proves the transaction alive: a handler that swallowed an
        // error left it aborted, and COMMIT would roll back without a word.
        // (So the general path clears the ledger whatever the deliveries.)
        ledger::reset(&tx, &batch.ids, batch.group)
            .await
            .map_err(database)?;
        self.before_commit(&batch.ids).await?;
        tx.commit().await.map_err(database)?;
        self.store.replicated(&client).await?;
        Ok(claimed)
    }

    /// A broken connection (no SQLSTATE) is the infrastructure's whatever
    /// the handler says: it refines what PostgreSQL reported.
    fn database_failure(&self, error: &tokio_postgres::Error) -> Failure {
        let kind = match error.code() {
            Some(_) => self.handler.classify(error),
            None => FailureKind::Infrastructure,
        };
        Failure::new(kind, describe(error))
    }

    fn handler_failure(&self, error: HandlerError) -> Failure {
        match error {
            HandlerError::Database(error) => self.database_failure(&error),
            HandlerError::Message(error) => Failure::of(FailureKind::Message, &error),
            HandlerError::Permanent(error) => Failure::of(FailureKind::Permanent, &error),
            HandlerError::Infrastructure(error) => Failure::of(FailureKind::Infrastructure, &error),
        }
    }
}

/// A batch as its claim sees it: its distinct events in id order (of two
/// copies, the one delivered first), their ids and digests, the consumer
/// group, and what the closed epochs' filters said of them.
struct Batch<'s, 'e, E> {
    distinct: Vec<&'e E>,
    ids: Vec<&'e str>,
    group: &'s str,
    digests: Vec<uuid::Uuid>,
    consulted: super::filter::Consulted,
}

impl<'s, 'e, E> Batch<'s, 'e, E> {
    fn of<H: Handler<Event = E>>(handler: &H, store: &'s Store, events: &[&'e E]) -> Self {
        // Stable: of two copies, the one delivered first wins.
        let mut distinct: Vec<&'e E> = events.to_vec();
        distinct.sort_by(|a, b| handler.event_id(a).cmp(handler.event_id(b)));
        distinct.dedup_by(|a, b| handler.event_id(a) == handler.event_id(b));
        let ids: Vec<&'e str> = distinct.iter().map(|e| handler.event_id(e)).collect();
        let group = store.consumer_group();
        let digests = claim::digests(group, &ids);
        let consulted = store.filters.consult(&digests);
        Self {
            distinct,
            ids,
            group,
            digests,
            consulted,
        }
    }

    /// The claim's parameters: `$1` the ids, `$2` the group, `$3` their
    /// digests, `$4`…`$7` what the filters said.
    fn claim_params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 7] {
        [
            &self.ids,
            &self.group,
            &self.digests,
            &self.consulted.filtered,
            &self.consulted.closed_at,
            &self.consulted.suspect_at,
            &self.consulted.suspect_epoch,
        ]
    }
}

/// The outbox of `events` (sorted, distinct; `ids` theirs), with their
/// ordering keys, seeded with what the handler's [`Handler::outgoing`]
/// returns for each.
fn outbox_of<'e, H: Handler>(handler: &H, ids: &[&'e str], events: &[&'e H::Event]) -> Outbox<'e> {
    Outbox::new(
        H::SENDS_MESSAGES,
        ids,
        |place| handler.ordering_key(events[place]),
        |place| handler.outgoing(events[place]),
    )
}

/// Whether `error` is a consume record refused by the partition of a
/// closed epoch (its `_closed` constraint, migration 0012) or by the
/// partitioned table when the epoch's partition is gone.
fn refused_by_closed_epoch(error: &tokio_postgres::Error) -> bool {
    error.code() == Some(&SqlState::CHECK_VIOLATION)
        && error.as_db_error().is_some_and(|db| {
            db.table()
                .is_some_and(|table| table.starts_with("mq_consume_record"))
        })
}

/// The claim's answer: which of `ids` went in.
fn claimed<'e>(
    ids: &[&'e str],
    rows: &[tokio_postgres::Row],
) -> Result<Claimed<'e>, tokio_postgres::Error> {
    let mut claimed = Claimed::new(ids);
    for row in rows {
        claimed.went_in(row.try_get(0)?);
    }
    Ok(claimed)
}
