//! Parked keys (migration 0019): on an ordered queue, a key whose head
//! event failed keeps its later events here, in the order their slot
//! delivered them, until the head applies; the worker then applies them
//! oldest first. An operator sees them, and releases or discards a key
//! whose head was discarded.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::{Store, StoreError};

/// An event to keep behind its key's head.
#[derive(Debug, Clone)]
pub struct Parking<'a> {
    /// Its ordering key.
    pub key: &'a str,
    /// Its deduplication key.
    pub event_id: &'a str,
    /// The slot queue it came from.
    pub queue: &'a str,
    /// The body it came with.
    pub body: &'a [u8],
    /// Its properties, as the dead-letter index keeps them.
    pub properties: Value,
}

/// An event kept behind its key's head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedEvent {
    /// Its deduplication key.
    pub event_id: String,
    /// The slot queue it came from.
    pub queue: String,
    /// Its body.
    pub body: Vec<u8>,
    /// Its properties, as JSON.
    pub properties: Option<Value>,
}

/// A parked key, as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedKey {
    /// The ordering key.
    pub key: String,
    /// The event that holds it.
    pub head: String,
    /// Whether the head lies in the dead-letter queue (else it waits for
    /// its next attempt, due at `due_at`).
    pub head_dead: bool,
    /// When the head is tried again, unless it is dead.
    pub due_at: Option<SystemTime>,
    /// Why the head failed, last.
    pub last_error: Option<String>,
    /// Since when the key is parked.
    pub parked_at: SystemTime,
    /// Its events kept here, the head included while it waits.
    pub events: i64,
}

/// What a park did not keep, by the places of the events asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parked {
    /// Their key is parked no longer: apply them.
    pub unparked: Vec<usize>,
    /// Their key holds as many events as the bound allows: they wait.
    pub over_bound: Vec<usize>,
}

/// The keys of a consumer group, how many there are parked and events held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParkedTotals {
    /// Keys parked.
    pub keys: i64,
    /// Events held behind them.
    pub events: i64,
    /// When the oldest was parked.
    pub oldest: Option<SystemTime>,
    /// Keys whose head lies in the dead-letter queue: a replay of it
    /// applies it, then the key's events.
    pub dead_heads: i64,
}

const PARKED_AMONG: &str = "\
    SELECT ordering_key FROM mq_parked_key \
    WHERE consumer_group = $1 AND ordering_key = ANY($2::varchar[])";

const LOCK_KEYS: &str = "\
    SELECT ordering_key, head_event_id, head_dead FROM mq_parked_key \
    WHERE consumer_group = $1 AND ordering_key = ANY($2::varchar[]) \
    ORDER BY ordering_key FOR UPDATE";

const HELD_PER_KEY: &str = "\
    SELECT ordering_key, count(*) FROM mq_parked_event \
    WHERE consumer_group = $1 AND ordering_key = ANY($2::varchar[]) GROUP BY ordering_key";

const KEYS_PARKED: &str = "SELECT count(*) FROM mq_parked_key WHERE consumer_group = $1";

const PARK: &str = "\
    INSERT INTO mq_parked_event (consumer_group, ordering_key, position, event_id, queue, body, properties) \
    VALUES ($1, $2, nextval('mq_parked_position'), $3, $6, $4, $5) \
    ON CONFLICT (consumer_group, event_id) DO NOTHING";

/// A dead head replayed goes before every event parked behind it.
const PARK_FIRST: &str = "\
    INSERT INTO mq_parked_event (consumer_group, ordering_key, position, event_id, queue, body, properties) \
    VALUES ($1::varchar, $2::varchar, \
        LEAST((SELECT min(position) FROM mq_parked_event \
               WHERE consumer_group = $1::varchar AND ordering_key = $2::varchar), \
              nextval('mq_parked_position')) - 1, \
        $3, $6, $4, $5) \
    ON CONFLICT (consumer_group, event_id) DO NOTHING";

const HEAD_BACK: &str = "\
    UPDATE mq_parked_key SET head_dead = false, due_at = now() \
    WHERE consumer_group = $1 AND ordering_key = $2";

const NEW_KEY: &str = "\
    INSERT INTO mq_parked_key (consumer_group, ordering_key, head_event_id, head_dead, due_at, last_error) \
    VALUES ($1, $2, $3, $4::boolean, CASE WHEN $4::boolean THEN NULL ELSE now() + $5::float8 * interval '1 millisecond' END, $6) \
    ON CONFLICT (consumer_group, ordering_key) DO UPDATE \
    SET head_event_id = EXCLUDED.head_event_id, head_dead = EXCLUDED.head_dead, \
        due_at = EXCLUDED.due_at, last_error = EXCLUDED.last_error";

