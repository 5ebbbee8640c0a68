//! The relay: publishes what the outbox holds, at least once each.
//!
//! One transaction per batch: take the due messages waiting on their own
//! (`mq_outbox`), then rows of messages as transactions wrote them
//! (`mq_outbox_batch`), oldest first, locked (`FOR UPDATE SKIP LOCKED`, so
//! that relays running at once share the work instead of sending the same
//! rows), publish them with publisher confirms and `mandatory`, then remove
//! the confirmed ones and mark the refused ones due again later (a batch
//! row goes, and those of its messages not confirmed wait on their own),
//! and commit. Killed before the commit, the rows are
//! unlocked unsent and go again under the same `message_id`: a receiver
//! that deduplicates on it applies each once. It runs inside a worker whose
//! handler sends messages, and alone as `idem relay`.
//!
//! Messages of an event with an ordering key leave in their key's order,
//! whatever the number of relays and lanes: one transaction at a time
//! takes them (it holds an advisory lock; the others take the unordered
//! ones meanwhile), in id order, which is the order their events applied
//! in. A message the broker refuses waits, and its key's later messages
//! wait behind it. One limit: the messages of one batch are published
//! before any confirm is awaited, so a refused message's later ones *in
//! the same batch* may be confirmed before it.

use std::time::Duration;

use backon::BackoffBuilder;
use deadpool_postgres::Pool;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, PublisherConfirm};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::backoff::RECONNECT_PATIENCE;
use crate::broker::{
    AmqpConfig, ConfirmChannel, ConnectError, ConnectionWatch, Exchange, Outgoing, Reconnects,
    SessionError, TopologyError, close, close_channel, connect_with_retry, declare_exchanges,
    settle,
};
use crate::store::StoreError;
use crate::store::outbox::{self, Taken, Unsent};

/// The header a receiver finds the idempotency key in (besides the AMQP
/// `message_id` property).
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// What a relay needs to know.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// The broker.
    pub amqp: AmqpConfig,
    /// Most messages published per transaction.
    pub batch_size: i64,
    /// How long to wait before looking again when nothing is due.
    pub idle_wait: Duration,
    /// How long to keep trying to reach the broker at start; after the
    /// first connection a lost one is retried for as long as it takes,
    /// except with `until_empty`, which gives up after this long too.
    pub patience: Duration,
    /// Return once nothing is due instead of waiting for more.
    pub until_empty: bool,
    /// Lanes that relay at once, each on a channel of its own, with up to
    /// two batches in flight on two database connections (the pool needs
    /// [`RelayConfig::connections`]).
    pub lanes: usize,
    /// The exchanges the messages go to, declared at each connection.
    pub outgoing: Vec<Exchange>,
}

impl RelayConfig {
    /// Messages per transaction, by default.
    pub const DEFAULT_BATCH_SIZE: i64 = 1000;
    /// Lanes, by default. Messages with an ordering key leave in their
    /// key's order with any number of lanes and relays (one transaction
    /// at a time takes them); the others have no order, and more lanes
    /// only overlap their confirms.
    pub const DEFAULT_LANES: usize = 1;
    /// The wait when nothing is due, by default.
    pub const DEFAULT_IDLE_WAIT: Duration = Duration::from_millis(200);
    /// The longest a refused message waits before it is tried again.
    pub const MAX_REFUSED_WAIT: Duration = Duration::from_secs(300);

    /// The database connections the relay's pool needs: two per lane, one
    /// holding a batch whose confirms are on their way while the other
    /// takes and sends the next.
    pub fn connections(&self) -> usize {
        2 * self.lanes.max(1)
    }

    /// A relay to `amqp`, trying to reach it for `patience` at start, with
    /// idem's defaults for the rest, running until stopped.
    pub fn new(amqp: AmqpConfig, patience: Duration) -> Self {
        Self {
            amqp,
            batch_size: Self::DEFAULT_BATCH_SIZE,
            idle_wait: Self::DEFAULT_IDLE_WAIT,
            patience,
            until_empty: false,
            lanes: Self::DEFAULT_LANES,
            outgoing: Vec::new(),
        }
    }
}

/// A relay's counters, shared with whoever shows them (the worker's
/// `/metrics`).
#[derive(Debug, Clone, Default)]
pub struct RelayCounters {
    /// Messages confirmed and removed from the outbox.
    pub sent: Counter,
    /// Publishes the broker refused.
    pub refused: Counter,
    /// Messages not sent yet, as last counted (when nothing was due).
    pub unsent: Gauge,
}

