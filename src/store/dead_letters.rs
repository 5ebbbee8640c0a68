//! The dead-letter index (`mq_dead_letter`, migration 0010): what each
//! consumer group's dead-letter queue holds, one row per event id (or
//! digest of an invalid body) with a count of copies. The worker writes a
//! row before it rejects the delivery; a replay or a discard takes a copy
//! off once its ack is sent; a sync sets the rows to what the queue holds.
//! Counts, summaries and the pruner's hold read it instead of the queue.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use deadpool_postgres::GenericClient;
use sha2::{Digest, Sha256};

/// One dead letter, as the index keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// [`event_key`] or [`body_key`].
    pub key: String,
    /// Its event id, when the body is a valid event.
    pub event_id: Option<String>,
    /// The queue it died in.
    pub queue: String,
    /// Why (`rejected`, `delivery_limit`, …).
    pub reason: String,
    /// Why it failed, when the failure ledger does not say (an invalid
    /// body's description); the ledger's last error, where it has the
    /// event, takes precedence, as does its count of failures.
    pub error: Option<String>,
    /// A body the handler cannot decode.
    pub invalid: bool,
    /// When it died; `None` for now.
    pub dead_at: Option<SystemTime>,
    /// Its body, which the index keeps up to the store's limit for the
    /// console to show; `None` keeps nothing.
    pub body: Option<Vec<u8>>,
    /// Its properties and headers, as JSON.
    pub properties: Option<serde_json::Value>,
}

/// Most bytes of a letter's body the index keeps, unless told otherwise.
pub const KEPT_BODY_BYTES: usize = 64 * 1024;

/// What a handler sends when idem gives up on a message
/// ([`Handler::given_up`](crate::handler::Handler::given_up)): written once
/// per death of the letter `key`, one told apart from another by how often
/// the message was replayed before.
#[derive(Debug, Clone)]
pub(crate) struct GivenUpMessages {
    /// The letter's key in the index.
    pub(crate) key: String,
    /// Replays of the message before it died.
    pub(crate) replays: i64,
    /// The messages, in the order the handler gave them.
    pub(crate) messages: Vec<crate::handler::OutboxMessage>,
}

/// Claims the deaths of `given_up` (`mq_given_up`) that no earlier copy
/// claimed, and writes their messages to the outbox, in `tx`: the one that
/// records the letters in the index. Returns how many deaths sent.
pub(super) async fn write_given_up(
    tx: &impl GenericClient,
    consumer_group: &str,
    given_up: &[GivenUpMessages],
) -> Result<usize, tokio_postgres::Error> {
    let sending: Vec<&GivenUpMessages> =
        given_up.iter().filter(|g| !g.messages.is_empty()).collect();
    if sending.is_empty() {
        return Ok(0);
    }
    let keys: Vec<&str> = sending.iter().map(|g| g.key.as_str()).collect();
    let replays: Vec<i32> = sending
        .iter()
        .map(|g| i32::try_from(g.replays).unwrap_or(i32::MAX))
        .collect();
    let claim = tx
        .prepare_cached(
            "INSERT INTO mq_given_up (consumer_group, letter_key, replays) \
             SELECT $1, death.key, death.replays \
             FROM unnest($2::varchar[], $3::int[]) AS death(key, replays) ORDER BY 2, 3 \
             ON CONFLICT DO NOTHING RETURNING letter_key, replays",
        )
        .await?;
    let claimed: Vec<(String, i32)> = tx
        .query(&claim, &[&consumer_group, &keys, &replays])
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let deaths: Vec<(String, &GivenUpMessages)> = sending
        .iter()
        .filter(|g| {
            claimed
                .iter()
                .any(|(key, replays)| *key == g.key && i64::from(*replays) == g.replays)
        })
        .map(|g| (crate::handler::given_up_name(&g.key, g.replays), *g))
        .collect();
    // A death's messages are unordered: no event of the key follows it
    // through the outbox.
    let mut messages = Vec::new();
    for (name, death) in &deaths {
        for (index, message) in death.messages.iter().enumerate() {
            messages.push(crate::handler::outbox::Entry {
                event_id: name.as_str(),
                ordering_key: None,
                index,
                message: message.clone(),
            });
        }
    }
    super::outbox::write(tx, consumer_group, messages).await?;
    Ok(deaths.len())
}

