//! The consume record: `INSERT … ON CONFLICT DO NOTHING` decides which
//! delivery owns an event's effect.

use deadpool_postgres::Transaction;

/// Inserts a record for each event; returns the ids that went in. An id that
/// is not returned was recorded before (or by a concurrent transaction that
/// committed first): a duplicate.
const INSERT: &str = "\
    INSERT INTO mq_consume_record (event_id, consumer_group) \
    SELECT event_id, $2 FROM unnest($1::varchar[]) AS claim(event_id) \
    ON CONFLICT ON CONSTRAINT uk_event_consumer DO NOTHING \
    RETURNING event_id";

pub(super) async fn insert(
    tx: &Transaction<'_>,
    event_ids: &[&str],
    consumer_group: &str,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let statement = tx.prepare_cached(INSERT).await?;
    let rows = tx.query(&statement, &[&event_ids, &consumer_group]).await?;
    rows.iter().map(|row| row.try_get(0)).collect()
}
