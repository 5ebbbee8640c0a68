//! The extension point: what a team implements to put its own effect under
//! idem's guarantees. Everything else (consume records, the failure ledger,
//! batching, acks, dead-lettering, replay) is idem's.
//!
//! A [`Handler`] turns a message body into an event, names the event's
//! deduplication key, and applies fresh events inside the transaction in
//! which idem has just recorded them. The trait knows no RabbitMQ; its
//! effect knows no consume record.

mod failure;
pub(crate) mod outbox;

use std::fmt;
use std::future::Future;

pub use deadpool_postgres::Transaction;

pub use failure::{FailureKind, classify, classify_sqlstate};
pub(crate) use outbox::given_up_name;
pub use outbox::{Outbox, OutboxMessage, given_up_id, message_id};

/// Longest deduplication key, in characters: `mq_consume_record.event_id`.
pub const MAX_EVENT_ID_CHARS: usize = 128;

/// Longest ordering key, in characters: `mq_parked_key.ordering_key`.
pub const MAX_ORDERING_KEY_CHARS: usize = 128;

/// The header a producer sets to an event's ordering key when it publishes
/// to an ordered queue: RabbitMQ's consistent-hash exchange hashes it to
/// choose the key's slot, and the worker checks that it names the key the
/// handler reads from the body ([`Handler::ordering_key`]).
pub const ORDERING_KEY_HEADER: &str = "idem-ordering-key";