/// The key of a valid event's letters.
pub fn event_key(event_id: &str) -> String {
    format!("event {event_id}")
}

/// The key of an invalid body's letters: the first 16 bytes of its SHA-256.
pub fn body_key(body: &[u8]) -> String {
    let hash = Sha256::digest(body);
    let mut key = String::with_capacity(5 + 32);
    key.push_str("body ");
    for byte in &hash[..16] {
        key.push_str(&format!("{byte:02x}"));
    }
    key
}

/// Longest error text kept, in characters.
const MAX_ERROR_CHARS: usize = 2000;

/// Adds copies of letters, one per element of `letters` (grouped by key:
/// one row each), each with the ledger's count and last error and whether
/// the group applied its event. `$10`: a row last touched before it is set
/// to the count given instead of adding to it (a sync's start;
/// `-infinity` adds).
const WRITE: &str = "\
    WITH applied AS (\
        SELECT recorded.event_id FROM mq_recorded(\
            ARRAY(SELECT id FROM unnest($3::varchar[]) AS id WHERE id IS NOT NULL), $1) \
            AS recorded) \
    INSERT INTO mq_dead_letter AS letter \
        (consumer_group, letter_key, event_id, queue, reason, failures, last_error, invalid, \
         copies, dead_at, applied, body, body_bytes, body_sha256, headers) \
    SELECT $1, given.key, given.event_id, given.queue, given.reason, \
           coalesce(ledger.failures, 0), coalesce(ledger.last_error, given.error), given.invalid, \
           given.copies, coalesce(given.dead_at, now()), \
           EXISTS (SELECT FROM applied WHERE applied.event_id = given.event_id), \
           given.body, given.body_bytes, given.body_sha256, given.headers \
    FROM unnest($2::varchar[], $3::varchar[], $4::varchar[], $5::varchar[], $6::text[], \
                $7::bool[], $8::int[], $9::timestamptz[], $11::bytea[], $12::int[], \
                $13::bytea[], $14::jsonb[]) \
        AS given(key, event_id, queue, reason, error, invalid, copies, dead_at, \
                 body, body_bytes, body_sha256, headers) \
    LEFT JOIN mq_failure_ledger AS ledger \
        ON ledger.consumer_group = $1 AND ledger.event_id = given.event_id \
    ORDER BY given.key \
    ON CONFLICT (consumer_group, letter_key) DO UPDATE \
    SET copies = CASE WHEN letter.touched_at < $10 THEN EXCLUDED.copies \
                      ELSE letter.copies + EXCLUDED.copies END, \
        event_id = EXCLUDED.event_id, queue = EXCLUDED.queue, reason = EXCLUDED.reason, \
        failures = EXCLUDED.failures, last_error = EXCLUDED.last_error, \
        invalid = EXCLUDED.invalid, dead_at = greatest(letter.dead_at, EXCLUDED.dead_at), \
        applied = EXCLUDED.applied, body = coalesce(EXCLUDED.body, letter.body), \
        body_bytes = coalesce(EXCLUDED.body_bytes, letter.body_bytes), \
        body_sha256 = coalesce(EXCLUDED.body_sha256, letter.body_sha256), \
        headers = coalesce(EXCLUDED.headers, letter.headers), touched_at = clock_timestamp()";

/// Takes copies off: a row whose every copy is taken goes.
const TAKE: &str = "\
    WITH taken AS (\
        SELECT key, count(*)::int AS n FROM unnest($2::varchar[]) AS taken(key) GROUP BY key), \
    gone AS (\
        DELETE FROM mq_dead_letter AS letter USING taken \
        WHERE letter.consumer_group = $1 AND letter.letter_key = taken.key \
          AND letter.copies <= taken.n \
        RETURNING 1) \
    UPDATE mq_dead_letter AS letter SET copies = letter.copies - taken.n FROM taken \
    WHERE letter.consumer_group = $1 AND letter.letter_key = taken.key \
      AND letter.copies > taken.n";

