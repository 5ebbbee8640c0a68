//! What the console reads and writes: failure groups, a group's letters,
//! one letter, dead-lettering per hour, and the audit of what operators
//! did (migration 0015). Each read costs what an index or a tally makes
//! it cost, however many letters the queue holds.

use std::time::SystemTime;

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;
use uuid::Uuid;

/// A failure group: the letters whose last error has one fingerprint.
#[derive(Debug, Clone)]
pub struct Group {
    /// The digest of its fingerprint.
    pub id: Uuid,
    /// The error with numbers, ids and quoted values taken out.
    pub fingerprint: String,
    /// Letters (copies).
    pub letters: i64,
    /// Of them, events a replay would apply.
    pub would_apply: i64,
    /// Events applied already: a replay is acked as a duplicate.
    pub applied: i64,
    /// Bodies the handler cannot decode: a replay leaves them.
    pub invalid: i64,
    /// The oldest and newest death.
    pub first: Option<SystemTime>,
    /// The newest death.
    pub last: Option<SystemTime>,
    /// The newest letter's key and error, as a sample.
    pub sample: Option<(String, Option<String>)>,
}

/// Which letters of a group a page shows, or an action takes.
#[derive(Debug, Clone, Default)]
pub struct Search {
    /// This event id.
    pub event_id: Option<String>,
    /// Part of the last error.
    pub error: Option<String>,
    /// Died at or after.
    pub from: Option<SystemTime>,
    /// Died before.
    pub to: Option<SystemTime>,
}

/// A letter in a listing.
#[derive(Debug, Clone)]
pub struct LetterRow {
    /// Its key in the index.
    pub key: String,
    /// Its event id.
    pub event_id: Option<String>,
    /// Why it died.
    pub reason: String,
    /// Its last error.
    pub error: Option<String>,
    /// Copies.
    pub copies: i32,
    /// When it died (the newest copy).
    pub dead_at: SystemTime,
    /// An invalid body.
    pub invalid: bool,
    /// Applied when indexed.
    pub applied: bool,
}

/// One letter, whole.
#[derive(Debug, Clone)]
pub struct Letter {
    /// What a listing shows of it.
    pub row: LetterRow,
    /// The queue it died in.
    pub queue: String,
    /// Its failure group.
    pub group: Uuid,
    /// Failures the ledger counted when it died.
    pub failures: i32,
    /// The body as kept (up to the worker's limit), its size and SHA-256.
    pub body: Option<Vec<u8>>,
    /// The whole body's size.
    pub body_bytes: Option<i32>,
    /// The whole body's SHA-256.
    pub body_sha256: Option<Vec<u8>>,
    /// Its properties and headers.
    pub headers: Option<serde_json::Value>,
    /// What the failure ledger holds now: failures, last error, first and
    /// last failure.
    pub ledger: Option<(i32, String, Option<SystemTime>, Option<SystemTime>)>,
    /// Whether the group has applied its event by now.
    pub applied_now: Option<bool>,
}

/// One action taken from the console.
#[derive(Debug, Clone)]
pub struct Audited {
    /// Its number.
    pub id: i64,
    /// The consumer group.
    pub consumer_group: String,
    /// `replay`, `discard`, `edit`, `release`, `login`.
    pub action: String,
    /// Who.
    pub who: String,
    /// Which letters, described.
    pub filter: String,
    /// How many the dry run counted.
    pub expected: i64,
    /// When it started.
    pub started_at: SystemTime,
    /// When it ended; `None` while it runs (or if its process died).
    pub finished_at: Option<SystemTime>,
    /// Letters acted on.
    pub letters: Option<i64>,
    /// How it ended.
    pub outcome: Option<String>,
    /// Where a discard wrote the letters first.
    pub file: Option<String>,
    /// An edit's bodies: the letter's as it died, and the one replayed in
    /// its place.
    pub edit: Option<(Vec<u8>, Vec<u8>)>,
}

/// The groups of a consumer group, most letters first, `limit` from
/// `offset`; and how many groups there are.
pub async fn groups(
    client: &impl GenericClient,
    consumer_group: &str,
    offset: i64,
    limit: i64,
) -> Result<(Vec<Group>, i64), tokio_postgres::Error> {
    let rows = client
        .query(
            &format!(
                "WITH grp AS ({GROUPS}) SELECT grp.*, {ENDS} \
                 ORDER BY grp.letters DESC, grp.group_id LIMIT $3 OFFSET $2"
            ),
            &[&consumer_group, &offset, &limit],
        )
        .await?;
    let count: i64 = client
        .query_one(
            "SELECT count(DISTINCT group_id) FROM mq_dead_letter_group \
             WHERE consumer_group = $1",
            &[&consumer_group],
        )
        .await?
        .try_get(0)?;
    Ok((rows.iter().map(group).collect::<Result<_, _>>()?, count))
}