/// An effect applied once per event and consumer group.
///
/// What idem guarantees around each call:
///
/// - [`decode`](Handler::decode) sees every body of at most the worker's
///   body limit (larger ones are invalid without being decoded). An error,
///   or a panic, makes the message *invalid*: it is dead-lettered at once,
///   with the reason in one log line, and nothing is applied.
/// - [`event_id`](Handler::event_id) is checked by idem whatever it
///   returns: 1 to [`MAX_EVENT_ID_CHARS`] characters, no control characters;
///   a key that breaks this makes the message invalid. Two events with the
///   same key are the same event: the second is a duplicate, acked without
///   effect. Keep the key stable across a producer's retries.
/// - [`apply`](Handler::apply) runs inside a transaction that idem opened,
///   in which it has just inserted the consume records of exactly the events
///   it passes (events recorded before are duplicates and are not passed).
///   In batch mode the slice holds the batch's fresh events, in event-id
///   order; in per-message mode, and when a failed batch is retried message
///   by message, it holds one. After `apply` returns `Ok`, idem clears the
///   events' failure-ledger rows, commits, and only then acks. On `Err` (or a
///   panic) everything rolls back, the consume records with the effect, and
///   the error decides what follows (see [`HandlerError`]). `apply` writes;
///   it cannot commit or roll back (it gets a reference to the transaction),
///   and must not end the transaction with SQL of its own.
/// - [`classify`](Handler::classify) decides, for every error PostgreSQL
///   reports in the transaction (the handler's statements, idem's own, the
///   commit), whether the message failed or the infrastructure did.
///
/// Lock rows in a stable order (sort by key) when a batch touches several:
/// concurrent batches then cannot deadlock. A deadlock is not the message's
/// fault (it is retried with backoff) but it costs time.
///
/// idem's connections run with `plan_cache_mode = force_generic_plan`:
/// prepared statements are planned once per connection.
pub trait Handler: Send + Sync + 'static {
    /// What a body decodes to.
    type Event: Send + Sync + 'static;

    /// Keys this handler's migration history, and names it in logs: keep it
    /// stable once deployed. At most 64 characters.
    const NAME: &'static str;

    /// This handler's schema, oldest first, numbered from 1. `idem migrate`
    /// (and [`crate::store::migrate::run`]) applies them after idem's own,
    /// and tracks them apart, so that both can evolve; the worker will not
    /// start on a database that lacks one of them.
    const MIGRATIONS: &'static [Migration] = &[];

    /// Decodes a body. An error means the message can never be applied.
    fn decode(&self, body: &[u8]) -> Result<Self::Event, Invalid>;

    /// The event's deduplication key.
    fn event_id<'e>(&self, event: &'e Self::Event) -> &'e str;

    /// The event's ordering key (an order, an account, a seat), when its
    /// effect depends on the order of the key's events: on an ordered
    /// queue ([`crate::broker::Topology::ordered`]) idem applies a key's
    /// events one at a time, in the order their slot delivered them, and
    /// a key whose head failed keeps its later events parked until the
    /// head applies (or an operator releases the key). On an ordered queue
    /// an event must have one, 1 to [`MAX_ORDERING_KEY_CHARS`] characters
    /// without control characters, equal to the message's
    /// [`ORDERING_KEY_HEADER`]; else the message is invalid. The default
    /// is none: the effect commutes (points credited in any order), and
    /// the queue need not be ordered.
    fn ordering_key<'e>(&self, event: &'e Self::Event) -> Option<&'e str> {
        let _ = event;
        None
    }

    /// Applies fresh events inside idem's transaction. A handler whose
    /// effect is a [`tally`](Handler::tally) need not write it: the default
    /// runs the tally (as idem's claim statement does); a handler with
    /// neither fails every message as [`HandlerError::Permanent`].
    ///
    /// Messages whose content depends on what `apply` found (a rejection
    /// instead of a confirmation, the stock left) go to
    /// [`outbox.send`](Outbox::send), which writes them in this transaction
    /// beside what [`outgoing`](Handler::outgoing) returned.
    fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&Self::Event],
        outbox: &mut Outbox<'_>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        let _ = outbox;
        let tally = self.tally();
        async move {
            match tally {
                Some(tally) => tally.apply(tx, events).await,
                None => Err(HandlerError::permanent(format!(
                    "the handler {} implements neither apply nor tally",
                    Self::NAME
                ))),
            }
        }
    }

    /// Whose fault a PostgreSQL error of the transaction is, for the errors
    /// the server reported (with a SQLSTATE); a broken connection is always
    /// the infrastructure's. The default is idem's SQLSTATE classification
    /// ([`classify_sqlstate`]); refine it where the handler knows better (a
    /// foreign key that a later event will satisfy is a failure of the
    /// message that a retry may fix; an exclusion constraint held by a
    /// concurrent batch is not the message's fault).
    fn classify(&self, error: &tokio_postgres::Error) -> FailureKind {
        classify(error)
    }

    /// An effect simple enough for idem to run inside its own claim
    /// statement, in one round trip instead of a transaction of several.
    /// When this returns `Some`, idem runs the tally and does not call
    /// [`apply`](Handler::apply), whose default runs the same tally: the
    /// effect has one definition. `None` (the default) always calls `apply`.
    fn tally(&self) -> Option<Tally<Self::Event>> {
        None
    }

    /// Whether [`outgoing`](Handler::outgoing) may return messages, or
    /// [`apply`](Handler::apply) send them: a worker then runs a relay beside
    /// its consumer, which publishes them.
    const SENDS_MESSAGES: bool = false;

    /// Messages that applying `event` sends on (a notification, a command to
    /// another service). idem writes them to the outbox (`mq_outbox`) in the
    /// transaction that applies the event, so that they exist if and only if
    /// the effect committed, never for a duplicate; a relay then publishes
    /// them with publisher confirms and `mandatory`, each at least once, under
    /// an idempotency key derived from the consumer group, the event's id and
    /// the message's place in this list ([`message_id`]), as the AMQP
    /// `message_id` and an `Idempotency-Key` header. Set
    /// [`SENDS_MESSAGES`](Handler::SENDS_MESSAGES) when this can return any.
    /// The default sends nothing. It sees only the event: what depends on
    /// the database, `apply` sends through its [`Outbox`].
    fn outgoing(&self, event: &Self::Event) -> Vec<OutboxMessage> {
        let _ = event;
        Vec::new()
    }

    /// Messages that say idem gave up on a message (a rejection to the
    /// payer, a fault notice, as MassTransit's `Fault<T>` and NServiceBus's
    /// failed-message events do), called when idem dead-letters it: an
    /// event that can never apply ([`HandlerError::Permanent`]) or used up
    /// its attempts, or a body that is no valid event. idem writes them to
    /// the outbox in the transaction that records the dead letter in its
    /// index, before the letter goes to the dead-letter queue, and a relay
    /// publishes them as it does [`outgoing`](Handler::outgoing)'s, under
    /// idempotency keys of their own ([`given_up_id`]).
    ///
    /// Once per death: a copy that dies again without having been replayed
    /// (a worker that stopped before the broker heard of the first death, a
    /// second copy of the event) writes nothing more; a letter replayed (once
    /// its cause is fixed) that dies again writes them anew. Set
    /// [`SENDS_MESSAGES`](Handler::SENDS_MESSAGES) when this can return any.
    /// The default sends nothing; a panic sends nothing and is logged.
    fn given_up(&self, given_up: &GivenUp<'_, Self::Event>) -> Vec<OutboxMessage> {
        let _ = given_up;
        Vec::new()
    }
}