/// Writes `letters` into the index of `consumer_group`: one more copy
/// each, or, for a row last touched before `reset_before`, as many as
/// `letters` has of its key; the first `kept_body_bytes` of each body.
pub(super) async fn write(
    client: &impl GenericClient,
    consumer_group: &str,
    letters: &[DeadLetter],
    reset_before: Option<SystemTime>,
    kept_body_bytes: usize,
) -> Result<(), tokio_postgres::Error> {
    if letters.is_empty() {
        return Ok(());
    }
    // One row per key in a statement (ON CONFLICT updates a row once): the
    // copies of a key are counted, the last one's fields kept.
    let mut by_key: HashMap<&str, (usize, i32)> = HashMap::new();
    for (at, letter) in letters.iter().enumerate() {
        let entry = by_key.entry(&letter.key).or_insert((at, 0));
        entry.0 = at;
        entry.1 += 1;
    }
    let mut rows: Vec<(&DeadLetter, i32)> = by_key
        .into_values()
        .map(|(at, copies)| (&letters[at], copies))
        .collect();
    rows.sort_by(|a, b| a.0.key.cmp(&b.0.key));
    let keys: Vec<&str> = rows.iter().map(|(l, _)| l.key.as_str()).collect();
    let event_ids: Vec<Option<&str>> = rows.iter().map(|(l, _)| l.event_id.as_deref()).collect();
    let queues: Vec<&str> = rows.iter().map(|(l, _)| l.queue.as_str()).collect();
    let reasons: Vec<&str> = rows.iter().map(|(l, _)| l.reason.as_str()).collect();
    let errors: Vec<Option<String>> = rows
        .iter()
        .map(|(l, _)| {
            l.error
                .as_ref()
                .map(|e| e.chars().take(MAX_ERROR_CHARS).collect())
        })
        .collect();
    let invalid: Vec<bool> = rows.iter().map(|(l, _)| l.invalid).collect();
    let copies: Vec<i32> = rows.iter().map(|(_, n)| *n).collect();
    let dead_at: Vec<Option<SystemTime>> = rows.iter().map(|(l, _)| l.dead_at).collect();
    let bodies: Vec<Option<&[u8]>> = rows
        .iter()
        .map(|(l, _)| {
            let body = l.body.as_deref()?;
            (kept_body_bytes > 0).then(|| &body[..body.len().min(kept_body_bytes)])
        })
        .collect();
    let body_bytes: Vec<Option<i32>> = rows
        .iter()
        .map(|(l, _)| {
            l.body
                .as_ref()
                .map(|b| i32::try_from(b.len()).unwrap_or(i32::MAX))
        })
        .collect();
    let body_sha256: Vec<Option<Vec<u8>>> = rows
        .iter()
        .map(|(l, _)| l.body.as_ref().map(|b| Sha256::digest(b).to_vec()))
        .collect();
    let headers: Vec<Option<&serde_json::Value>> =
        rows.iter().map(|(l, _)| l.properties.as_ref()).collect();
    // Planned at each call, not prepared once: a plan made while the
    // ledger was small (scanning it whole for each letter) would stay with
    // the connection as the ledger grows, where autovacuum does not analyze
    // it.
    // No row was touched before 1970: each is added to.
    let reset_before = reset_before.unwrap_or(SystemTime::UNIX_EPOCH);
    client
        .execute(
            WRITE,
            &[
                &consumer_group,
                &keys,
                &event_ids,
                &queues,
                &reasons,
                &errors,
                &invalid,
                &copies,
                &dead_at,
                &reset_before,
                &bodies,
                &body_bytes,
                &body_sha256,
                &headers,
            ],
        )
        .await?;
    Ok(())
}