const DUE: &str = "\
    UPDATE mq_parked_key SET due_at = now() + $3::float8 * interval '1 millisecond' \
    WHERE (consumer_group, ordering_key) IN (\
        SELECT consumer_group, ordering_key FROM mq_parked_key \
        WHERE consumer_group = $1 AND due_at <= now() \
        ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
    RETURNING ordering_key";

const EVENTS: &str = "\
    SELECT event_id, queue, body, properties FROM mq_parked_event \
    WHERE consumer_group = $1 AND ordering_key = $2 ORDER BY position LIMIT $3";

const UNPARK: &str = "\
    DELETE FROM mq_parked_event WHERE consumer_group = $1 AND event_id = $2";

const HEAD_WAITS: &str = "\
    UPDATE mq_parked_key \
    SET head_event_id = $3, due_at = now() + $4::float8 * interval '1 millisecond', last_error = $5 \
    WHERE consumer_group = $1 AND ordering_key = $2";

const HEAD_DIES: &str = "\
    UPDATE mq_parked_key \
    SET head_event_id = $3, head_dead = true, due_at = NULL, last_error = $4 \
    WHERE consumer_group = $1 AND ordering_key = $2";

const LOCK_KEY: &str = "\
    SELECT 1 FROM mq_parked_key WHERE consumer_group = $1 AND ordering_key = $2 FOR UPDATE";

const HOLDS_EVENTS: &str = "\
    SELECT EXISTS (SELECT 1 FROM mq_parked_event WHERE consumer_group = $1 AND ordering_key = $2)";

const DROP_KEY: &str = "\
    DELETE FROM mq_parked_key WHERE consumer_group = $1 AND ordering_key = $2";

const LIST: &str = "\
    SELECT k.ordering_key, k.head_event_id, k.head_dead, k.due_at, k.last_error, k.parked_at, \
           (SELECT count(*) FROM mq_parked_event e \
            WHERE e.consumer_group = k.consumer_group AND e.ordering_key = k.ordering_key) \
    FROM mq_parked_key k WHERE k.consumer_group = $1 \
      AND ($2::varchar IS NULL OR k.ordering_key = $2) \
    ORDER BY k.parked_at, k.ordering_key LIMIT $3";

const TOTALS: &str = "\
    SELECT (SELECT count(*) FROM mq_parked_key WHERE consumer_group = $1), \
           (SELECT count(*) FROM mq_parked_event WHERE consumer_group = $1), \
           (SELECT min(parked_at) FROM mq_parked_key WHERE consumer_group = $1), \
           (SELECT count(*) FROM mq_parked_key WHERE consumer_group = $1 AND head_dead)";

const RELEASE: &str = "\
    UPDATE mq_parked_key SET head_dead = false, due_at = now() \
    WHERE consumer_group = $1 AND ordering_key = $2 AND head_dead";

const DISCARD: &str = "\
    SELECT event_id, queue, body, properties FROM mq_parked_event \
    WHERE consumer_group = $1 AND ordering_key = $2 ORDER BY position";

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

