//! The outbox's SQL: the rows a transaction writes for the messages its
//! events send on, and what a relay reads, removes once sent, and marks
//! when the broker refused them.

use std::time::Duration;

use deadpool_postgres::GenericClient;

use crate::handler::outbox::Entry;
use crate::handler::{Outbox, message_id};

/// The outbox rows of some events, column by column (what `unnest` takes):
/// `$1` the event ids they belong to, then message ids, exchanges, routing
/// keys, content types, headers (JSON), bodies and their events' ordering
/// keys.
#[derive(Debug, Default)]
pub(super) struct Rows {
    event_ids: Vec<String>,
    message_ids: Vec<String>,
    exchanges: Vec<String>,
    routing_keys: Vec<String>,
    content_types: Vec<Option<String>>,
    headers: Vec<String>,
    bodies: Vec<Vec<u8>>,
    ordering_keys: Vec<Option<String>>,
}

impl Rows {
    /// The rows of `outbox`'s messages, keyed in `group`.
    pub(super) fn of(group: &str, outbox: Outbox<'_>) -> Self {
        Self::of_messages(group, outbox.into_messages())
    }

    /// The rows of `messages`, keyed in `group`.
    fn of_messages<'e>(group: &str, messages: impl Iterator<Item = Entry<'e>>) -> Self {
        let mut rows = Self::default();
        // Each message carries the context of the span that sends it,
        // unless the handler gave one of its own.
        let mut context = None;
        for Entry {
            event_id,
            ordering_key,
            index,
            mut message,
        } in messages
        {
            let context = context.get_or_insert_with(crate::telemetry::trace::current);
            for (name, value) in context.iter() {
                message
                    .headers
                    .entry(name.clone())
                    .or_insert_with(|| value.clone());
            }
            rows.event_ids.push(event_id.to_owned());
            rows.message_ids
                .push(message_id(group, event_id, index).to_string());
            rows.exchanges.push(message.exchange);
            rows.routing_keys.push(message.routing_key);
            rows.content_types.push(message.content_type);
            // A map of strings always serializes.
            rows.headers
                .push(serde_json::to_string(&message.headers).unwrap_or_else(|_| "{}".into()));
            rows.bodies.push(message.body);
            rows.ordering_keys.push(ordering_key.map(str::to_owned));
        }
        rows
    }

    pub(super) fn is_empty(&self) -> bool {
        self.message_ids.is_empty()
    }

    /// The rows' parameters, in the order [`sent_step`] and
    /// [`insert_statement`] take them.
    pub(super) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 8] {
        [
            &self.event_ids,
            &self.message_ids,
            &self.exchanges,
            &self.routing_keys,
            &self.content_types,
            &self.headers,
            &self.bodies,
            &self.ordering_keys,
        ]
    }
}

/// The rows of `$n`…`$n+7` (see [`Rows`]), in the order given.
fn unnest(first: usize) -> String {
    let [a, b, c, d, e, f, g, h] = std::array::from_fn(|i| first + i);
    format!(
        "unnest(${a}::varchar[], ${b}::text[], ${c}::text[], ${d}::text[], ${e}::text[], \
         ${f}::text[], ${g}::bytea[], ${h}::text[]) WITH ORDINALITY \
         AS outgoing(event_id, message_id, exchange, routing_key, content_type, headers, body, \
         ordering_key, place)"
    )
}

/// The messages of `outgoing` (see [`unnest`]) as rows of
/// `mq_outbox_batch`, in their order: one of the ordered ones (with their
/// keys), one of the others; none when there are none.
fn batch_row(from: &str) -> String {
    format!(
        "INSERT INTO mq_outbox_batch \
             (message_ids, exchanges, routing_keys, content_types, headers, bodies, messages, \
              ordering_keys) \
         SELECT array_agg(outgoing.message_id::uuid ORDER BY outgoing.place), \
                array_agg(outgoing.exchange ORDER BY outgoing.place), \
                array_agg(outgoing.routing_key ORDER BY outgoing.place), \
                array_agg(outgoing.content_type ORDER BY outgoing.place), \
                array_agg(outgoing.headers ORDER BY outgoing.place), \
                array_agg(outgoing.body ORDER BY outgoing.place), count(*), \
                CASE WHEN bool_and(outgoing.ordering_key IS NOT NULL) \
                    THEN array_agg(outgoing.ordering_key ORDER BY outgoing.place) END \
         FROM {from} \
         GROUP BY outgoing.ordering_key IS NOT NULL"
    )
}

