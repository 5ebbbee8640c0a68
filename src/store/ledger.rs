//! The failure ledger: how often each event's transaction genuinely failed
//! for a consumer group, and why, last.

use std::collections::HashMap;
use std::time::SystemTime;

use deadpool_postgres::GenericClient;

/// One event's failures, as `requeue --dry-run` shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    /// Genuine failures recorded.
    pub failures: i32,
    /// When the first was recorded.
    pub first_failed_at: SystemTime,
    /// When the last was recorded.
    pub last_failed_at: SystemTime,
    /// The error of the last.
    pub last_error: String,
}

/// Longest error text kept, in characters.
const MAX_ERROR_CHARS: usize = 2000;

const RECORD: &str = "\
    INSERT INTO mq_failure_ledger (event_id, consumer_group, failures, last_error) \
    VALUES ($1, $2, 1, $3) \
    ON CONFLICT (event_id, consumer_group) DO UPDATE \
    SET failures = mq_failure_ledger.failures + 1, last_failed_at = now(), \
        last_error = EXCLUDED.last_error \
    RETURNING failures";

/// The `cleared` step of the apply statement: forgets the failures of the
/// events of `$1` in consumer group `$2`, which are being applied now.
pub(super) const CLEARED: &str = "\
    cleared AS (\
        DELETE FROM mq_failure_ledger \
        WHERE consumer_group = $2 AND event_id = ANY($1::varchar[]))";

/// A row of an event recorded since is left by a copy that failed while
/// another was applied: that event is applied, not out of attempts.
const EXHAUSTED: &str = "\
    SELECT event_id FROM mq_failure_ledger \
    WHERE consumer_group = $2 AND event_id = ANY($1::varchar[]) AND failures >= $3 \
      AND event_id NOT IN (\
          SELECT recorded.event_id FROM mq_recorded($1::varchar[], $2::varchar) AS recorded)";

const ENTRIES: &str = "\
    SELECT event_id, failures, first_failed_at, last_failed_at, last_error \
    FROM mq_failure_ledger WHERE consumer_group = $2 AND event_id = ANY($1::varchar[])";

pub(super) const RESET: &str = "\
    DELETE FROM mq_failure_ledger WHERE consumer_group = $2 AND event_id = ANY($1::varchar[])";

/// Counts one more failure of `event_id`; returns the count.
pub(super) async fn record(
    client: &impl GenericClient,
    event_id: &str,
    consumer_group: &str,
    error: &str,
) -> Result<i32, tokio_postgres::Error> {
    let error: String = error.chars().take(MAX_ERROR_CHARS).collect();
    let statement = client.prepare_cached(RECORD).await?;
    let row = client
        .query_one(&statement, &[&event_id, &consumer_group, &error])
        .await?;
    row.try_get(0)
}

/// The events among `event_ids` that failed `max_failures` times or more.
pub(super) async fn exhausted(
    client: &impl GenericClient,
    event_ids: &[&str],
    consumer_group: &str,
    max_failures: i32,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let statement = client.prepare_cached(EXHAUSTED).await?;
    let rows = client
        .query(&statement, &[&event_ids, &consumer_group, &max_failures])
        .await?;
    rows.iter().map(|row| row.try_get(0)).collect()
}

/// The ledger's rows of `event_ids`, by event id.
pub(super) async fn entries(
    client: &impl GenericClient,
    event_ids: &[&str],
    consumer_group: &str,
) -> Result<HashMap<String, LedgerEntry>, tokio_postgres::Error> {
    let statement = client.prepare_cached(ENTRIES).await?;
    let rows = client
        .query(&statement, &[&event_ids, &consumer_group])
        .await?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get(0)?,
                LedgerEntry {
                    failures: row.try_get(1)?,
                    first_failed_at: row.try_get(2)?,
                    last_failed_at: row.try_get(3)?,
                    last_error: row.try_get(4)?,
                },
            ))
        })
        .collect()
}

/// Forgets the failures of `event_ids`: they are being applied, or replayed
/// with a fresh budget.
pub(super) async fn reset(
    client: &impl GenericClient,
    event_ids: &[&str],
    consumer_group: &str,
) -> Result<(), tokio_postgres::Error> {
    let statement = client.prepare_cached(RESET).await?;
    client
        .execute(&statement, &[&event_ids, &consumer_group])
        .await?;
    Ok(())
}
