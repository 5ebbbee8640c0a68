//! The outbox's SQL: the rows a transaction writes for the messages its
//! events send on, and what a relay reads, removes once sent, and marks
//! when the broker refused them.

use std::time::Duration;

use deadpool_postgres::GenericClient;

use crate::handler::{Outbox, OutboxMessage, message_id};

/// The outbox rows of some events, column by column (what `unnest` takes):
/// `$1` the event ids they belong to, then message ids, exchanges, routing
/// keys, content types, headers (JSON) and bodies.
#[derive(Debug, Default)]
pub(super) struct Rows {
    event_ids: Vec<String>,
    message_ids: Vec<String>,
    exchanges: Vec<String>,
    routing_keys: Vec<String>,
    content_types: Vec<Option<String>>,
    headers: Vec<String>,
    bodies: Vec<Vec<u8>>,
}

impl Rows {
    /// The rows of `outbox`'s messages, keyed in `group`.
    pub(super) fn of(group: &str, outbox: Outbox<'_>) -> Self {
        Self::of_messages(group, outbox.into_messages())
    }

    /// The rows of `messages` (an event's id, the message's index among
    /// that event's, the message), keyed in `group`.
    fn of_messages<'e>(
        group: &str,
        messages: impl Iterator<Item = (&'e str, usize, OutboxMessage)>,
    ) -> Self {
        let mut rows = Self::default();
        // Each message carries the context of the span that sends it,
        // unless the handler gave one of its own.
        let mut context = None;
        for (event_id, index, mut message) in messages {
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
        }
        rows
    }

    pub(super) fn is_empty(&self) -> bool {
        self.message_ids.is_empty()
    }

    /// The rows' parameters, in the order [`sent_step`] and
    /// [`insert_statement`] take them.
    pub(super) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 7] {
        [
            &self.event_ids,
            &self.message_ids,
            &self.exchanges,
            &self.routing_keys,
            &self.content_types,
            &self.headers,
            &self.bodies,
        ]
    }
}

/// The rows of `$n`…`$n+6` (see [`Rows`]), in the order given.
fn unnest(first: usize) -> String {
    let [a, b, c, d, e, f, g] = std::array::from_fn(|i| first + i);
    format!(
        "unnest(${a}::varchar[], ${b}::text[], ${c}::text[], ${d}::text[], ${e}::text[], \
         ${f}::text[], ${g}::bytea[]) WITH ORDINALITY \
         AS outgoing(event_id, message_id, exchange, routing_key, content_type, headers, body, \
         place)"
    )
}

const COLUMNS: &str = "INSERT INTO mq_outbox \
     (message_id, exchange, routing_key, content_type, headers, body) \
     SELECT outgoing.message_id::uuid, outgoing.exchange, outgoing.routing_key, \
     outgoing.content_type, outgoing.headers::jsonb, outgoing.body";

/// The outbox rows of the events that went in, as a step of a claim
/// statement whose `claimed` step yields them; the rows' parameters start
/// at `$first`.
pub(super) fn sent_step(first: usize) -> String {
    format!(
        "sent AS ({COLUMNS} FROM {} JOIN claimed USING (event_id) ORDER BY outgoing.place)",
        unnest(first)
    )
}

/// The outbox rows of events known to have gone in, inside their
/// transaction: `$1`…`$7` as [`Rows::params`].
pub(super) fn insert_statement() -> String {
    format!("{COLUMNS} FROM {} ORDER BY outgoing.place", unnest(1))
}

/// Writes `messages` (an event's id, the message's index among that
/// event's, the message) to the outbox in `tx`, keyed in `group`, as a
/// transaction that applies their events does.
pub(crate) async fn write(
    tx: &impl GenericClient,
    group: &str,
    messages: Vec<(&str, usize, OutboxMessage)>,
) -> Result<(), tokio_postgres::Error> {
    let rows = Rows::of_messages(group, messages.into_iter());
    if rows.is_empty() {
        return Ok(());
    }
    let statement = tx.prepare_cached(&insert_statement()).await?;
    tx.execute(&statement, &rows.params()).await?;
    Ok(())
}

/// A message the relay took from the outbox, locked until its transaction ends.
#[derive(Debug, Clone)]
pub struct Unsent {
    /// The row.
    pub id: i64,
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
}

/// Up to `limit` unsent messages that are due, oldest first, locked for the
/// caller's transaction; rows another relay holds are skipped.
pub async fn take(
    client: &impl GenericClient,
    limit: i64,
) -> Result<Vec<Unsent>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id, message_id::text, exchange, routing_key, content_type, headers::text, \
                 body, attempts \
             FROM mq_outbox WHERE sent_at IS NULL AND next_attempt_at <= now() \
             ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
            &[&limit],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(Unsent {
                id: row.try_get(0)?,
                message_id: row.try_get(1)?,
                exchange: row.try_get(2)?,
                routing_key: row.try_get(3)?,
                content_type: row.try_get(4)?,
                // Written by idem as a map of strings.
                headers: serde_json::from_str(row.try_get::<_, &str>(5)?).unwrap_or_default(),
                body: row.try_get(6)?,
                attempts: row.try_get(7)?,
            })
        })
        .collect()
}

/// Removes `ids`, sent: the outbox keeps what is still to send. (A row
/// removed costs a few dozen bytes of WAL; marking it sent wrote the whole
/// row again, and the prune that removed it later, once more.)
pub async fn remove_sent(
    client: &impl GenericClient,
    ids: &[i64],
) -> Result<(), tokio_postgres::Error> {
    client
        .execute("DELETE FROM mq_outbox WHERE id = ANY($1)", &[&ids])
        .await?;
    Ok(())
}

/// Counts a refused publish of each of `ids`, with its reason, and puts the
/// next attempt off by `after`, index for index.
pub async fn mark_refused(
    client: &impl GenericClient,
    ids: &[i64],
    reasons: &[String],
    after: &[Duration],
) -> Result<(), tokio_postgres::Error> {
    let millis: Vec<i64> = after
        .iter()
        .map(|wait| i64::try_from(wait.as_millis()).unwrap_or(i64::MAX))
        .collect();
    client
        .execute(
            "UPDATE mq_outbox SET attempts = attempts + 1, last_error = refused.reason, \
                 next_attempt_at = now() + refused.wait * interval '1 millisecond' \
             FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS refused(id, reason, wait) \
             WHERE mq_outbox.id = refused.id",
            &[&ids, &reasons, &millis],
        )
        .await?;
    Ok(())
}

/// How many messages wait to be sent.
pub async fn unsent(client: &impl GenericClient) -> Result<i64, tokio_postgres::Error> {
    client
        .query_one("SELECT count(*) FROM mq_outbox WHERE sent_at IS NULL", &[])
        .await?
        .try_get(0)
}