/// The outbox rows of the events that went in, as a step of a claim
/// statement whose `claimed` step yields them; the rows' parameters start
/// at `$first`.
pub(super) fn sent_step(first: usize) -> String {
    format!(
        "sent AS ({})",
        batch_row(&format!("{} JOIN claimed USING (event_id)", unnest(first)))
    )
}

/// The outbox rows of events known to have gone in, inside their
/// transaction: `$1`…`$8` as [`Rows::params`].
pub(super) fn insert_statement() -> String {
    batch_row(&unnest(1))
}

/// Writes `messages` to the outbox in `tx`, keyed in `group`, as a
/// transaction that applies their events does.
pub(crate) async fn write(
    tx: &impl GenericClient,
    group: &str,
    messages: Vec<Entry<'_>>,
) -> Result<(), tokio_postgres::Error> {
    let rows = Rows::of_messages(group, messages.into_iter());
    if rows.is_empty() {
        return Ok(());
    }
    let statement = tx.prepare_cached(&insert_statement()).await?;
    tx.execute(&statement, &rows.params()).await?;
    Ok(())
}

/// Where a message the relay took waits, locked until its transaction
/// ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// A row of its own in `mq_outbox`, by id.
    Row(i64),
    /// Among the messages of a row of `mq_outbox_batch`, by id: the relay
    /// removes the row, and puts back in `mq_outbox` those of its messages
    /// that were not confirmed.
    Batch(i64),
}

/// A message the relay took from the outbox, locked until its transaction ends.
#[derive(Debug, Clone)]
pub struct Unsent {
    /// Where it waits.
    pub taken: Taken,
    /// The idempotency key.
    pub message_id: String,
    /// Where it goes.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Its content type.
    pub content_type: Option<String>,
    /// Headers of the handler's own.
    pub headers: std::collections::BTreeMap<String, String>,
    /// Its body.
    pub body: Vec<u8>,
    /// Publishes refused so far.
    pub attempts: i32,
    /// Its event's ordering key, if it has one.
    pub ordering_key: Option<String>,
    /// Not to be published in this batch: an earlier message of its key
    /// waits (refused, its next attempt not due). It is put back to wait
    /// on its own, behind that one.
    pub held: bool,
}

/// Headers as idem writes them: a JSON object of strings.
fn headers(text: &str) -> std::collections::BTreeMap<String, String> {
    serde_json::from_str(text).unwrap_or_default()
}

/// The advisory lock a relay holds, for its transaction, while it takes
/// ordered messages (those with an ordering key): one relay at a time
/// takes them, in id order, none skipped, so that a key's messages leave
/// in the order their events applied. Keyed by the outbox table's oid, so
/// that each schema has its own.
const ORDER_LOCK: &str = "SELECT pg_try_advisory_xact_lock(x'69646f6f'::integer, \
                          'mq_outbox_batch'::regclass::oid::integer)";

/// Up to about `limit` unsent messages that are due, locked for the
/// caller's transaction. Those waiting on their own first (refused or left
/// over before, oldest first), then whole rows of batches, oldest first,
/// until `limit` is reached.
///
/// Unordered messages are taken by any relay, skipping rows another one
/// holds. Ordered ones only by the relay that gets the order lock (the
/// others take unordered ones meanwhile), in id order; a key whose earlier
/// message waits for its next attempt is blocked: its later messages are
/// not taken from `mq_outbox`, and in a batch row they are taken
/// [`held`](Unsent::held).
pub async fn take(
    client: &impl GenericClient,
    limit: i64,
) -> Result<Vec<Unsent>, tokio_postgres::Error> {
    let ordered: bool = client.query_one(ORDER_LOCK, &[]).await?.try_get(0)?;
    let mut taken = take_rows(client, limit, ordered).await?;
    if taken.len() as i64 >= limit {
        return Ok(taken);
    }
    let blocked: std::collections::HashSet<String> = if ordered {
        client
            .query(
                "SELECT DISTINCT ordering_key FROM mq_outbox \
                 WHERE ordering_key IS NOT NULL AND sent_at IS NULL AND next_attempt_at > now()",
                &[],
            )
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?
    } else {
        std::collections::HashSet::new()
    };
    let next_batch = client
        .prepare_cached(if ordered {
            "SELECT id, message_ids, exchanges, routing_keys, content_types, headers, bodies, \
                 ordering_keys \
             FROM mq_outbox_batch WHERE id > $1 \
             ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
        } else {
            "SELECT id, message_ids, exchanges, routing_keys, content_types, headers, bodies, \
                 ordering_keys \
             FROM mq_outbox_batch WHERE id > $1 AND ordering_keys IS NULL \
             ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
        })
        .await?;
    // After the last row taken: a row this transaction locked is not
    // skipped, but taken again.
    let mut after = 0_i64;
    while (taken.len() as i64) < limit {
        let Some(row) = client.query_opt(&next_batch, &[&after]).await? else {
            break;
        };
        after = row.try_get(0)?;
        batch_messages(&row, &blocked, &mut taken)?;
    }
    Ok(taken)
}

