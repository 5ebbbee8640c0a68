//! The consume record: `INSERT … ON CONFLICT DO NOTHING` decides which
//! delivery owns an event's effect.

/// The `claimed` step of the apply statement: a consume record for each
/// event id of `$1` (distinct) in consumer group `$2`, inserted in id order
/// so that concurrent batches take the unique index's locks in one order.
/// Yields the ids that went in; an id it does not yield was recorded before
/// (or by a concurrent transaction that committed first): a duplicate.
pub(super) const CLAIMED: &str = "\
    claimed AS (\
        INSERT INTO mq_consume_record (event_id, consumer_group) \
        SELECT event_id, $2 FROM unnest($1::varchar[]) AS claim(event_id) ORDER BY event_id \
        ON CONFLICT ON CONSTRAINT uk_event_consumer DO NOTHING \
        RETURNING event_id)";
