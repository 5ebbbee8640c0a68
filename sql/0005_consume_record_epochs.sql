-- The consume records, partitioned by epoch: the retention drops a closed
-- epoch's partition at once instead of deleting rows one by one, and the
-- claims insert into the current epoch's, smaller than the whole window.
--
-- PostgreSQL keeps a unique key per partition only, so the claim
-- (mq_claim) also looks into the closed partitions, and epochs change
-- under an advisory lock: a claim holds it shared for its transaction, and
-- opening an epoch (mq_open_epoch) holds it exclusively, so that it waits
-- for every claim that may still write to the partition it closes, and
-- every later claim sees what those wrote.

-- The epochs, the newest one current.
CREATE TABLE mq_consume_epoch (
    epoch     INTEGER     PRIMARY KEY,
    opened_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The records of today's layout become epoch 0, closed: renaming and a
-- constant column are changes to the catalog only; the check that every
-- row is in epoch 0 reads the table once, and lets the partition attach
-- without reading it again.
ALTER TABLE mq_consume_record RENAME TO mq_consume_record_0;
ALTER INDEX uk_event_consumer RENAME TO mq_consume_record_0_key;
ALTER TABLE mq_consume_record_0 ALTER COLUMN id DROP IDENTITY;
ALTER TABLE mq_consume_record_0 ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE mq_consume_record_0 ADD CONSTRAINT mq_consume_record_0_epoch CHECK (epoch = 0);
ALTER TABLE mq_consume_record_0 ALTER COLUMN epoch DROP DEFAULT;
INSERT INTO mq_consume_epoch (epoch, opened_at)
    SELECT 0, coalesce(min(consumed_at), now()) FROM mq_consume_record_0;

CREATE SEQUENCE mq_consume_record_id_seq CACHE 1000;
SELECT setval('mq_consume_record_id_seq', coalesce(max(id), 0) + 1, false)
    FROM mq_consume_record_0;

CREATE TABLE mq_consume_record (
    id             BIGINT       NOT NULL DEFAULT nextval('mq_consume_record_id_seq'),
    event_id       VARCHAR(128) COLLATE "C" NOT NULL,
    consumer_group VARCHAR(64)  COLLATE "C" NOT NULL,
    consumed_at    TIMESTAMPTZ  NOT NULL DEFAULT now(),
    epoch          INTEGER      NOT NULL
) PARTITION BY LIST (epoch);
ALTER SEQUENCE mq_consume_record_id_seq OWNED BY mq_consume_record.id;
ALTER TABLE mq_consume_record ATTACH PARTITION mq_consume_record_0 FOR VALUES IN (0);

-- Key of the advisory lock of a schema's epochs: idem's ("idem" in ASCII)
-- and the epoch table's, which is the schema's own.
CREATE FUNCTION mq_epoch_lock() RETURNS INTEGER[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY[x'6964656d'::integer, 'mq_consume_epoch'::regclass::oid::integer]
$$;

-- Opens the next epoch, its partition attached (which blocks no insert),
-- then current once every claim in flight has ended. Returns it.
CREATE FUNCTION mq_open_epoch() RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    opened    INTEGER;
    partition TEXT;
    lock      INTEGER[] := mq_epoch_lock();
BEGIN
    SELECT max(epoch) + 1 INTO opened FROM mq_consume_epoch;
    partition := 'mq_consume_record_' || opened;
    EXECUTE format('CREATE TABLE %I (LIKE mq_consume_record INCLUDING DEFAULTS)', partition);
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I UNIQUE (event_id, consumer_group)',
                   partition, partition || '_key');
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I PRIMARY KEY (id)',
                   partition, partition || '_pkey');
    EXECUTE format('ALTER TABLE mq_consume_record ATTACH PARTITION %I FOR VALUES IN (%s)',
                   partition, opened);
    PERFORM pg_advisory_xact_lock(lock[1], lock[2]);
    INSERT INTO mq_consume_epoch (epoch) VALUES (opened);
    RETURN opened;
END
$$;

-- The claim: a record in the current epoch for each id of event_ids (in
-- id order, so that concurrent claims take the unique index's locks in one
-- order) that no epoch holds yet; returns the ids that went in. Each
-- statement of a volatile function takes its own snapshot: taken after the
-- lock, it sees the current epoch and every record of the ones before. The
-- look into the other epochs is a subquery with a LIMIT, so that it stays
-- a lookup in their unique index: a partition not analyzed yet could
-- otherwise be read whole, for every batch.
CREATE FUNCTION mq_claim(event_ids VARCHAR[], consumer VARCHAR)
RETURNS SETOF VARCHAR LANGUAGE plpgsql AS $$
DECLARE
    current INTEGER;
    lock    INTEGER[] := mq_epoch_lock();
BEGIN
    PERFORM pg_advisory_xact_lock_shared(lock[1], lock[2]);
    SELECT max(epoch) INTO current FROM mq_consume_epoch;
    RETURN QUERY
        INSERT INTO mq_consume_record AS record (event_id, consumer_group, epoch)
        SELECT claim.event_id, consumer, current
        FROM unnest(event_ids) AS claim(event_id)
        WHERE (SELECT 1 FROM mq_consume_record AS older
               WHERE older.epoch < current
                 AND older.event_id = claim.event_id AND older.consumer_group = consumer
               LIMIT 1) IS NULL
        ORDER BY claim.event_id
        ON CONFLICT DO NOTHING
        RETURNING record.event_id;
END
$$;

-- New inserts go to a partition of their own at once; a table that held
-- no records needs no epoch 0.
SELECT mq_open_epoch();
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM mq_consume_record_0) THEN
        DROP TABLE mq_consume_record_0;
        DELETE FROM mq_consume_epoch WHERE epoch = 0;
    END IF;
END
$$;