/// A message idem gave up on, as [`Handler::given_up`] sees it.
#[derive(Debug)]
#[non_exhaustive]
pub enum GivenUp<'a, E> {
    /// A valid event: it can never apply, or it used up its attempts.
    Event {
        /// The event.
        event: &'a E,
        /// Why, as the dead-letter index keeps it (the last error).
        error: &'a str,
    },
    /// A body that is no valid event: [`Handler::decode`] refused it, or
    /// its event id broke idem's rules.
    Invalid {
        /// The body, as it came.
        body: &'a [u8],
        /// Why it is invalid.
        reason: &'a str,
    },
}

/// A shared handler is the same handler: what lets one value serve a
/// worker and the tasks beside it (a pruner, say). Every method of the
/// trait is forwarded: a default left out here would silently replace the
/// handler's own.
impl<H: Handler> Handler for std::sync::Arc<H> {
    type Event = H::Event;

    const NAME: &'static str = H::NAME;
    const MIGRATIONS: &'static [Migration] = H::MIGRATIONS;
    const SENDS_MESSAGES: bool = H::SENDS_MESSAGES;

    fn decode(&self, body: &[u8]) -> Result<Self::Event, Invalid> {
        (**self).decode(body)
    }

    fn event_id<'e>(&self, event: &'e Self::Event) -> &'e str {
        (**self).event_id(event)
    }

    fn ordering_key<'e>(&self, event: &'e Self::Event) -> Option<&'e str> {
        (**self).ordering_key(event)
    }

    fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&Self::Event],
        outbox: &mut Outbox<'_>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        (**self).apply(tx, events, outbox)
    }

    fn classify(&self, error: &tokio_postgres::Error) -> FailureKind {
        (**self).classify(error)
    }

    fn tally(&self) -> Option<Tally<Self::Event>> {
        (**self).tally()
    }

    fn outgoing(&self, event: &Self::Event) -> Vec<OutboxMessage> {
        (**self).outgoing(event)
    }

    fn given_up(&self, given_up: &GivenUp<'_, Self::Event>) -> Vec<OutboxMessage> {
        (**self).given_up(given_up)
    }
}

/// An effect that adds an amount to a counter row per event, creating the
/// row at that amount when it is missing: `INSERT … ON CONFLICT (key) DO
/// UPDATE SET amount = amount + EXCLUDED.amount`, summed per key, keys in
/// order. Described by names, not SQL, so that idem can fold it into its
/// claim statement.
pub struct Tally<E> {
    /// The table; a plain identifier.
    pub table: &'static str,
    /// Its key column, unique (the primary key, say).
    pub key: &'static str,
    /// The `BIGINT` column the amounts add up in.
    pub amount: &'static str,
    /// An event's key and amount.
    pub entry: fn(&E) -> (&str, i64),
}