/// What a relay did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RelayReport {
    /// Messages confirmed and removed from the outbox.
    pub sent: u64,
    /// Publishes the broker refused (nacked or returned); those messages
    /// stay unsent and are tried again later.
    pub refused: u64,
}

/// Why a relay stopped other than by being asked to.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The broker refused us or stayed unreachable.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The broker ended every session without anything getting done.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// An outgoing exchange exists with other settings, or the user may
    /// not declare it.
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// How one batch ended.
enum Batch {
    /// Published, and removed or marked.
    Done,
    /// The broker closed the channel over a message it will not take (its
    /// exchange is missing, say): the messages to that exchange are marked
    /// refused, those confirmed before sent, and the rest go again on a new
    /// channel.
    ChannelRefused,
    /// The broker connection failed: what it confirmed is removed as sent (or
    /// nothing, when it failed while confirming), the rest goes again.
    Lost(lapin::Error),
}

/// Relays until `shutdown` fires (or, with `until_empty`, until nothing is
/// due). A database that fails is waited for; a broker that fails is
/// reconnected to.
pub async fn run(
    pool: &Pool,
    config: &RelayConfig,
    counters: &RelayCounters,
    shutdown: &CancellationToken,
) -> Result<RelayReport, RelayError> {
    let base = (counters.sent.get(), counters.refused.get());
    let report = || RelayReport {
        sent: counters.sent.get() - base.0,
        refused: counters.refused.get() - base.1,
    };
    let mut patience = config.patience;
    let mut reconnects = Reconnects::new(patience, "relaying the outbox");
    loop {
        let connection =
            match connect_with_retry(&config.amqp, "idem relay", patience, shutdown).await {
                Ok(connection) => connection,
                Err(ConnectError::Interrupted) => return Ok(report()),
                Err(error) => return Err(error.into()),
            };
        if !config.until_empty && patience != RECONNECT_PATIENCE {
            patience = RECONNECT_PATIENCE;
            reconnects = Reconnects::new(patience, "relaying the outbox");
        }
        match declare_exchanges(&connection, &config.outgoing).await {
            Ok(()) => {}
            Err(error) if error.needs_an_operator() => {
                close(&connection).await;
                return Err(error.into());
            }
            // The connection failed: the next one declares them.
            Err(_) => {}
        }
        let _watch = ConnectionWatch::start(&connection, "relaying the outbox");
        let sent_before = counters.sent.get();
        // Lanes overlap one batch's confirms with the next one's reads and
        // sends; each ends on its own (shutdown, an empty outbox, or a lost
        // connection), so that none is cut off mid-batch by another.
        let lanes =
            (0..config.lanes.max(1)).map(|_| lane(pool, &connection, config, counters, shutdown));
        let lost = futures::future::join_all(lanes)
            .await
            .into_iter()
            .flatten()
            .next();
        close(&connection).await;
        let Some(error) = lost else {
            return Ok(report());
        };
        reconnects
            .after(&error, counters.sent.get() > sent_before, shutdown)
            .await?;
        if shutdown.is_cancelled() {
            return Ok(report());
        }
    }
}