/// Up to `limit` due messages of `mq_outbox`, in id order: the unordered
/// ones another relay does not hold, and with `ordered` (the order lock
/// held) the ordered ones whose key has no earlier message waiting.
async fn take_rows(
    client: &impl GenericClient,
    limit: i64,
    ordered: bool,
) -> Result<Vec<Unsent>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id, message_id::text, exchange, routing_key, content_type, headers::text, \
                 body, attempts, ordering_key \
             FROM mq_outbox AS message \
             WHERE sent_at IS NULL AND next_attempt_at <= now() \
               AND (ordering_key IS NULL OR ($2 AND NOT EXISTS ( \
                   SELECT FROM mq_outbox AS earlier \
                   WHERE earlier.ordering_key = message.ordering_key \
                     AND earlier.id < message.id AND earlier.sent_at IS NULL \
                     AND earlier.next_attempt_at > now()))) \
             ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
            &[&limit, &ordered],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(Unsent {
                taken: Taken::Row(row.try_get(0)?),
                message_id: row.try_get(1)?,
                exchange: row.try_get(2)?,
                routing_key: row.try_get(3)?,
                content_type: row.try_get(4)?,
                headers: headers(row.try_get(5)?),
                body: row.try_get(6)?,
                attempts: row.try_get(7)?,
                ordering_key: row.try_get(8)?,
                held: false,
            })
        })
        .collect()
}

/// The messages of a row of `mq_outbox_batch`, added to `taken`; those
/// whose key is `blocked` held.
fn batch_messages(
    row: &tokio_postgres::Row,
    blocked: &std::collections::HashSet<String>,
    taken: &mut Vec<Unsent>,
) -> Result<(), tokio_postgres::Error> {
    let id: i64 = row.try_get(0)?;
    let message_ids: Vec<uuid::Uuid> = row.try_get(1)?;
    let exchanges: Vec<String> = row.try_get(2)?;
    let routing_keys: Vec<String> = row.try_get(3)?;
    let content_types: Vec<Option<String>> = row.try_get(4)?;
    let all_headers: Vec<String> = row.try_get(5)?;
    let bodies: Vec<Vec<u8>> = row.try_get(6)?;
    let ordering_keys: Option<Vec<String>> = row.try_get(7)?;
    let keys = ordering_keys
        .map(|keys| keys.into_iter().map(Some).collect())
        .unwrap_or_else(|| vec![None; message_ids.len()]);
    // Written by one statement from arrays of one length.
    for ((((((message_id, exchange), routing_key), content_type), headers_text), body), key) in
        message_ids
            .into_iter()
            .zip(exchanges)
            .zip(routing_keys)
            .zip(content_types)
            .zip(all_headers)
            .zip(bodies)
            .zip(keys)
    {
        let held = key.as_ref().is_some_and(|key| blocked.contains(key));
        taken.push(Unsent {
            taken: Taken::Batch(id),
            message_id: message_id.to_string(),
            exchange,
            routing_key,
            content_type,
            headers: headers(&headers_text),
            body,
            attempts: 0,
            ordering_key: key,
            held,
        });
    }
    Ok(())
}

/// Removes `ids` of `mq_outbox`, sent: the outbox keeps what is still to
/// send. (A row removed costs a few dozen bytes of WAL; marking it sent
/// wrote the whole row again, and the prune that removed it later, once
/// more.)
pub async fn remove_sent(
    client: &impl GenericClient,
    ids: &[i64],
) -> Result<(), tokio_postgres::Error> {
    if ids.is_empty() {
        return Ok(());
    }
    client
        .execute("DELETE FROM mq_outbox WHERE id = ANY($1)", &[&ids])
        .await?;
    Ok(())
}

/// A message of a batch row not confirmed, to wait on its own: refused by
/// the broker (why, and how long until it is tried again), or left over
/// (`None`: due at once).
#[derive(Debug)]
pub(crate) struct PutBack<'m> {
    /// The message.
    pub(crate) message: &'m Unsent,
    /// The broker's refusal and the wait before the next attempt.
    pub(crate) refused: Option<(String, Duration)>,
}