impl<E> Tally<E> {
    /// The keys and amounts of `events`, index for index.
    pub fn entries<'e>(&self, events: &[&'e E]) -> (Vec<&'e str>, Vec<i64>) {
        events.iter().map(|event| (self.entry)(event)).unzip()
    }

    /// Adds the amounts of `events` in `tx`, as one statement: what idem
    /// does in its claim statement, for a [`Handler::apply`] of a tally
    /// handler's own. Its names must be plain identifiers (a worker checks
    /// them at start).
    pub async fn apply(&self, tx: &Transaction<'_>, events: &[&E]) -> Result<(), HandlerError>
    where
        E: Sync,
    {
        let (keys, amounts) = self.entries(events);
        let statement = tx.prepare_cached(&self.statement()).await?;
        tx.execute(&statement, &[&keys, &amounts]).await?;
        Ok(())
    }

    /// The effect alone, inside a transaction: `$1` keys, `$2` amounts.
    pub(crate) fn statement(&self) -> String {
        let Tally {
            table, key, amount, ..
        } = self;
        format!(
            "INSERT INTO {table} ({key}, {amount}) \
             SELECT batch.tally_key, sum(batch.tally_amount)::bigint \
             FROM unnest($1::varchar[], $2::bigint[]) AS batch(tally_key, tally_amount) \
             GROUP BY batch.tally_key ORDER BY batch.tally_key \
             {}",
            self.upsert()
        )
    }

    /// What adds an amount to a key's row that exists already.
    pub(crate) fn upsert(&self) -> String {
        let Tally {
            table, key, amount, ..
        } = self;
        format!("ON CONFLICT ({key}) DO UPDATE SET {amount} = {table}.{amount} + EXCLUDED.{amount}")
    }
}

impl<E> Clone for Tally<E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Tally<E> {}

impl<E> fmt::Debug for Tally<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tally")
            .field("table", &self.table)
            .field("key", &self.key)
            .field("amount", &self.amount)
            .finish_non_exhaustive()
    }
}

/// Why a body can never be applied: the message is dead-lettered at once.
///
/// Any error converts into it (`serde_json::from_slice(body)?` works in
/// [`Handler::decode`]); [`Invalid::new`] takes a reason of your own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(String);

impl Invalid {
    /// An invalid message, and why.
    pub fn new(reason: impl fmt::Display) -> Self {
        Self(reason.to_string())
    }

    /// Why.
    pub fn reason(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for Invalid {
    fn from(error: E) -> Self {
        Self::new(error)
    }
}

/// One migration: a file of idem's `sql/`, or of a handler.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Order of application, from 1; the number the file name starts with.
    pub version: i32,
    /// The file name, for the record.
    pub name: &'static str,
    /// The statements.
    pub sql: &'static str,
}

/// An error type-erased for [`HandlerError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why [`Handler::apply`] did not apply. Every variant rolls the transaction
/// back; they differ in what happens next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// A statement failed: [`Handler::classify`] decides whose fault it is.
    /// `?` on a `tokio_postgres::Error` gives this.
    #[error(transparent)]
    Database(#[from] tokio_postgres::Error),
    /// This message cannot be applied now (a rule of the business, say): the
    /// failure is counted in the failure ledger and the message retried,
    /// then dead-lettered once it has used up its attempts.
    #[error("{0}")]
    Message(BoxError),
    /// This message can never apply (an unknown SKU, a rule of the
    /// business that no retry changes): it is dead-lettered at once, its
    /// reason recorded as the failure ledger's last error (which `dlq`
    /// shows and filters on), without waiting through its attempts. In a
    /// batch, only the message that says it is dead-lettered: the others
    /// are applied one by one.
    #[error("{0}")]
    Permanent(BoxError),
    /// Something outside the message failed: the delivery is held and the
    /// transaction retried with backoff, spending none of its attempts, and
    /// the worker takes no new work meanwhile. Only for what a wait can fix.
    #[error("{0}")]
    Infrastructure(BoxError),
}

impl HandlerError {
    /// This message failed, for `reason`.
    pub fn message(reason: impl Into<BoxError>) -> Self {
        Self::Message(reason.into())
    }

