-- mq_recorded as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- The epoch of each of `event_ids` that consumer group `consumer` recorded
-- (one at most: a claim never records an id an older epoch holds), each a
-- lookup in one unique index, as in the claim.
CREATE OR REPLACE FUNCTION mq_recorded(event_ids VARCHAR[], consumer VARCHAR)
RETURNS TABLE (event_id VARCHAR, epoch INTEGER) LANGUAGE plpgsql STABLE AS $$
DECLARE
    keyed   INTEGER;
    by_text BOOLEAN;
BEGIN
    SELECT min(e.epoch) FILTER (WHERE by_digest), bool_or(NOT by_digest) INTO keyed, by_text
        FROM mq_consume_epoch AS e;
    RETURN QUERY
        SELECT id.event_id, found.epoch
        FROM unnest(event_ids) AS id(event_id)
        CROSS JOIN LATERAL (
            SELECT record.epoch FROM mq_consume_record AS record
            WHERE record.epoch >= keyed
              AND record.digest = mq_digest(consumer, id.event_id)
              AND record.event_id = id.event_id
            LIMIT 1) AS found;
    IF by_text THEN
        RETURN QUERY
            SELECT id.event_id, found.epoch
            FROM unnest(event_ids) AS id(event_id)
            CROSS JOIN LATERAL (
                SELECT record.epoch FROM mq_consume_record AS record
                WHERE record.epoch < keyed
                  AND record.event_id = id.event_id AND record.consumer_group = consumer
                LIMIT 1) AS found;
    END IF;
END
$$;