/// Removes the batch rows `batches` (taken, so locked by the caller), and
/// writes `messages`, those of their messages not confirmed, to
/// `mq_outbox`, in order: the refused ones with their first attempt
/// counted. Those confirmed are sent, and go with their row.
pub(crate) async fn put_back(
    client: &impl GenericClient,
    batches: &[i64],
    messages: &[PutBack<'_>],
) -> Result<(), tokio_postgres::Error> {
    if !messages.is_empty() {
        let mut columns = PutBackColumns::default();
        for PutBack { message, refused } in messages {
            columns.message_ids.push(message.message_id.as_str());
            columns.exchanges.push(message.exchange.as_str());
            columns.routing_keys.push(message.routing_key.as_str());
            columns.content_types.push(message.content_type.as_deref());
            // A map of strings always serializes.
            columns
                .headers
                .push(serde_json::to_string(&message.headers).unwrap_or_else(|_| "{}".into()));
            columns.bodies.push(message.body.as_slice());
            columns.ordering_keys.push(message.ordering_key.as_deref());
            let (attempts, reason, wait) = match refused {
                Some((reason, wait)) => (message.attempts + 1, Some(reason.as_str()), *wait),
                None => (message.attempts, None, Duration::ZERO),
            };
            columns.attempts.push(attempts);
            columns.reasons.push(reason);
            columns.waits.push(millis(wait));
        }
        client
            .execute(
                "INSERT INTO mq_outbox (message_id, exchange, routing_key, content_type, headers, \
                     body, attempts, last_error, next_attempt_at, ordering_key) \
                 SELECT back.message_id::uuid, back.exchange, back.routing_key, \
                     back.content_type, back.headers::jsonb, back.body, back.attempts, \
                     back.reason, now() + back.wait * interval '1 millisecond', \
                     back.ordering_key \
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
                             $6::bytea[], $7::int[], $8::text[], $9::bigint[], $10::text[]) \
                     WITH ORDINALITY \
                     AS back(message_id, exchange, routing_key, content_type, headers, body, \
                             attempts, reason, wait, ordering_key, place) \
                 ORDER BY back.place",
                &[
                    &columns.message_ids,
                    &columns.exchanges,
                    &columns.routing_keys,
                    &columns.content_types,
                    &columns.headers,
                    &columns.bodies,
                    &columns.attempts,
                    &columns.reasons,
                    &columns.waits,
                    &columns.ordering_keys,
                ],
            )
            .await?;
    }
    if !batches.is_empty() {
        client
            .execute(
                "DELETE FROM mq_outbox_batch WHERE id = ANY($1)",
                &[&batches],
            )
            .await?;
    }
    Ok(())
}

/// [`put_back`]'s messages, column by column.
#[derive(Default)]
struct PutBackColumns<'m> {
    message_ids: Vec<&'m str>,
    exchanges: Vec<&'m str>,
    routing_keys: Vec<&'m str>,
    content_types: Vec<Option<&'m str>>,
    headers: Vec<String>,
    bodies: Vec<&'m [u8]>,
    attempts: Vec<i32>,
    reasons: Vec<Option<&'m str>>,
    waits: Vec<i64>,
    ordering_keys: Vec<Option<&'m str>>,
}

fn millis(wait: Duration) -> i64 {
    i64::try_from(wait.as_millis()).unwrap_or(i64::MAX)
}

/// Counts a refused publish of each of `ids`, with its reason, and puts the
/// next attempt off by `after`, index for index.
pub async fn mark_refused(
    client: &impl GenericClient,
    ids: &[i64],
    reasons: &[String],
    after: &[Duration],
) -> Result<(), tokio_postgres::Error> {
    let waits: Vec<i64> = after.iter().copied().map(millis).collect();
    client
        .execute(
            "UPDATE mq_outbox SET attempts = attempts + 1, last_error = refused.reason, \
                 next_attempt_at = now() + refused.wait * interval '1 millisecond' \
             FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS refused(id, reason, wait) \
             WHERE mq_outbox.id = refused.id",
            &[&ids, &reasons, &waits],
        )
        .await?;
    Ok(())
}

/// How many messages wait to be sent.
pub async fn unsent(client: &impl GenericClient) -> Result<i64, tokio_postgres::Error> {
    client
        .query_one(
            "SELECT (SELECT count(*) FROM mq_outbox WHERE sent_at IS NULL) \
                  + (SELECT coalesce(sum(messages), 0) FROM mq_outbox_batch)",
            &[],
        )
        .await?
        .try_get(0)
}
