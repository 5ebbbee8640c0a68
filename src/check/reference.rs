//! What the handler's effect should be, found without the worker: the
//! events applied one at a time, each in a transaction of its own (the
//! reference); and, batch by batch, [`Handler::apply`] on a whole batch
//! beside the same events applied one at a time on the same starting state
//! (batch equivalence).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use deadpool_postgres::Transaction;

use super::scratch::Scratch;
use super::state::{Digest, Message, State, Tables};
use super::{CheckError, Event};
use crate::caught;
use crate::handler::outbox::Entry;
use crate::handler::{FailureKind, Handler, HandlerError, Outbox, message_id};
use crate::store::{Applier, Store, describe};

/// Which events a run applied, and which it gave up on, with why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Fates {
    pub(crate) applied: BTreeSet<String>,
    pub(crate) dead: BTreeMap<String, String>,
}

/// How often an infrastructure failure is tried again in a reference
/// before the check gives up: no fault is injected there, so one that
/// lasts is the database's.
const INFRASTRUCTURE_TRIES: usize = 5;

/// Applies `events` in the order given, each in a transaction of idem's
/// own (its consume record, the handler's effect, its outbox messages),
/// on `scratch`; an event whose transaction fails is given up, as the
/// worker would once it has used up its attempts.
pub(crate) async fn one_at_a_time<H: Handler>(
    scratch: &Scratch,
    handler: H,
    consumer_group: &str,
    events: &[&Event<H::Event>],
) -> Result<Fates, CheckError> {
    let applier = Applier::new(
        Store::new(scratch.pool.clone(), consumer_group),
        Arc::new(handler),
    )
    .map_err(|error| CheckError::Usage(error.to_string()))?;
    let mut fates = Fates::default();
    for event in events {
        let mut tries = 0;
        let outcome = loop {
            tries += 1;
            match applier.apply(&[&event.event]).await {
                Err(failure)
                    if failure.kind == FailureKind::Infrastructure
                        && tries < INFRASTRUCTURE_TRIES =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(100 * tries as u64)).await;
                }
                outcome => break outcome,
            }
        };
        match outcome {
            Ok(mut claimed) => {
                if claimed.take(&event.id) {
                    fates.applied.insert(event.id.clone());
                }
            }
            Err(failure) if failure.kind == FailureKind::Infrastructure => {
                return Err(CheckError::Failed(
                    format!("applying {} one at a time: {}", event.id, failure.reason).into(),
                ));
            }
            Err(failure) => {
                fates.dead.insert(event.id.clone(), failure.reason);
            }
        }
    }
    Ok(fates)
}

/// A batch whose effect, applied whole, is not that of its events applied
/// one at a time.
#[derive(Debug, Clone)]
pub(crate) struct Unequal {
    /// The batch's events, in the order `apply` got them.
    pub(crate) batch: Vec<String>,
    /// What differs.
    pub(crate) how: String,
    /// The rows, when they differ: the events one at a time (expected),
    /// then the batch whole (found).
    pub(crate) rows: Option<(State, State)>,
}

/// What batch equivalence found: how many batches it tried, those that
/// differ, and the fates of the events one at a time.
#[derive(Debug, Default)]
pub(crate) struct Equivalence {
    pub(crate) batches: usize,
    pub(crate) unequal: Vec<Unequal>,
    pub(crate) fates: Fates,
}

