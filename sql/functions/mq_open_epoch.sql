-- mq_open_epoch as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- Opens the next epoch, its partition attached (which blocks no insert),
-- then current once every claim in flight has ended; returns it.
--
-- A closed epoch's partition refuses new records, so that a claim may
-- insert straight into the epoch it believes current, without the shared
-- lock and the read of `mq_consume_epoch` that mq_claim pays in every
-- transaction (most of per-message mode's cost over a plain insert).
-- Opening an epoch adds `CHECK (false) NOT VALID` to the partition of the
-- one it closes, after taking the epochs' lock exclusively (so after
-- every claim of mq_claim in flight has ended). The constraint takes that
-- partition's lock exclusively too: it waits for every insert in flight
-- into it, and an insert that comes later fails (check_violation), its
-- worker then claiming through mq_claim, which reads the new epoch. The
-- constraint is NOT VALID: the records already there are not read, and
-- the planner does not use it to skip the partition, which claims still
-- look into. A worker claims straight only when it holds the filter of
-- every closed epoch keyed by digest (it knows which of them may hold the
-- event) and no epoch is keyed by text; anything else goes through
-- mq_claim, as before.
--
-- A partition's one index is the digest's unique key: no primary key on
-- `id`, which nothing reads a record by (migration 0016).
CREATE OR REPLACE FUNCTION mq_open_epoch() RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    was       INTEGER;
    opened    INTEGER;
    partition TEXT;
    rotation  INTEGER[] := mq_rotation_lock();
    lock      INTEGER[] := mq_epoch_lock();
BEGIN
    PERFORM pg_advisory_xact_lock(rotation[1], rotation[2]);
    SELECT max(epoch) INTO was FROM mq_consume_epoch;
    opened := was + 1;
    partition := 'mq_consume_record_' || opened;
    EXECUTE format('CREATE TABLE %I (LIKE mq_consume_record INCLUDING DEFAULTS)', partition);
    EXECUTE format('ALTER TABLE %I ALTER COLUMN digest SET NOT NULL', partition);
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I UNIQUE (digest)',
                   partition, partition || '_key');
    EXECUTE format('ALTER TABLE mq_consume_record ATTACH PARTITION %I FOR VALUES IN (%s)',
                   partition, opened);
    PERFORM pg_advisory_xact_lock(lock[1], lock[2]);
    PERFORM mq_close_partition(was);
    INSERT INTO mq_consume_epoch (epoch, by_digest, first_id)
        VALUES (opened, true, (SELECT last_value FROM mq_consume_record_id_seq));
    RETURN opened;
END
$$;