/// One group, if it has letters.
pub async fn group_by_id(
    client: &impl GenericClient,
    consumer_group: &str,
    id: Uuid,
) -> Result<Option<Group>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            &format!("WITH grp AS ({GROUPS} HAVING group_id = $2) SELECT grp.*, {ENDS}"),
            &[&consumer_group, &id],
        )
        .await?;
    row.as_ref().map(group).transpose()
}

/// A group's tally rows summed: `$1` the consumer group.
const GROUPS: &str = "\
    SELECT group_id, min(fingerprint) AS fingerprint, sum(letters)::bigint AS letters, \
           coalesce(sum(letters) FILTER (WHERE NOT invalid AND NOT applied), 0)::bigint, \
           coalesce(sum(letters) FILTER (WHERE applied), 0)::bigint, \
           coalesce(sum(letters) FILTER (WHERE invalid), 0)::bigint \
    FROM mq_dead_letter_group WHERE consumer_group = $1 GROUP BY group_id";

/// A group's first and last death and its newest letter, each one row read
/// along the index on `(consumer_group, md5(fingerprint), dead_at)`.
const ENDS: &str = "\
    (SELECT dead_at FROM mq_dead_letter AS letter \
     WHERE letter.consumer_group = $1 AND md5(letter.fingerprint)::uuid = grp.group_id \
     ORDER BY dead_at LIMIT 1), \
    newest.dead_at, newest.letter_key, newest.last_error \
    FROM grp LEFT JOIN LATERAL (\
        SELECT dead_at, letter_key, last_error FROM mq_dead_letter AS letter \
        WHERE letter.consumer_group = $1 AND md5(letter.fingerprint)::uuid = grp.group_id \
        ORDER BY dead_at DESC LIMIT 1) AS newest ON true";

fn group(row: &Row) -> Result<Group, tokio_postgres::Error> {
    let key: Option<String> = row.try_get(8)?;
    Ok(Group {
        id: row.try_get(0)?,
        fingerprint: row.try_get(1)?,
        letters: row.try_get(2)?,
        would_apply: row.try_get(3)?,
        applied: row.try_get(4)?,
        invalid: row.try_get(5)?,
        first: row.try_get(6)?,
        last: row.try_get(7)?,
        sample: key
            .map(|key| Ok::<_, tokio_postgres::Error>((key, row.try_get(9)?)))
            .transpose()?,
    })
}

/// Most letters a page's search looks at: a search that few letters match
/// goes on from where it stopped on the next page, so that a page costs
/// the same with a million letters as with a hundred thousand.
pub const SEARCHED: i64 = 100_000;

/// A page of a group's letters.
#[derive(Debug, Clone)]
pub struct LetterPage {
    /// The letters that match, newest first.
    pub letters: Vec<LetterRow>,
    /// Where the next page starts (the death and key of the last letter
    /// looked at), when there may be more.
    pub next: Option<(SystemTime, String)>,
    /// The page stopped at [`SEARCHED`] letters looked at, short of a
    /// whole page of matches.
    pub searched_out: bool,
}