/// One lane of a relay: a channel of its own, a batch after another, until
/// shutdown, an empty outbox (with `until_empty`) or a lost connection
/// (returned). A database that fails is waited for.
///
/// The next batch is taken and published while the last one's confirms are
/// on their way (its rows, still locked, are skipped), so that the broker
/// always has a batch to take; both go on the lane's one channel, in id
/// order, and each is settled in its own transaction, the older first.
async fn lane(
    pool: &Pool,
    connection: &lapin::Connection,
    config: &RelayConfig,
    counters: &RelayCounters,
    shutdown: &CancellationToken,
) -> Option<lapin::Error> {
    let mut channel = match ConfirmChannel::open(connection).await {
        Ok(channel) => channel,
        Err(error) => return Some(error),
    };
    // Counted at most this often: a count on the unsent rows' index.
    let mut counted: Option<tokio::time::Instant> = None;
    let database_waits = || crate::backoff::forever(Duration::from_secs(5)).build();
    let mut database_pause = database_waits();
    let mut pending: Option<Sending> = None;
    loop {
        if shutdown.is_cancelled() {
            if let Some(sending) = pending.take() {
                // Its confirms come, or it goes again; either way it ends.
                let _ = sending.settle(counters).await;
            }
            // Closed before it is dropped: lapin closes a dropped channel
            // itself, later, and fails the connection if it is closing by
            // then.
            close_channel(channel.channel()).await;
            return None;
        }
        let next = send(pool, &channel, config).await;
        let mut turn = Turn::default();
        if let Some(sending) = pending.take() {
            turn.record(sending.settle(counters).await);
        }
        let idle = match next {
            Ok(Some(sending)) => {
                pending = Some(sending);
                false
            }
            Ok(None) => true,
            Err(error) => {
                turn.record(Err(error));
                false
            }
        };
        if turn.reopen || turn.lost.is_some() {
            // The batch sent after it on the same channel ends with it,
            // before the lane opens another channel or returns.
            if let Some(sending) = pending.take() {
                turn.record(sending.settle(counters).await);
            }
            if let Some(error) = turn.lost {
                return Some(error);
            }
            match ConfirmChannel::open(connection).await {
                Ok(fresh) => channel = fresh,
                Err(error) => return Some(error),
            }
        }
        if turn.done {
            database_pause = database_waits();
        }
        // A batch settled this turn may have held what the next could not
        // take (ordered messages, one transaction at a time): look again
        // before calling the outbox empty.
        let idle = idle && !turn.done;
        if let Some(error) = turn.unreachable {
            let wait = database_pause.next().unwrap_or(Duration::from_secs(5));
            warn!(%error, "the relay cannot reach the outbox: trying again in {:.1}s", wait.as_secs_f64());
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.cancelled() => {}
            }
        } else if idle && pending.is_none() {
            database_pause = database_waits();
            if counted.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                counted = Some(tokio::time::Instant::now());
                count_unsent(pool, counters).await;
            }
            if config.until_empty {
                close_channel(channel.channel()).await;
                return None;
            }
            tokio::select! {
                () = tokio::time::sleep(config.idle_wait) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }
}

/// What the batches a lane settled in one turn call for.
#[derive(Default)]
struct Turn {
    /// One was published, and removed or marked.
    done: bool,
    /// The broker closed the channel over a message it will not take.
    reopen: bool,
    /// The broker connection failed.
    lost: Option<lapin::Error>,
    /// The database failed.
    unreachable: Option<StoreError>,
}

impl Turn {
    fn record(&mut self, outcome: Result<Batch, StoreError>) {
        match outcome {
            Ok(Batch::Done) => self.done = true,
            Ok(Batch::ChannelRefused) => self.reopen = true,
            Ok(Batch::Lost(error)) => {
                self.lost.get_or_insert(error);
            }
            Err(error) => {
                self.unreachable.get_or_insert(error);
            }
        }
    }
}

/// A batch published, its confirms on their way, its rows locked by the
/// transaction its connection holds open.
struct Sending {
    transaction: Open,
    due: Vec<Unsent>,
    confirms: Vec<PublisherConfirm>,
    /// Why a send failed (the channel is gone), if one did.
    unsendable: Option<lapin::Error>,
}

/// A pooled connection inside a transaction. Dropped before it commits, it
/// is taken out of the pool rather than returned to it: its connection
/// closes, the server rolls the transaction back, and no other user of the
/// pool finds it open.
struct Open(Option<deadpool_postgres::Object>);

impl Open {
    async fn begin(pool: &Pool) -> Result<Self, StoreError> {
        let client = pool.get().await?;
        client.batch_execute("BEGIN").await?;
        Ok(Self(Some(client)))
    }

    fn client(&self) -> &deadpool_postgres::Object {
        match &self.0 {
            Some(client) => client,
            None => unreachable!("only a commit or a drop ends a transaction"),
        }
    }

