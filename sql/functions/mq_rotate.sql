-- mq_rotate as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- Opens the next epoch if the current one has taken `max_records` records
-- or more; returns it, or NULL. Several workers may ask at once: the
-- first opens it, the others find the new epoch below the limit.
CREATE OR REPLACE FUNCTION mq_rotate(max_records BIGINT) RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    rotation INTEGER[] := mq_rotation_lock();
    taken    BIGINT;
BEGIN
    PERFORM pg_advisory_xact_lock(rotation[1], rotation[2]);
    SELECT (SELECT last_value FROM mq_consume_record_id_seq) - first_id INTO taken
        FROM mq_consume_epoch ORDER BY epoch DESC LIMIT 1;
    IF taken < max_records THEN
        RETURN NULL;
    END IF;
    RETURN mq_open_epoch();
END
$$;