/// Cuts `events` (distinct, in the file's order) into batches of `size`,
/// the first `offset` long when `offset` is not 0, and applies each on
/// `scratch` twice from the same starting state: whole, as one call of
/// `apply` with the events in event-id order as the worker passes them, and
/// one at a time in that order, each in a savepoint of its own (a failure
/// rolls back that event alone, as the worker's one-by-one retry of a
/// failed batch does). Keeps the one-at-a-time state and goes on to the
/// next batch.
///
/// A batch that fails whole is no difference (the worker then applies its
/// events one by one); one that applies whole where an event fails alone,
/// or ends in other rows or messages, is.
pub(crate) async fn batch_equivalence<H: Handler>(
    scratch: &Scratch,
    handler: &H,
    consumer_group: &str,
    tables: &Tables,
    events: &[&Event<H::Event>],
    (size, offset): (usize, usize),
) -> Result<Equivalence, CheckError> {
    let mut found = Equivalence::default();
    let mut client = scratch
        .pool
        .get()
        .await
        .map_err(|error| CheckError::Failed(error.into()))?;
    let on = Batch {
        handler,
        tables,
        consumer_group,
    };
    let mut start = 0;
    while start < events.len() {
        let end = if start == 0 && offset > 0 {
            offset
        } else {
            start + size
        }
        .min(events.len());
        let mut batch: Vec<&Event<H::Event>> = events[start..end].to_vec();
        start = end;
        batch.sort_by(|a, b| a.id.cmp(&b.id));
        found.batches += 1;
        let mut tx = client.transaction().await.map_err(database)?;
        let whole = on.whole(&mut tx, &batch, Look::Digest).await?;
        let mut singles = tx.savepoint("singles").await.map_err(database)?;
        let mut alone = on.one_by_one(&mut singles, &batch).await?;
        let how = match whole {
            Some((sent, Seen::Digest(digest))) => {
                let seen = on.tables.digest(&singles).await.map_err(database)?;
                differs(&alone.failed, (&digest, &sent), (&seen, &alone.sent))
            }
            _ => None,
        };
        match how {
            None => singles.commit().await.map_err(database)?,
            Some(how) => {
                // The rows, for the report: the events alone, then whole,
                // then alone again to go on from.
                let expected = on.tables.state(&singles).await?;
                singles.rollback().await.map_err(database)?;
                let rows = match on.whole(&mut tx, &batch, Look::State).await? {
                    Some((_, Seen::State(whole))) => Some((expected, whole)),
                    _ => None,
                };
                let mut singles = tx.savepoint("singles").await.map_err(database)?;
                // What the events one at a time do now is where the next
                // batch starts from.
                alone = on.one_by_one(&mut singles, &batch).await?;
                singles.commit().await.map_err(database)?;
                found.unequal.push(Unequal {
                    batch: batch.iter().map(|event| event.id.clone()).collect(),
                    how,
                    rows,
                });
            }
        }
        for event in &batch {
            match alone.failed.iter().find(|(id, _)| *id == event.id) {
                Some((_, error)) => {
                    found.fates.dead.insert(event.id.clone(), error.clone());
                }
                None => {
                    found.fates.applied.insert(event.id.clone());
                }
            }
        }
        tx.commit().await.map_err(database)?;
    }
    Ok(found)
}

fn database(error: tokio_postgres::Error) -> CheckError {
    CheckError::database("batch equivalence", &error)
}

/// Outgoing messages by idempotency key, as compared.
type Sent = BTreeMap<String, serde_json::Value>;

/// What is looked at after a batch applied whole.
#[derive(Debug, Clone, Copy)]
enum Look {
    Digest,
    State,
}

/// What was seen.
enum Seen {
    Digest(Digest),
    State(State),
}

/// The messages a batch's events sent one at a time, and those that
/// failed, with why.
struct Alone {
    sent: Sent,
    failed: Vec<(String, String)>,
}

/// What batches are applied with.
struct Batch<'a, H> {
    handler: &'a H,
    tables: &'a Tables,
    consumer_group: &'a str,
}