    /// Commits; the connection goes back to the pool.
    async fn commit(mut self) -> Result<(), tokio_postgres::Error> {
        self.client().batch_execute("COMMIT").await?;
        self.0 = None;
        Ok(())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

/// Opens a transaction, takes what is due, and publishes it; `None` when
/// nothing is due.
async fn send(
    pool: &Pool,
    channel: &ConfirmChannel,
    config: &RelayConfig,
) -> Result<Option<Sending>, StoreError> {
    let transaction = Open::begin(pool).await?;
    let due = outbox::take(transaction.client(), config.batch_size).await?;
    if due.is_empty() {
        transaction.commit().await?;
        return Ok(None);
    }
    // All sent at once, before any confirm is awaited: one round trip per
    // batch, in a few writes. A send that fails ends the sending: the
    // channel is gone, and the confirms of what went before say why.
    let messages: Vec<Outgoing> = due
        .iter()
        .filter(|message| !message.held)
        .map(outgoing)
        .collect();
    let mut confirms = Vec::with_capacity(due.len());
    let mut unsendable = None;
    for send in channel.send_all(&messages).await {
        match send {
            Ok(confirm) => confirms.push(confirm),
            Err(error) => {
                unsendable = Some(error);
                break;
            }
        }
    }
    Ok(Some(Sending {
        transaction,
        due,
        confirms,
        unsendable,
    }))
}

impl Sending {
    /// Waits for the batch's confirms, removes what was confirmed, marks
    /// what was refused, and commits.
    async fn settle(self, counters: &RelayCounters) -> Result<Batch, StoreError> {
        let Sending {
            transaction,
            due,
            confirms,
            unsendable,
        } = self;
        // What each message came to: confirmed, refused (why, and when to
        // try again), or neither (its channel closed first).
        let mut outcomes: Vec<Option<Result<(), (String, Duration)>>> =
            Vec::with_capacity(due.len());
        // Why the broker closed the channel, when it did so over a message it
        // will not take (`NOT_FOUND - no exchange 'x'`): every message of the
        // batch not confirmed by then fails with it, but only those to the
        // exchange it names are to blame; the others go again.
        let mut closed_over = unsendable.as_ref().and_then(crate::broker::refusal);
        let mut confirms = confirms.into_iter();
        for message in &due {
            if message.held {
                // Not sent: it waits on its own, behind its key's earlier one.
                outcomes.push(None);
                continue;
            }
            // The rest was not sent: the channel is gone.
            let Some(confirm) = confirms.next() else {
                break;
            };
            let refusal = match settle(confirm).await {
                Ok(Ok(())) => {
                    outcomes.push(Some(Ok(())));
                    continue;
                }
                Ok(Err(refusal)) => refusal.to_string(),
                Err(error) => match crate::broker::refusal(&error) {
                    Some(reason) => {
                        let blamed = reason.contains(&format!("'{}'", message.exchange));
                        closed_over = Some(reason.clone());
                        if !blamed {
                            outcomes.push(None);
                            continue;
                        }
                        reason
                    }
                    // Dropped, its transaction rolls back: all of it goes
                    // again.
                    None => return Ok(Batch::Lost(error)),
                },
            };
            let wait = refused_wait(message.attempts);
            warn!(
                message_id = %message.message_id,
                exchange = %message.exchange,
                routing_key = %message.routing_key,
                attempts = message.attempts + 1,
                %refusal,
                "the broker refused an outgoing message: it stays in the outbox, tried again in {}s",
                wait.as_secs()
            );
            outcomes.push(Some(Err((refusal, wait))));
        }
        // A channel that closed for another reason: what it confirmed is
        // sent, the rest goes again.
        let lost = match (&closed_over, unsendable) {
            (None, Some(error)) => Some(error),
            _ => None,
        };
        let settled = Settled::of(&due, outcomes);
        settled.write(transaction.client()).await?;
        // Failing here, the batch was published but not removed: it goes
        // again, under the same message ids.
        transaction.commit().await?;
        counters.sent.inc_by(settled.sent);
        counters.refused.inc_by(settled.refused);
        Ok(match lost {
            Some(error) => Batch::Lost(error),
            None if closed_over.is_some() => Batch::ChannelRefused,
            None => Batch::Done,
        })
    }
}

/// What a batch's confirms come to in the outbox.
#[derive(Debug, Default)]
struct Settled<'m> {
    /// Rows of `mq_outbox` confirmed: removed.
    removed: Vec<i64>,
    /// Rows of `mq_outbox` refused: counted, why, and when to try again.
    refused_rows: (Vec<i64>, Vec<String>, Vec<Duration>),
    /// Rows of `mq_outbox_batch` taken: removed, and those of their
    /// messages not confirmed put back on their own.
    batches: Vec<i64>,
    put_back: Vec<outbox::PutBack<'m>>,
    sent: u64,
    refused: u64,
}

impl<'m> Settled<'m> {
    /// `outcomes`, message by message of `due` (missing at the end: not
    /// sent, as `None`).
    fn of(due: &'m [Unsent], outcomes: Vec<Option<Result<(), (String, Duration)>>>) -> Self {
        let mut settled = Self::default();
        let outcomes = outcomes.into_iter().chain(std::iter::repeat_with(|| None));
        for (message, outcome) in due.iter().zip(outcomes) {
            match &outcome {
                Some(Ok(())) => settled.sent += 1,
                Some(Err(_)) => settled.refused += 1,
                None => {}
            }
            match (message.taken, outcome) {
                (Taken::Row(id), Some(Ok(()))) => settled.removed.push(id),
                (Taken::Row(id), Some(Err((reason, wait)))) => {
                    let (ids, reasons, waits) = &mut settled.refused_rows;
                    ids.push(id);
                    reasons.push(reason);
                    waits.push(wait);
                }
                // Left as it is, unsent.
                (Taken::Row(_), None) => {}
                (Taken::Batch(id), outcome) => {
                    if settled.batches.last() != Some(&id) {
                        settled.batches.push(id);
                    }
                    // Sent, it goes with its row; refused or left over,
                    // it waits on its own.
                    if !matches!(outcome, Some(Ok(()))) {
                        settled.put_back.push(outbox::PutBack {
                            message,
                            refused: outcome.and_then(Result::err),
                        });
                    }
                }
            }
        }
        settled
    }