/// Takes one copy of each of `keys` (a key twice, two) off the index.
pub(super) async fn take(
    client: &impl GenericClient,
    consumer_group: &str,
    keys: &[&str],
) -> Result<(), tokio_postgres::Error> {
    if keys.is_empty() {
        return Ok(());
    }
    // Planned at each call, as `write`'s.
    client.execute(TAKE, &[&consumer_group, &keys]).await?;
    Ok(())
}

/// The database's clock, now: when a sync starts.
pub(super) async fn now(client: &impl GenericClient) -> Result<SystemTime, tokio_postgres::Error> {
    client
        .query_one("SELECT clock_timestamp()", &[])
        .await?
        .try_get(0)
}

/// Ends a sync that started at `started` and found `letters` letters:
/// removes the rows it neither found nor saw written meanwhile; returns
/// how many went.
pub(super) async fn synced(
    client: &impl GenericClient,
    consumer_group: &str,
    started: SystemTime,
    letters: i64,
) -> Result<u64, tokio_postgres::Error> {
    let removed = client
        .execute(
            "DELETE FROM mq_dead_letter WHERE consumer_group = $1 AND touched_at < $2",
            &[&consumer_group, &started],
        )
        .await?;
    client
        .execute(
            "INSERT INTO mq_dead_letter_sync (consumer_group, synced_at, letters) \
             VALUES ($1, $2, $3) \
             ON CONFLICT (consumer_group) DO UPDATE \
             SET synced_at = EXCLUDED.synced_at, letters = EXCLUDED.letters",
            &[&consumer_group, &started, &letters],
        )
        .await?;
    Ok(removed)
}

/// The index of a group at a glance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IndexTotals {
    /// Letters it counts (copies, summed).
    pub letters: i64,
    /// Of them, per reason of their death.
    pub reasons: BTreeMap<String, i64>,
    /// When it was last synced with the queue; `None` if never.
    pub synced_at: Option<SystemTime>,
}

/// How many letters the index of `consumer_group` counts, per reason, and
/// when it was last synced.
pub(super) async fn totals(
    client: &impl GenericClient,
    consumer_group: &str,
) -> Result<IndexTotals, tokio_postgres::Error> {
    let rows = client
        .query(
            // The tally the index's triggers keep: a row per reason.
            "SELECT reason, letters FROM mq_dead_letter_tally \
             WHERE consumer_group = $1 AND letters <> 0",
            &[&consumer_group],
        )
        .await?;
    let mut totals = IndexTotals::default();
    for row in rows {
        let letters: i64 = row.try_get(1)?;
        totals.letters += letters;
        totals.reasons.insert(row.try_get(0)?, letters);
    }
    totals.synced_at = client
        .query_opt(
            "SELECT synced_at FROM mq_dead_letter_sync WHERE consumer_group = $1",
            &[&consumer_group],
        )
        .await?
        .map(|row| row.try_get(0))
        .transpose()?;
    Ok(totals)
}

/// Which dead letters an action takes, and which rows of the index a
/// summary counts; every part must hold. The default takes them all.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// The reason of its latest death: `rejected`, `delivery_limit`, `expired`…
    pub reason: Option<String>,
    /// Its event id.
    pub event_id: Option<String>,
    /// Part of the ledger's last error (or, for a body the handler cannot
    /// decode, of why).
    pub error: Option<String>,
    /// Died longer ago than this.
    pub older_than: Option<Duration>,
    /// Died within this.
    pub newer_than: Option<Duration>,
    /// Only bodies the handler cannot decode (which can never apply).
    pub invalid: bool,
    /// Its failure group in the dead-letter index: the digest of its last
    /// error's fingerprint, as the console groups letters. A letter the
    /// index lacks is in none.
    pub group: Option<uuid::Uuid>,
    /// Only these letters (their keys in the dead-letter index); empty:
    /// any.
    pub keys: Vec<String>,
}