/// The letters of `group` that match `search`, newest first, at most
/// `limit` of them, after `after` (where the page before ended: a death
/// and a key), looking at no more than [`SEARCHED`] letters.
pub async fn letters(
    client: &mut deadpool_postgres::Client,
    consumer_group: &str,
    group: Uuid,
    search: &Search,
    after: Option<(SystemTime, String)>,
    limit: i64,
) -> Result<LetterPage, tokio_postgres::Error> {
    let (after_at, after_key) = after.unzip();
    if let Some(event_id) = &search.event_id {
        // One letter at most: found by its key.
        let rows = client
            .query(
                "SELECT letter_key, event_id, reason, last_error, copies, dead_at, invalid, \
                        applied \
                 FROM mq_dead_letter \
                 WHERE consumer_group = $1 AND letter_key = 'event ' || $2::varchar \
                   AND md5(fingerprint)::uuid = $3 \
                   AND ($4::timestamptz IS NULL OR dead_at >= $4) \
                   AND ($5::timestamptz IS NULL OR dead_at < $5) \
                   AND ($6::text IS NULL OR strpos(coalesce(last_error, ''), $6) > 0)",
                &[
                    &consumer_group,
                    event_id,
                    &group,
                    &search.from,
                    &search.to,
                    &search.error,
                ],
            )
            .await?;
        return Ok(LetterPage {
            letters: rows.iter().map(letter_row).collect::<Result<_, _>>()?,
            next: None,
            searched_out: false,
        });
    }
    let tx = client.transaction().await?;
    // Along the group's index from its newest end, whatever the planner
    // guesses of a table its statistics do not know yet (a sort of the
    // whole group instead costs a third of a second with a million).
    tx.batch_execute("SET LOCAL enable_sort = off").await?;
    let range = "consumer_group = $1 AND md5(fingerprint)::uuid = $2 \
        AND ($3::timestamptz IS NULL OR dead_at >= $3) \
        AND ($4::timestamptz IS NULL OR dead_at < $4) \
        AND (dead_at, letter_key) < (coalesce($5::timestamptz, 'infinity'), coalesce($6::varchar, ''))";
    // The range's parameters, and how many letters it looks at ($7).
    let looked: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [
        &consumer_group,
        &group,
        &search.from,
        &search.to,
        &after_at,
        &after_key,
        &SEARCHED,
    ];
    let rows = tx
        .query(
            &format!(
                "SELECT * FROM (\
                     SELECT letter_key, event_id, reason, last_error, copies, dead_at, invalid, \
                            applied \
                     FROM mq_dead_letter WHERE {range} \
                     ORDER BY dead_at DESC, letter_key DESC LIMIT $7::bigint) AS looked \
                 WHERE ($8::text IS NULL OR strpos(coalesce(last_error, ''), $8) > 0) \
                 LIMIT $9"
            ),
            &[&looked[..], &[&search.error, &limit]].concat(),
        )
        .await?;
    let mut letters: Vec<LetterRow> = rows.iter().map(letter_row).collect::<Result<_, _>>()?;
    letters.sort_by(|a, b| (b.dead_at, &b.key).cmp(&(a.dead_at, &a.key)));
    let full = i64::try_from(letters.len()).unwrap_or(i64::MAX) >= limit;
    let (next, searched_out) = if full {
        (letters.last().map(|l| (l.dead_at, l.key.clone())), false)
    } else {
        // Short of a page: the search looked at every letter, or stopped
        // at its bound; then the next page goes on from the last one.
        let last = tx
            .query_opt(
                &format!(
                    "SELECT dead_at, letter_key FROM mq_dead_letter WHERE {range} \
                     ORDER BY dead_at DESC, letter_key DESC OFFSET $7::bigint - 1 LIMIT 1"
                ),
                &looked,
            )
            .await?;
        match last {
            Some(row) => (Some((row.try_get(0)?, row.try_get(1)?)), true),
            None => (None, false),
        }
    };
    tx.commit().await?;
    Ok(LetterPage {
        letters,
        next,
        searched_out,
    })
}

fn letter_row(row: &Row) -> Result<LetterRow, tokio_postgres::Error> {
    Ok(LetterRow {
        key: row.try_get(0)?,
        event_id: row.try_get(1)?,
        reason: row.try_get(2)?,
        error: row.try_get(3)?,
        copies: row.try_get(4)?,
        dead_at: row.try_get(5)?,
        invalid: row.try_get(6)?,
        applied: row.try_get(7)?,
    })
}

/// One letter with what the ledger and the consume records say of it now.
pub async fn letter(
    client: &impl GenericClient,
    consumer_group: &str,
    key: &str,
) -> Result<Option<Letter>, tokio_postgres::Error> {
    let Some(row) = client
        .query_opt(
            "SELECT letter.letter_key, letter.event_id, letter.reason, letter.last_error, \
                    letter.copies, letter.dead_at, letter.invalid, letter.applied, \
                    letter.queue, md5(letter.fingerprint)::uuid, letter.failures, letter.body, \
                    letter.body_bytes, letter.body_sha256, letter.headers, \
                    ledger.failures, ledger.last_error, ledger.first_failed_at, \
                    ledger.last_failed_at, \
                    CASE WHEN letter.event_id IS NULL THEN NULL ELSE EXISTS (\
                        SELECT FROM mq_recorded(ARRAY[letter.event_id], $1)) END \
             FROM mq_dead_letter AS letter \
             LEFT JOIN mq_failure_ledger AS ledger \
               ON ledger.consumer_group = $1 AND ledger.event_id = letter.event_id \
             WHERE letter.consumer_group = $1 AND letter.letter_key = $2",
            &[&consumer_group, &key],
        )
        .await?
    else {
        return Ok(None);
    };
    let ledger_failures: Option<i32> = row.try_get(15)?;
    Ok(Some(Letter {
        row: letter_row(&row)?,
        queue: row.try_get(8)?,
        group: row.try_get(9)?,
        failures: row.try_get(10)?,
        body: row.try_get(11)?,
        body_bytes: row.try_get(12)?,
        body_sha256: row.try_get(13)?,
        headers: row.try_get(14)?,
        ledger: match ledger_failures {
            Some(failures) => Some((
                failures,
                row.try_get(16)?,
                row.try_get(17)?,
                row.try_get(18)?,
            )),
            None => None,
        },
        applied_now: row.try_get(19)?,
    }))
}