impl Store {
    /// The keys among `keys` that are parked.
    pub async fn parked_among(
        &self,
        keys: &[&str],
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        if keys.is_empty() {
            return Ok(Default::default());
        }
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(PARKED_AMONG).await?;
        let rows = client
            .query(&statement, &[&self.consumer_group, &keys])
            .await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// Every key of the consumer group that is parked (they are bounded,
    /// see [`Store::park_head`]).
    pub async fn parked_key_names(&self) -> Result<std::collections::HashSet<String>, StoreError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT ordering_key FROM mq_parked_key WHERE consumer_group = $1",
                &[&self.consumer_group],
            )
            .await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// Keeps each of `events` behind its key's head, in their order, in one
    /// transaction, while its key holds fewer than `per_key` events; a dead
    /// head that comes back (a replay) goes first, whatever its key holds,
    /// and makes its key due. Says which of `events` (by their places)
    /// were not parked: those whose key is parked no longer (its last
    /// event applied meanwhile), to be applied, and those past the bound,
    /// to wait.
    pub async fn park(&self, events: &[Parking<'_>], per_key: u32) -> Result<Parked, StoreError> {
        let mut parked = Parked::default();
        if events.is_empty() {
            return Ok(parked);
        }
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let mut keys: Vec<&str> = events.iter().map(|e| e.key).collect();
        keys.sort_unstable();
        keys.dedup();
        let locked: HashMap<String, (String, bool)> = tx
            .query(LOCK_KEYS, &[&self.consumer_group, &keys])
            .await?
            .iter()
            .map(|row| (row.get(0), (row.get(1), row.get(2))))
            .collect();
        let mut held: HashMap<String, i64> = tx
            .query(HELD_PER_KEY, &[&self.consumer_group, &keys])
            .await?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        for (place, event) in events.iter().enumerate() {
            let Some((head, dead)) = locked.get(event.key) else {
                parked.unparked.push(place);
                continue;
            };
            let comes_back = *dead && head == event.event_id;
            let holds = held.entry(event.key.to_owned()).or_default();
            // Once one event of a key is past the bound, so are its later
            // ones: the count only grows here.
            if !comes_back && *holds >= i64::from(per_key) {
                parked.over_bound.push(place);
                continue;
            }
            let statement = if comes_back { PARK_FIRST } else { PARK };
            *holds += tx
                .execute(
                    statement,
                    &[
                        &self.consumer_group,
                        &event.key,
                        &event.event_id,
                        &event.body,
                        &event.properties,
                        &event.queue,
                    ],
                )
                .await? as i64;
            if comes_back {
                tx.execute(HEAD_BACK, &[&self.consumer_group, &event.key])
                    .await?;
            }
        }
        tx.commit().await?;
        self.replicated(&client).await?;
        Ok(parked)
    }

    /// Parks `key` behind `head`, whose transaction failed with `error`:
    /// kept here to be tried again after `retry_in`, or, with `None`, dead
    /// (the caller dead-letters it). False, and nothing written, when the
    /// key is not parked yet and `keys` are already.
    pub async fn park_head(
        &self,
        head: &Parking<'_>,
        retry_in: Option<Duration>,
        error: &str,
        keys: u32,
    ) -> Result<bool, StoreError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let parked_already = tx
            .query_opt(LOCK_KEY, &[&self.consumer_group, &head.key])
            .await?
            .is_some();
        if !parked_already {
            let parked: i64 = tx
                .query_one(KEYS_PARKED, &[&self.consumer_group])
                .await?
                .get(0);
            if parked >= i64::from(keys) {
                return Ok(false);
            }
        }
        let dead = retry_in.is_none();
        let wait = millis(retry_in.unwrap_or_default());
        tx.execute(
            NEW_KEY,
            &[
                &self.consumer_group,
                &head.key,
                &head.event_id,
                &dead,
                &wait,
                &error,
            ],
        )
        .await?;
        if !dead {
            tx.execute(
                PARK_FIRST,
                &[
                    &self.consumer_group,
                    &head.key,
                    &head.event_id,
                    &head.body,
                    &head.properties,
                    &head.queue,
                ],
            )
            .await?;
        }
        tx.commit().await?;
        self.replicated(&client).await?;
        Ok(true)
    }