/// The rows that match, counted (copies).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexSummary {
    /// Letters that match.
    pub letters: i64,
    /// Per reason.
    pub reasons: BTreeMap<String, i64>,
    /// Per failure group, as the console groups letters (their last
    /// error's fingerprint: numbers, ids and quoted values taken out; an
    /// invalid body's is why it is invalid), the most letters first.
    pub groups: Vec<GroupCount>,
    /// The oldest death.
    pub oldest: Option<SystemTime>,
    /// The newest.
    pub newest: Option<SystemTime>,
    /// Valid events the group has not applied: a replay would apply them.
    pub would_apply: i64,
    /// Valid events the group applied already.
    pub applied: i64,
    /// Invalid bodies.
    pub invalid: i64,
}

/// One failure group's letters that match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupCount {
    /// The group (what `--group` takes).
    pub id: uuid::Uuid,
    /// Its fingerprint; empty when the ledger recorded no failure.
    pub fingerprint: String,
    /// Letters (copies) of it that match.
    pub letters: i64,
    /// Of them, invalid bodies.
    pub invalid: i64,
    /// Their last error, when they all have the same (the fingerprint
    /// leaves out what tells one from another).
    pub error: Option<String>,
}

/// The filter of a summary, over the index's rows (`letter`); an event's
/// row found by its key (`event_key`), however many rows the group has.
const MATCHING_ROWS: &str = "\
    letter.consumer_group = $1 \
    AND ($2::varchar IS NULL OR letter.reason = $2) \
    AND ($3::varchar IS NULL OR letter.event_id = $3) \
    AND ($3::varchar IS NULL OR letter.letter_key = 'event ' || $3) \
    AND ($4::text IS NULL OR strpos(coalesce(letter.last_error, ''), $4) > 0) \
    AND ($5::float8 IS NULL OR letter.dead_at < now() - make_interval(secs => $5)) \
    AND ($6::float8 IS NULL OR letter.dead_at >= now() - make_interval(secs => $6)) \
    AND (NOT $7 OR letter.invalid) \
    AND ($8::uuid IS NULL OR md5(letter.fingerprint)::uuid = $8) \
    AND (cardinality($9::varchar[]) = 0 OR letter.letter_key = ANY($9))";

/// The same filter over the tally's rows (`tally`), for a filter by
/// reason, error, group or invalid body only: `$3`, `$5` and `$6` are
/// null, `$9` empty. A tally row's group is its error's fingerprint.
const MATCHING_TALLY: &str = "\
    tally.consumer_group = $1 AND tally.letters <> 0 \
    AND ($2::varchar IS NULL OR tally.reason = $2) \
    AND ($3::varchar IS NULL) AND ($5::float8 IS NULL) AND ($6::float8 IS NULL) \
    AND ($4::text IS NULL OR strpos(tally.last_error, $4) > 0) \
    AND (NOT $7 OR tally.invalid) \
    AND ($8::uuid IS NULL OR md5(mq_error_fingerprint(tally.last_error))::uuid = $8) \
    AND (cardinality($9::varchar[]) = 0)";

/// A summary's counts, from the rows that match (a filter by event id or
/// by time).
const SUMMARY_OF_ROWS: &str = "\
    SELECT letter.reason, letter.fingerprint, \
           sum(letter.copies)::bigint, \
           coalesce(sum(letter.copies) FILTER (WHERE NOT letter.invalid AND NOT letter.applied), \
                    0)::bigint, \
           coalesce(sum(letter.copies) FILTER (WHERE letter.applied), 0)::bigint, \
           coalesce(sum(letter.copies) FILTER (WHERE letter.invalid), 0)::bigint, \
           md5(letter.fingerprint)::uuid, \
           min(coalesce(letter.last_error, '')), max(coalesce(letter.last_error, '')) \
    FROM mq_dead_letter AS letter \
    WHERE {MATCHING} \
    GROUP BY 1, 2";

