-- The consume records' partitions lose their primary key on `id`: the
-- digest's unique index is the key a claim looks up and the one that makes
-- a redelivery a no-op, and nothing reads a record by `id` (an epoch counts
-- its records by the sequence's value, `mq_consume_epoch.first_id`). The
-- second index cost every claim an insert into it: with it gone, one round
-- of `idem bench --messages 400000 --modes batch` measured PostgreSQL's CPU
-- per message at 9.4 µs against 11.4, and WAL per message at 351 B
-- against 419. `mq_open_epoch` (sql/functions) no longer adds it to the
-- partitions it opens.
--
-- Dropping an index takes its partition's lock for a moment: claims in
-- flight into that partition finish first, and those that come meanwhile
-- wait for it.
DO $$
DECLARE
    key RECORD;
BEGIN
    FOR key IN
        SELECT constraints.conrelid::regclass AS partition, constraints.conname AS name
        FROM pg_inherits
        JOIN pg_constraint AS constraints ON constraints.conrelid = pg_inherits.inhrelid
        WHERE pg_inherits.inhparent = 'mq_consume_record'::regclass
          AND constraints.contype = 'p'
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', key.partition, key.name);
    END LOOP;
END
$$;