    /// This message can never apply, for `reason`.
    pub fn permanent(reason: impl Into<BoxError>) -> Self {
        Self::Permanent(reason.into())
    }

    /// This message can never apply, for `reason`, which the failure ledger
    /// and the dead-letter index keep and `dlq summary` groups letters by;
    /// `detail` (which account, which order) goes into the worker's log
    /// line with the event id and, when the message is dead-lettered, onto
    /// its letter (the header `x-idem-death-detail`, which the console's
    /// letter page shows beside the error), and leaves the grouping alone.
    pub fn permanent_for(reason: impl fmt::Display, detail: impl fmt::Display) -> Self {
        Self::Permanent(Box::new(Detailed::new(reason, detail)))
    }

    /// This message failed, for `reason`, with `detail` kept out of the
    /// grouping as [`permanent_for`](HandlerError::permanent_for) does.
    pub fn message_for(reason: impl fmt::Display, detail: impl fmt::Display) -> Self {
        Self::Message(Box::new(Detailed::new(reason, detail)))
    }

    /// The infrastructure failed, with `reason`.
    pub fn infrastructure(reason: impl Into<BoxError>) -> Self {
        Self::Infrastructure(reason.into())
    }
}

/// A failure's reason, which groups dead letters, and its detail, which
/// does not: what [`HandlerError::permanent_for`] and
/// [`HandlerError::message_for`] carry. It displays as its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detailed {
    reason: String,
    detail: String,
}

impl Detailed {
    fn new(reason: impl fmt::Display, detail: impl fmt::Display) -> Self {
        Self {
            reason: reason.to_string(),
            detail: detail.to_string(),
        }
    }

    /// What groups the letters: the ledger's last error.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// What the log line and the letter say, outside the grouping.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

impl fmt::Display for Detailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for Detailed {}

/// idem's own rule for a deduplication key, whatever the handler returns.
pub(crate) fn check_event_id(event_id: &str) -> Result<(), Invalid> {
    check_key("event id", event_id, MAX_EVENT_ID_CHARS)
}

/// idem's own rule for an ordering key, whatever the handler returns: the
/// same as an event id's.
pub(crate) fn check_ordering_key(key: &str) -> Result<(), Invalid> {
    check_key("ordering key", key, MAX_ORDERING_KEY_CHARS)
}

fn check_key(what: &str, key: &str, max_chars: usize) -> Result<(), Invalid> {
    if key.is_empty() {
        return Err(Invalid::new(format!("the {what} is empty")));
    }
    if key.chars().any(char::is_control) {
        return Err(Invalid::new(format!(
            "the {what} contains a control character"
        )));
    }
    let chars = key.chars().count();
    if chars > max_chars {
        return Err(Invalid::new(format!(
            "the {what} has {chars} characters, above the limit of {max_chars}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_id_must_be_one_to_128_characters_without_control_characters() {
        assert!(check_event_id("payment-success-10001").is_ok());
        assert!(check_event_id(&"é".repeat(MAX_EVENT_ID_CHARS)).is_ok());
        assert!(check_event_id("").is_err());
        assert!(check_event_id("a\u{0}b").is_err());
        assert!(check_event_id("tab\there").is_err());
        assert!(check_event_id(&"x".repeat(MAX_EVENT_ID_CHARS + 1)).is_err());
    }

    #[test]
    fn any_error_is_an_invalid_message_with_its_text() {
        let error = serde_json::from_slice::<serde_json::Value>(b"{").err();
        let invalid = error.map(Invalid::from);
        assert!(
            invalid.is_some_and(|invalid| invalid.reason().contains("EOF")),
            "the reason is the error's text"
        );
    }
}