/// The same counts from the tally the triggers keep: a row per reason and
/// last error, however many letters (no filter, or one by reason, error or
/// invalid body). `$3`, `$5` and `$6` are null.
const SUMMARY_OF_TALLY: &str = "\
    SELECT tally.reason, mq_error_fingerprint(tally.last_error), \
           sum(tally.letters)::bigint, \
           coalesce(sum(tally.letters) FILTER (WHERE NOT tally.invalid AND NOT tally.applied), \
                    0)::bigint, \
           coalesce(sum(tally.letters) FILTER (WHERE tally.applied), 0)::bigint, \
           coalesce(sum(tally.letters) FILTER (WHERE tally.invalid), 0)::bigint, \
           md5(mq_error_fingerprint(tally.last_error))::uuid, \
           min(coalesce(tally.last_error, '')), max(coalesce(tally.last_error, '')) \
    FROM mq_dead_letter_error_tally AS tally \
    WHERE {MATCHING} \
    GROUP BY 1, 2";

/// The oldest and the newest death that match, each the first match along
/// the index on `(consumer_group, dead_at)` from its end: without a filter,
/// one row read each.
const SUMMARY_SPAN: &str = "\
    SELECT (SELECT letter.dead_at FROM mq_dead_letter AS letter WHERE {MATCHING} \
            ORDER BY letter.dead_at LIMIT 1), \
           (SELECT letter.dead_at FROM mq_dead_letter AS letter WHERE {MATCHING} \
            ORDER BY letter.dead_at DESC LIMIT 1)";

/// The same for a filter the tally answers: the oldest and newest row of
/// each tally row that matches, along the index on `(consumer_group,
/// md5(last_error), dead_at)`. Matches far from either end of the group's
/// letters cost no more than those near.
const SUMMARY_SPAN_OF_TALLY: &str = "\
    SELECT min(oldest.dead_at), max(newest.dead_at) \
    FROM mq_dead_letter_error_tally AS tally \
    CROSS JOIN LATERAL (\
        SELECT letter.dead_at FROM mq_dead_letter AS letter \
        WHERE letter.consumer_group = $1 \
          AND md5(coalesce(letter.last_error, ''))::uuid = tally.error_digest \
          AND letter.reason = tally.reason AND letter.invalid = tally.invalid \
          AND letter.applied = tally.applied \
        ORDER BY letter.dead_at LIMIT 1) AS oldest \
    CROSS JOIN LATERAL (\
        SELECT letter.dead_at FROM mq_dead_letter AS letter \
        WHERE letter.consumer_group = $1 \
          AND md5(coalesce(letter.last_error, ''))::uuid = tally.error_digest \
          AND letter.reason = tally.reason AND letter.invalid = tally.invalid \
          AND letter.applied = tally.applied \
        ORDER BY letter.dead_at DESC LIMIT 1) AS newest \
    WHERE {MATCHING}";

