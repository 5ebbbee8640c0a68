-- mq_epoch_lock as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- Key of the advisory lock of a schema's epochs: idem's ("idem" in ASCII)
-- and the epoch table's, which is the schema's own.
CREATE OR REPLACE FUNCTION mq_epoch_lock() RETURNS INTEGER[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY[x'6964656d'::integer, 'mq_consume_epoch'::regclass::oid::integer]
$$;
