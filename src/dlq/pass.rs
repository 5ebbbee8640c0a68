//! A pass over the dead-letter queue: the letters taken in chunks, looked
//! up in the ledger and the consume records, matched, and listed, replayed,
//! discarded or indexed; what a pass holds goes to the tail.
//!
//! Over 700 lines: the steps of a pass (taking a chunk, looking it up,
//! replaying, discarding, indexing, moving to the tail) share the pass's
//! state and its rules for acking, and read best as one `impl`.

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::types::{AMQPValue, DeliveryTag};
use lapin::{BasicProperties, Channel};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{
    Action, DlqConfig, Entry, Pacer, Report, Synced, Taking, await_released, discarded, send_all,
};
use crate::broker::death::{Death, REPLACES_HEADER, replay_headers, replays};
use crate::broker::{
    ConfirmChannel, Nacks, Outgoing, Refusal, close_channel, ready_messages, settle,
};
use crate::handler::Handler;
use crate::progress::Progress;
use crate::store::Filter;
use crate::store::dead_letters::{body_key, event_key};
use crate::store::{DeadLetter, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub(super) enum PassError {
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    #[error(transparent)]
    Ledger(#[from] StoreError),
    #[error(transparent)]
    File(anyhow::Error),
}

/// How long a command waits for what it gave back to be ready again.
pub(super) const GIVE_BACK_WAIT: Duration = Duration::from_secs(5);

/// Most dead letters taken before they are acted on: one ledger statement,
/// one file sync, one wait for confirms per chunk.
pub(super) const CHUNK: usize = 128;

/// Most dead letters a sync indexes in one statement.
pub(super) const SYNC_CHUNK: usize = 1000;

/// Most letters a pass holds unacked while it goes on taking more: a
/// quorum queue sends a consumer without a prefetch limit no more than 2,000
/// unacked messages, and a sync chunk adds up to [`SYNC_CHUNK`] on top.
pub(super) const HOLD: usize = 500;

/// The reason shown for a letter without a record of its death (`x-death`
/// or idem's).
pub(super) const NO_DEATH: &str = "(no record of its death)";

/// A dead letter taken from the queue, not acked yet.
pub(super) struct Letter {
    pub(super) tag: DeliveryTag,
    pub(super) delivery: Delivery,
    pub(super) entry: Entry,
    /// Why the handler cannot decode the body, in its words alone (the
    /// entry's `invalid` adds how the body starts): what the index keeps.
    pub(super) decode_error: Option<String>,
}

/// A letter taken from the queue that the pass leaves there: given back at
/// the end, or moved to the tail of the queue when too many are held.
pub(super) struct Kept {
    pub(super) tag: DeliveryTag,
    pub(super) body: Vec<u8>,
    pub(super) properties: BasicProperties,
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
pub(super) struct Pass<'a, H> {
    pub(super) config: &'a DlqConfig,
    pub(super) action: &'a Action,
    pub(super) handler: &'a H,
    pub(super) progress: &'a Progress,
    pub(super) store: &'a Store,
    pub(super) discards: Option<&'a mut std::fs::File>,
    pub(super) report: &'a mut Report,
    pub(super) nacks: &'a mut Nacks,
    /// The keys of the letters this run replayed or discarded, and acked:
    /// a copy of one back in the queue (the lost connection took its ack
    /// with it) is acked, not acted on again nor left.
    pub(super) acted: &'a mut std::collections::HashSet<String>,
    /// Letters taken but left in the queue, at most [`HOLD`] of them
    /// between chunks.
    pub(super) held: Vec<Kept>,
    /// How many letters match, by the dead-letter index, when it agrees
    /// with the queue: the pass stops once it found them.
    pub(super) indexed_matches: Option<usize>,
    /// Letters this pass found matching.
    pub(super) matched: usize,
    /// While a pass consumes the dead-letter queue, how many consumers the
    /// queue had besides: once a pass lost its connection, the next waits
    /// for the broker to count no more (it gave back what the lost one
    /// held).
    pub(super) consuming: &'a mut Option<u32>,
}

/// What a pass holds open while it runs.
pub(super) struct Open {
    /// The channel the letters are taken on, and acked or given back.
    getter: Channel,
    /// Where the letters come from.
    taking: Taking,
    /// Replays and moves to the tail go on one confirm channel, opened for
    /// the first of either.
    publisher: Option<ConfirmChannel>,
    /// The replay rate, if any.
    pacer: Option<Pacer>,
    /// When a sync started: it indexes what it finds, and removes what was
    /// indexed before that and not found.
    sync_started: Option<SystemTime>,
}

/// Whether a pass goes on taking letters after a chunk.
enum Next {
    More,
    Done,
}

impl Action {
    /// Letters taken before they are acted on.
    fn chunk_size(&self) -> usize {
        match self {
            Action::Sync => SYNC_CHUNK,
            _ => CHUNK,
        }
    }

    /// Whether the action acks the letters it acts on (the queue must have
    /// applied every ack before the channel closes).
    fn acks(&self) -> bool {
        matches!(
            self,
            Action::Replay { .. } | Action::ReplayEdited { .. } | Action::Discard { .. }
        )
    }
}

impl<H: Handler> Pass<'_, H> {
    /// Takes the letters in chunks and acts on each chunk, then gives back
    /// what it holds.
    pub(super) async fn run(
        mut self,
        connection: &lapin::Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
        let mut open = self.open(connection).await?;
        while !shutdown.is_cancelled() && self.wanted() != Some(0) && !self.found_all() {
            if let Next::Done = self.chunk(&mut open, connection, shutdown).await? {
                break;
            }
        }
        self.finish(open, connection, shutdown).await
    }

    /// Opens the pass: waits for what a lost connection held to be back,
    /// starts taking from the queue, and resets the report.
    async fn open(&mut self, connection: &lapin::Connection) -> Result<Open, PassError> {
        let getter = connection.create_channel().await?;
        if let Some(others) = *self.consuming {
            await_released(
                &getter,
                self.config.dead_letter_queue(),
                others,
                self.config.target.patience,
            )
            .await?;
            *self.consuming = None;
        }
        let publisher = match self.action {
            Action::Replay { .. } | Action::ReplayEdited { .. } => {
                Some(ConfirmChannel::open(connection).await?)
            }
            _ => None,
        };
        // Each pass looks again: what an earlier one held, or acted on
        // without its ack reaching the broker, is back.
        self.report.seen = 0;
        self.report.listed.clear();
        self.report.failed.clear();
        self.report.skipped_invalid = 0;
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
        let taking =
            Taking::start(&getter, self.config.dead_letter_queue(), self.consuming).await?;
        self.progress.set_total(taking.left as u64);
        self.report.in_queue = taking.left;
        self.report.limited = false;
        self.report.not_looked_at = 0;
        self.indexed_matches = self.indexed_matches(taking.left).await;
        Ok(Open {
            getter,
            taking,
            publisher,
            pacer: self.action.pacer(),
            sync_started,
        })
    }

    /// Takes one chunk of letters and acts on those that match; moves what
    /// the pass holds to the tail when it holds too many.
    async fn chunk(
        &mut self,
        open: &mut Open,
        connection: &lapin::Connection,
        shutdown: &CancellationToken,
    ) -> Result<Next, PassError> {
        let mut chunk: Vec<Letter> = open
            .taking
            .next_chunk(&open.getter, self.action.chunk_size())
            .await?
            .into_iter()
            .map(|delivery| self.letter(delivery))
            .collect();
        if chunk.is_empty() {
            return Ok(Next::Done);
        }
        self.report.seen += chunk.len();
        self.progress.inc(chunk.len() as u64);
        match open.sync_started {
            // Indexed whatever the filter; nothing moves.
            Some(started) => self.index(chunk, started).await?,
            None => {
                self.look_up(&mut chunk).await;
                let chunk = self.ack_acted(&open.getter, chunk).await?;
                let matched = self.matching(chunk);
                self.act(open, connection, matched, shutdown).await?;
            }
        }
        if open.taking.left == 0 {
            return Ok(Next::Done);
        }
        if self.held.len() >= HOLD {
            let publisher = match &mut open.publisher {
                Some(publisher) => publisher,
                None => open
                    .publisher
                    .insert(ConfirmChannel::open(connection).await?),
            };
            self.move_to_tail(&open.getter, connection, publisher, shutdown)
                .await?;
            if self.held.len() >= HOLD {
                return Ok(Next::Done);
            }
        }
        Ok(Next::More)
    }

    /// Does the pass's action to the letters of a chunk that match.
    async fn act(
        &mut self,
        open: &mut Open,
        connection: &lapin::Connection,
        matched: Vec<Letter>,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
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
                let (mut replay, invalid): (Vec<_>, Vec<_>) = matched
                    .into_iter()
                    .partition(|letter| letter.entry.event_id.is_some());
                if *include_invalid {
                    replay.extend(invalid);
                } else {
                    self.report.skipped_invalid += invalid.len();
                    self.held
                        .extend(invalid.into_iter().map(|letter| letter.delivery.into()));
                }
                if let Some(publisher) = &mut open.publisher {
                    self.replay(
                        &open.getter,
                        connection,
                        publisher,
                        replay,
                        &mut open.pacer,
                        shutdown,
                    )
                    .await?;
                }
            }
            Action::ReplayEdited { .. } => {
                // An invalid body is what an edit mends, as well as a
                // valid one.
                if let Some(publisher) = &mut open.publisher {
                    self.replay(
                        &open.getter,
                        connection,
                        publisher,
                        matched,
                        &mut open.pacer,
                        shutdown,
                    )
                    .await?;
                }
            }
            Action::Discard { .. } => self.discard(&open.getter, matched).await?,
            Action::Sync => {}
        }
        Ok(())
    }

    /// Says why the pass stopped, ends a sync, and gives back what the
    /// pass holds, once the queue applied its acks.
    async fn finish(
        mut self,
        open: Open,
        connection: &lapin::Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
        let Open {
            getter,
            taking,
            publisher,
            sync_started,
            ..
        } = open;
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
        if self.action.acks() {
            // A quorum queue loses acks sent just before their channel
            // closes (the close returns what the queue has not settled
            // yet; seen on 3.10 and 4.0): a get on the same channel is
            // answered only once the queue has applied every ack before it.
            if let Some(message) = getter
                .basic_get(
                    self.config.dead_letter_queue().into(),
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
    pub(super) async fn await_given_back(
        &self,
        connection: &lapin::Connection,
    ) -> Result<(), PassError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let given_back = u32::try_from(self.held.len()).unwrap_or(u32::MAX);
        let channel = connection.create_channel().await?;
        let deadline = Instant::now() + GIVE_BACK_WAIT;
        while ready_messages(&channel, self.config.dead_letter_queue()).await? < given_back
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
    pub(super) async fn indexed_matches(&self, in_queue: usize) -> Option<usize> {
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
        let summary = self.store.dead_letter_summary(filter).await.ok()?;
        usize::try_from(summary.letters).ok()
    }

    /// True once the pass found as many matching letters as the index
    /// counts.
    pub(super) fn found_all(&self) -> bool {
        self.indexed_matches.is_some_and(|n| self.matched >= n)
    }

    /// How many more may be acted on; `None` without a limit.
    pub(super) fn wanted(&self) -> Option<usize> {
        let acted = self.report.listed.len()
            + self.report.replayed.len()
            + self.report.discarded.len()
            + self.report.skipped_invalid
            + self.report.failed.len();
        self.config.limit.map(|limit| limit.saturating_sub(acted))
    }

    pub(super) fn letter(&self, delivery: Delivery) -> Letter {
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
                group: None,
                applied: None,
            },
            delivery,
            decode_error,
        }
    }

    /// Fills in what the ledger and the consume records know of `chunk`'s
    /// events: one statement each for the chunk. When the database cannot
    /// be read, says so once and goes on without.
    pub(super) async fn look_up(&mut self, chunk: &mut [Letter]) {
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
            let filter = &self.config.filter;
            let indexed = if filter.error.is_some() || filter.group.is_some() {
                self.store.dead_letters_indexed(&keys).await?
            } else {
                HashMap::new()
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
            if let Some(indexed) = indexed.remove(&letter.entry.key) {
                letter.entry.indexed_error = indexed.error;
                letter.entry.group = Some(indexed.group);
            }
        }
    }

    /// The letters that match the filter, up to the limit; the others are
    /// held.
    pub(super) fn matching(&mut self, chunk: Vec<Letter>) -> Vec<Letter> {
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
    pub(super) async fn replay(
        &mut self,
        getter: &Channel,
        connection: &lapin::Connection,
        publisher: &mut ConfirmChannel,
        letters: Vec<Letter>,
        pacer: &mut Option<Pacer>,
        shutdown: &CancellationToken,
    ) -> Result<(), PassError> {
        // A replay starts a fresh budget of attempts: the reset goes first.
        let edited = match self.action {
            Action::ReplayEdited { body, event_id } => Some((body, event_id.as_str())),
            _ => None,
        };
        let ids: Vec<&str> = letters
            .iter()
            .filter_map(|letter| letter.entry.event_id.as_deref())
            .chain(edited.map(|(_, event_id)| event_id))
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
            let mut headers = replay_headers(original.headers().as_ref());
            let body = match edited {
                Some((body, _)) => {
                    headers.insert(
                        REPLACES_HEADER.into(),
                        AMQPValue::LongString(letter.entry.key.as_str().into()),
                    );
                    body.clone()
                }
                None => letter.delivery.data,
            };
            let properties = original.clone().with_headers(headers);
            let message = Outgoing {
                // The default exchange routes by queue name: the replay goes
                // to the queue it died in, not to every queue bound for it.
                exchange: String::new(),
                routing_key: queue,
                body,
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
    pub(super) async fn send_confirmed<T>(
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
    pub(super) async fn move_to_tail(
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
                    routing_key: self.config.dead_letter_queue().to_owned(),
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
    pub(super) fn not_replayed(
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
    pub(super) async fn discard(
        &mut self,
        getter: &Channel,
        letters: Vec<Letter>,
    ) -> Result<(), PassError> {
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

    /// Acks the letters of `chunk` that this run replayed or discarded
    /// already (copies back after a lost connection: their replay was
    /// confirmed, or their line synced, but the ack was lost); the rest.
    async fn ack_acted(
        &mut self,
        getter: &Channel,
        chunk: Vec<Letter>,
    ) -> Result<Vec<Letter>, PassError> {
        if self.acted.is_empty() {
            return Ok(chunk);
        }
        let mut rest = Vec::with_capacity(chunk.len());
        for letter in chunk {
            if self.acted.contains(&letter.entry.key) {
                getter
                    .basic_ack(letter.tag, BasicAckOptions::default())
                    .await?;
                self.report.acked_again += 1;
            } else {
                rest.push(letter);
            }
        }
        Ok(rest)
    }

    /// Takes the letters of `keys`, acked, off the index. A failure leaves
    /// rows the next sync removes: it is reported, and the run goes on.
    pub(super) async fn taken(&mut self, keys: &[String]) {
        self.acted.extend(keys.iter().cloned());
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
    pub(super) async fn index(
        &mut self,
        chunk: Vec<Letter>,
        started: SystemTime,
    ) -> Result<(), PassError> {
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
                    body: Some(letter.delivery.data.clone()),
                    properties: Some(crate::broker::json::properties_json(
                        &letter.delivery.properties,
                    )),
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
        let group = self.group.is_none_or(|group| entry.group == Some(group));
        let key = self.keys.is_empty() || self.keys.contains(&entry.key);
        reason && event_id && error && older && newer && invalid && group && key
    }
}

/// Most characters of an invalid body shown in its place.
pub(super) const BODY_SHOWN: usize = 80;

/// Why `body` is invalid, and how it starts.
pub(super) fn described(invalid: &str, body: &[u8]) -> String {
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
pub(super) fn decoded_id(handler: &impl Handler, body: &[u8]) -> Result<String, String> {
    handler
        .decode(body)
        .and_then(|event| {
            let id = handler.event_id(&event);
            crate::handler::check_event_id(id).map(|()| id.to_owned())
        })
        .map_err(|invalid| invalid.to_string())
}