    /// Writes it, in the relay's transaction.
    async fn write(
        &self,
        client: &impl deadpool_postgres::GenericClient,
    ) -> Result<(), StoreError> {
        outbox::remove_sent(client, &self.removed).await?;
        let (ids, reasons, waits) = &self.refused_rows;
        if !ids.is_empty() {
            outbox::mark_refused(client, ids, reasons, waits).await?;
        }
        outbox::put_back(client, &self.batches, &self.put_back).await?;
        Ok(())
    }
}

/// Sets the unsent gauge; a database that does not answer leaves it as it was.
async fn count_unsent(pool: &Pool, counters: &RelayCounters) {
    let Ok(client) = pool.get().await else {
        return;
    };
    if let Ok(unsent) = outbox::unsent(&client).await {
        counters.unsent.set(unsent);
    }
}

/// The message as published: persistent, with its idempotency key as the
/// `message_id` and in an [`IDEMPOTENCY_KEY`] header.
#[doc(hidden)]
pub fn outgoing(message: &Unsent) -> Outgoing {
    let mut headers = FieldTable::default();
    for (name, value) in &message.headers {
        headers.insert(
            name.as_str().into(),
            AMQPValue::LongString(value.as_str().into()),
        );
    }
    headers.insert(
        IDEMPOTENCY_KEY.into(),
        AMQPValue::LongString(message.message_id.as_str().into()),
    );
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_app_id("idem".into())
        .with_message_id(message.message_id.as_str().into())
        .with_headers(headers);
    if let Some(content_type) = &message.content_type {
        properties = properties.with_content_type(content_type.as_str().into());
    }
    Outgoing {
        exchange: message.exchange.clone(),
        routing_key: message.routing_key.clone(),
        body: message.body.clone(),
        properties,
    }
}

/// How long a message refused `attempts` times before waits: 1 s, doubling,
/// at most [`RelayConfig::MAX_REFUSED_WAIT`].
fn refused_wait(attempts: i32) -> Duration {
    let doublings = u32::try_from(attempts.clamp(0, 16)).unwrap_or(16);
    (Duration::from_secs(1) * 2u32.pow(doublings)).min(RelayConfig::MAX_REFUSED_WAIT)
}

/// Logs what a relay did, once it stopped.
#[doc(hidden)]
pub fn log_report(report: &RelayReport) {
    info!(
        sent = report.sent,
        refused = report.refused,
        "relay stopped: sent {}, refused {}",
        report.sent,
        report.refused
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_message_waits_longer_each_time_up_to_five_minutes() {
        assert_eq!(refused_wait(0), Duration::from_secs(1));
        assert_eq!(refused_wait(1), Duration::from_secs(2));
        assert_eq!(refused_wait(5), Duration::from_secs(32));
        assert_eq!(refused_wait(9), Duration::from_secs(300));
        assert_eq!(refused_wait(i32::MAX), Duration::from_secs(300));
    }
}