impl<H: Handler> Batch<'_, H> {
    /// Applies `batch` whole in a savepoint of `tx`, looks, and rolls it
    /// back; what it sent and what was seen, unless it failed.
    async fn whole(
        &self,
        tx: &mut Transaction<'_>,
        batch: &[&Event<H::Event>],
        look: Look,
    ) -> Result<Option<(Sent, Seen)>, CheckError> {
        let savepoint = tx.savepoint("whole").await.map_err(database)?;
        let seen = match apply(self.handler, &savepoint, batch, self.consumer_group).await {
            Ok(sent) => Some((
                sent,
                match look {
                    Look::Digest => {
                        Seen::Digest(self.tables.digest(&savepoint).await.map_err(database)?)
                    }
                    Look::State => Seen::State(self.tables.state(&savepoint).await?),
                },
            )),
            Err(_) => None,
        };
        savepoint.rollback().await.map_err(database)?;
        Ok(seen)
    }

    /// Applies `batch` one event at a time in `tx`, each in a savepoint of
    /// its own that a failure rolls back.
    async fn one_by_one(
        &self,
        tx: &mut Transaction<'_>,
        batch: &[&Event<H::Event>],
    ) -> Result<Alone, CheckError> {
        let mut alone = Alone {
            sent: Sent::new(),
            failed: Vec::new(),
        };
        for event in batch {
            let savepoint = tx.savepoint("one").await.map_err(database)?;
            match apply(self.handler, &savepoint, &[*event], self.consumer_group).await {
                Ok(sent) => {
                    savepoint.commit().await.map_err(database)?;
                    alone.sent.extend(sent);
                }
                Err(error) => {
                    savepoint.rollback().await.map_err(database)?;
                    alone.failed.push((event.id.clone(), error));
                }
            }
        }
        Ok(alone)
    }
}

/// Why a batch that applied whole is not its events one at a time, if it
/// is not.
fn differs(
    failed: &[(String, String)],
    whole: (&Digest, &Sent),
    alone: (&Digest, &Sent),
) -> Option<String> {
    if let Some((event, error)) = failed.first() {
        let more = match failed.len() {
            1 => String::new(),
            n => format!(" (and {} more)", n - 1),
        };
        return Some(format!(
            "the batch applies whole, but {event} fails when its events are applied one at a time: {error}{more}"
        ));
    }
    if whole.0 != alone.0 {
        return Some(
            "the batch applied whole leaves other rows than its events applied one at a time"
                .into(),
        );
    }
    if whole.1 != alone.1 {
        return Some(
            "the batch applied whole sends other messages than its events applied one at a time"
                .into(),
        );
    }
    None
}

/// `handler.apply` of `events` (sorted, distinct) in `tx`, and the messages
/// they send; why not, when it fails (or panics, or leaves the transaction
/// aborted).
async fn apply<H: Handler>(
    handler: &H,
    tx: &Transaction<'_>,
    events: &[&Event<H::Event>],
    consumer_group: &str,
) -> Result<Sent, String> {
    let ids: Vec<&str> = events.iter().map(|event| event.id.as_str()).collect();
    let decoded: Vec<&H::Event> = events.iter().map(|event| &event.event).collect();
    let mut outbox = Outbox::new(
        H::SENDS_MESSAGES,
        &ids,
        |place| handler.ordering_key(decoded[place]),
        |place| handler.outgoing(decoded[place]),
    );
    let applied = caught::future(handler.apply(tx, &decoded, &mut outbox))
        .await
        .map_err(|panic| format!("apply {panic}"))?;
    applied.map_err(|error| match error {
        HandlerError::Database(error) => describe(&error),
        other => other.to_string(),
    })?;
    // Written as idem writes them; and a handler that swallowed an error
    // left the transaction aborted, which this statement finds.
    let messages: Vec<_> = outbox.into_messages().collect();
    let written = messages
        .iter()
        .map(|entry| Entry {
            message: entry.message.clone(),
            ..*entry
        })
        .collect();
    crate::store::outbox::write(tx, consumer_group, written)
        .await
        .and(tx.execute("SELECT 1", &[]).await)
        .map_err(|error| {
            format!(
                "the transaction is aborted after apply returned: {}",
                describe(&error)
            )
        })?;
    Ok(messages
        .into_iter()
        .map(
            |Entry {
                 event_id,
                 index,
                 message,
                 ..
             }| {
                let key = message_id(consumer_group, event_id, index).to_string();
                let message = Message {
                    exchange: message.exchange,
                    routing_key: message.routing_key,
                    content_type: message.content_type,
                    headers: message.headers,
                    body: message.body,
                };
                (key, message.value())
            },
        )
        .collect())
}