    /// Up to `at_most` parked keys whose head is due, each leased to the
    /// caller for `lease` (another worker takes it after that).
    pub async fn due_keys(&self, at_most: i64, lease: Duration) -> Result<Vec<String>, StoreError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(DUE).await?;
        let rows = client
            .query(
                &statement,
                &[&self.consumer_group, &at_most, &millis(lease)],
            )
            .await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// The oldest `at_most` events parked behind `key`, oldest first.
    pub async fn parked_events(
        &self,
        key: &str,
        at_most: i64,
    ) -> Result<Vec<ParkedEvent>, StoreError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(EVENTS, &[&self.consumer_group, &key, &at_most])
            .await?;
        Ok(rows.iter().map(parked_event).collect())
    }

    /// Forgets the parked `event_id`, applied now.
    pub async fn unpark(&self, event_id: &str) -> Result<(), StoreError> {
        let client = self.pool.get().await?;
        client
            .execute(UNPARK, &[&self.consumer_group, &event_id])
            .await?;
        Ok(())
    }

    /// `key`'s head is `event_id`, which failed with `error` and is tried
    /// again in `retry_in`.
    pub async fn head_waits(
        &self,
        key: &str,
        event_id: &str,
        retry_in: Duration,
        error: &str,
    ) -> Result<(), StoreError> {
        let client = self.pool.get().await?;
        client
            .execute(
                HEAD_WAITS,
                &[
                    &self.consumer_group,
                    &key,
                    &event_id,
                    &millis(retry_in),
                    &error,
                ],
            )
            .await?;
        Ok(())
    }

    /// `key`'s head `event_id` failed for good with `error` and is
    /// dead-lettered: it leaves the parked events; the key waits for it.
    pub async fn head_dies(
        &self,
        key: &str,
        event_id: &str,
        error: &str,
    ) -> Result<(), StoreError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.execute(UNPARK, &[&self.consumer_group, &event_id])
            .await?;
        tx.execute(HEAD_DIES, &[&self.consumer_group, &key, &event_id, &error])
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Unparks `key` when it holds no event any more; false when one was
    /// parked meanwhile (the key's lock orders this against a park).
    pub async fn finish_key(&self, key: &str) -> Result<bool, StoreError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        if tx
            .query_opt(LOCK_KEY, &[&self.consumer_group, &key])
            .await?
            .is_none()
        {
            return Ok(true);
        }
        let holds: bool = tx
            .query_one(HOLDS_EVENTS, &[&self.consumer_group, &key])
            .await?
            .get(0);
        if holds {
            return Ok(false);
        }
        tx.execute(DROP_KEY, &[&self.consumer_group, &key]).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Up to `at_most` parked keys, oldest first; only `key` when given.
    pub async fn parked_keys(
        &self,
        key: Option<&str>,
        at_most: i64,
    ) -> Result<Vec<ParkedKey>, StoreError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(LIST, &[&self.consumer_group, &key, &at_most])
            .await?;
        Ok(rows
            .iter()
            .map(|row| ParkedKey {
                key: row.get(0),
                head: row.get(1),
                head_dead: row.get(2),
                due_at: row.get(3),
                last_error: row.get(4),
                parked_at: row.get(5),
                events: row.get(6),
            })
            .collect())
    }

    /// How many keys are parked, with how many events, since when.
    pub async fn parked_totals(&self) -> Result<ParkedTotals, StoreError> {
        let client = self.pool.get().await?;
        let row = client.query_one(TOTALS, &[&self.consumer_group]).await?;
        Ok(ParkedTotals {
            keys: row.get(0),
            events: row.get(1),
            oldest: row.get(2),
            dead_heads: row.get(3),
        })
    }

    /// Lets `key`'s parked events apply without its dead head (which an
    /// operator discarded): false when the key is not parked behind a dead
    /// head.
    pub async fn release_key(&self, key: &str) -> Result<bool, StoreError> {
        let client = self.pool.get().await?;
        Ok(client
            .execute(RELEASE, &[&self.consumer_group, &key])
            .await?
            == 1)
    }

    /// Removes `key` and every event parked behind it, in one transaction
    /// that commits only once `keep` kept them (written to a file, say):
    /// the events, oldest first. `None` when the key is not parked.
    pub async fn discard_key(
        &self,
        key: &str,
        keep: impl FnOnce(&[ParkedEvent]) -> std::io::Result<()>,
    ) -> Result<Option<Vec<ParkedEvent>>, DiscardError> {
        let mut client = self.pool.get().await.map_err(StoreError::from)?;
        let tx = client.transaction().await.map_err(StoreError::from)?;
        let locked = tx
            .query_opt(LOCK_KEY, &[&self.consumer_group, &key])
            .await
            .map_err(StoreError::from)?;
        if locked.is_none() {
            return Ok(None);
        }
        let events: Vec<ParkedEvent> = tx
            .query(DISCARD, &[&self.consumer_group, &key])
            .await
            .map_err(StoreError::from)?
            .iter()
            .map(parked_event)
            .collect();
        keep(&events).map_err(DiscardError::Keep)?;
        tx.execute(DROP_KEY, &[&self.consumer_group, &key])
            .await
            .map_err(StoreError::from)?;
        tx.commit().await.map_err(StoreError::from)?;
        Ok(Some(events))
    }
}

/// Why a parked key was not discarded: nothing was.
#[derive(Debug, thiserror::Error)]
pub enum DiscardError {
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The events could not be kept.
    #[error("cannot keep the parked events: {0}")]
    Keep(std::io::Error),
}

fn parked_event(row: &tokio_postgres::Row) -> ParkedEvent {
    ParkedEvent {
        event_id: row.get(0),
        queue: row.get(1),
        body: row.get(2),
        properties: row.get(3),
    }
}