/// The rows of `consumer_group` that match `filter`, counted: from the
/// tally when the filter is by reason, error or invalid body only, from the
/// rows otherwise.
pub(super) async fn summary(
    client: &impl GenericClient,
    consumer_group: &str,
    filter: &Filter,
) -> Result<IndexSummary, tokio_postgres::Error> {
    let seconds = |d: &Duration| d.as_secs_f64();
    let older_than = filter.older_than.as_ref().map(seconds);
    let newer_than = filter.newer_than.as_ref().map(seconds);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] = [
        &consumer_group,
        &filter.reason,
        &filter.event_id,
        &filter.error,
        &older_than,
        &newer_than,
        &filter.invalid,
        &filter.group,
        &filter.keys,
    ];
    let by_rows = filter.event_id.is_some()
        || older_than.is_some()
        || newer_than.is_some()
        || !filter.keys.is_empty();
    let counts = if by_rows {
        SUMMARY_OF_ROWS.replace("{MATCHING}", MATCHING_ROWS)
    } else {
        SUMMARY_OF_TALLY.replace("{MATCHING}", MATCHING_TALLY)
    };
    let rows = client.query(&counts, &params).await?;
    let mut summary = IndexSummary::default();
    // Per fingerprint: the group, its letters, its invalid ones, and its
    // least and greatest last error.
    let mut groups: BTreeMap<String, (uuid::Uuid, i64, i64, String, String)> = BTreeMap::new();
    for row in rows {
        let reason: String = row.try_get(0)?;
        let fingerprint: String = row.try_get(1)?;
        let letters: i64 = row.try_get(2)?;
        let invalid: i64 = row.try_get(5)?;
        summary.letters += letters;
        *summary.reasons.entry(reason).or_default() += letters;
        let id: uuid::Uuid = row.try_get(6)?;
        let (least, greatest): (String, String) = (row.try_get(7)?, row.try_get(8)?);
        let group = groups
            .entry(fingerprint)
            .or_insert_with(|| (id, 0, 0, least.clone(), greatest.clone()));
        group.1 += letters;
        group.2 += invalid;
        group.3 = group.3.clone().min(least);
        group.4 = group.4.clone().max(greatest);
        summary.would_apply += row.try_get::<_, i64>(3)?;
        summary.applied += row.try_get::<_, i64>(4)?;
        summary.invalid += invalid;
    }
    summary.groups = groups
        .into_iter()
        .map(
            |(fingerprint, (id, letters, invalid, least, greatest))| GroupCount {
                id,
                fingerprint,
                letters,
                invalid,
                error: (least == greatest).then_some(least),
            },
        )
        .collect();
    summary.groups.sort_by(|a, b| {
        b.letters
            .cmp(&a.letters)
            .then(a.fingerprint.cmp(&b.fingerprint))
    });
    if summary.letters > 0 {
        // Without a filter, the group's two ends.
        let unfiltered = filter.reason.is_none()
            && filter.error.is_none()
            && filter.group.is_none()
            && !filter.invalid;
        let span = if by_rows || unfiltered {
            SUMMARY_SPAN.replace("{MATCHING}", MATCHING_ROWS)
        } else {
            SUMMARY_SPAN_OF_TALLY.replace("{MATCHING}", MATCHING_TALLY)
        };
        let span = client.query_one(&span, &params).await?;
        summary.oldest = span.try_get(0)?;
        summary.newest = span.try_get(1)?;
    }
    Ok(summary)
}

/// The last error the index holds for each of `keys` that has one.
pub(super) async fn indexed(
    client: &impl GenericClient,
    consumer_group: &str,
    keys: &[&str],
) -> Result<HashMap<String, Indexed>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT letter_key, last_error, md5(fingerprint)::uuid FROM mq_dead_letter \
             WHERE consumer_group = $1 AND letter_key = ANY($2::varchar[])",
            &[&consumer_group, &keys],
        )
        .await?;
    rows.iter()
        .map(|row| {
            let indexed = Indexed {
                error: row.try_get(1)?,
                group: row.try_get(2)?,
            };
            Ok((row.try_get(0)?, indexed))
        })
        .collect()
}

/// What the index keeps of a letter that an action's filter may ask about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Indexed {
    /// The ledger's last error when it died (or why its body is invalid).
    pub error: Option<String>,
    /// Its failure group: the digest of its error's fingerprint.
    pub group: uuid::Uuid,
}

/// The oldest epoch holding a record of an event of `consumer_group` that
/// has a dead letter (a replay of it must stay a duplicate), and how many
/// such events there are.
pub(super) async fn held_epoch(
    client: &impl GenericClient,
    consumer_group: &str,
) -> Result<(Option<i32>, i64), tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT min(recorded.epoch), count(*) FROM mq_recorded(\
                 ARRAY(SELECT event_id FROM mq_dead_letter \
                       WHERE consumer_group = $1 AND event_id IS NOT NULL), $1) AS recorded",
            &[&consumer_group],
        )
        .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_events_and_bodies_never_meet() {
        assert_eq!(event_key("e-1"), "event e-1");
        let key = body_key(b"not json");
        assert!(key.starts_with("body "));
        assert_eq!(key.len(), 5 + 32);
        assert_eq!(key, body_key(b"not json"));
        assert_ne!(key, body_key(b"not json either"));
    }
}