/// The schema's other consumer groups (those with dead letters, failing
/// events, parked keys or workers on slots), by name, with their dead
/// letters; at most `limit`.
pub async fn other_groups(
    client: &impl GenericClient,
    consumer_group: &str,
    limit: i64,
) -> Result<Vec<(String, i64)>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT known.name::text, coalesce((SELECT sum(tally.letters) \
                 FROM mq_dead_letter_tally AS tally WHERE tally.consumer_group = known.name), 0)::bigint \
             FROM (SELECT consumer_group FROM mq_dead_letter_tally \
                   UNION SELECT consumer_group FROM mq_failure_ledger \
                   UNION SELECT consumer_group FROM mq_parked_key \
                   UNION SELECT consumer_group FROM mq_slot_member) AS known(name) \
             WHERE known.name <> $1 ORDER BY known.name LIMIT $2",
            &[&consumer_group, &limit],
        )
        .await?;
    rows.iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect()
}

/// Letters that came into the index per hour since `since`, oldest first.
pub async fn hourly(
    client: &impl GenericClient,
    consumer_group: &str,
    since: SystemTime,
) -> Result<Vec<(SystemTime, i64)>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT hour, letters FROM mq_dead_letter_hourly \
             WHERE consumer_group = $1 AND hour >= $2 ORDER BY hour",
            &[&consumer_group, &since],
        )
        .await?;
    rows.iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect()
}

/// Records that an action starts; returns its number.
pub async fn audit_start(
    client: &impl GenericClient,
    started: &Audited,
) -> Result<i64, tokio_postgres::Error> {
    let row = client
        .query_one(
            "INSERT INTO idem_console_audit \
                 (consumer_group, action, who, filter, expected, file, body_before, body_after) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id",
            &[
                &started.consumer_group,
                &started.action,
                &started.who,
                &started.filter,
                &started.expected,
                &started.file,
                &started.edit.as_ref().map(|(before, _)| before),
                &started.edit.as_ref().map(|(_, after)| after),
            ],
        )
        .await?;
    row.try_get(0)
}

/// Records how action `id` ended.
pub async fn audit_end(
    client: &impl GenericClient,
    id: i64,
    letters: i64,
    outcome: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "UPDATE idem_console_audit SET finished_at = now(), letters = $2, outcome = $3 \
             WHERE id = $1",
            &[&id, &letters, &outcome],
        )
        .await?;
    Ok(())
}

/// The newest actions, `limit` of them before action `before`.
pub async fn audit(
    client: &impl GenericClient,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<Audited>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id, consumer_group, action, who, filter, expected, started_at, \
                    finished_at, letters, outcome, file, body_before, body_after \
             FROM idem_console_audit WHERE ($1::bigint IS NULL OR id < $1) \
             ORDER BY id DESC LIMIT $2",
            &[&before, &limit],
        )
        .await?;
    rows.iter().map(audited).collect()
}

/// Action `id`.
pub async fn audited_by_id(
    client: &impl GenericClient,
    id: i64,
) -> Result<Option<Audited>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT id, consumer_group, action, who, filter, expected, started_at, \
                    finished_at, letters, outcome, file, body_before, body_after \
             FROM idem_console_audit WHERE id = $1",
            &[&id],
        )
        .await?;
    row.as_ref().map(audited).transpose()
}

fn audited(row: &Row) -> Result<Audited, tokio_postgres::Error> {
    Ok(Audited {
        id: row.try_get(0)?,
        consumer_group: row.try_get(1)?,
        action: row.try_get(2)?,
        who: row.try_get(3)?,
        filter: row.try_get(4)?,
        expected: row.try_get(5)?,
        started_at: row.try_get(6)?,
        finished_at: row.try_get(7)?,
        letters: row.try_get(8)?,
        outcome: row.try_get(9)?,
        file: row.try_get(10)?,
        edit: match (row.try_get(11)?, row.try_get(12)?) {
            (Some(before), Some(after)) => Some((before, after)),
            _ => None,
        },
    })
}
