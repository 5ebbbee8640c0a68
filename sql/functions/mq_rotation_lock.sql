-- mq_rotation_lock as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- Key of the advisory lock that lets one opening of an epoch at a time
-- go on in a schema: "idmr" in ASCII, and the epoch table.
CREATE OR REPLACE FUNCTION mq_rotation_lock() RETURNS INTEGER[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY[x'69646d72'::integer, 'mq_consume_epoch'::regclass::oid::integer]
$$;
