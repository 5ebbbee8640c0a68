-- Filters of the closed epochs, and epochs that close by size.
--
-- A claim used to look every event up in every closed epoch: a random
-- page of an index far larger than the buffer cache, for each new event.
-- A closed epoch no longer changes (its last claim ended before the next
-- epoch opened), so a Bloom filter of its digests, built once, stays
-- true: a worker holds the filters, and a claim looks into a closed epoch
-- only for the events its filter may hold (about one in a thousand that
-- it does not), and into every closed epoch no filter covers, as before.
--
-- With the closed epochs that cheap, the current one can stay small, so
-- that its index stays in memory: a worker opens the next epoch once the
-- current one has taken a number of records (mq_rotate), besides the
-- retention's opening by age.

-- Where the id sequence stood when an epoch opened: how many records it
-- has taken since is the sequence's progress (an overestimate: a
-- duplicate or a rollback spends an id too).
ALTER TABLE mq_consume_epoch ADD COLUMN first_id BIGINT;
DO $$
DECLARE
    opened INTEGER;
BEGIN
    FOR opened IN SELECT epoch FROM mq_consume_epoch LOOP
        -- A lookup in the partition's primary key.
        EXECUTE format('UPDATE mq_consume_epoch SET first_id = coalesce('
                       '(SELECT min(id) FROM %I), '
                       '(SELECT last_value FROM mq_consume_record_id_seq)) '
                       'WHERE epoch = $1', 'mq_consume_record_' || opened)
            USING opened;
    END LOOP;
END
$$;
ALTER TABLE mq_consume_epoch ALTER COLUMN first_id SET NOT NULL;

-- A closed epoch's filter: Parquet's split-block Bloom filter (the
-- apache/parquet-format specification, BloomFilter.md) of the digests of
-- its records, each hashed as its first 8 bytes read as a little-endian
-- integer, 32 bits a record. Built by the first worker to need it, loaded
-- by the others; it goes with its epoch.
CREATE TABLE mq_consume_filter (
    epoch    INTEGER     PRIMARY KEY REFERENCES mq_consume_epoch ON DELETE CASCADE,
    records  BIGINT      NOT NULL,
    filter   BYTEA       NOT NULL,
    built_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Random bits do not compress: not worth trying.
ALTER TABLE mq_consume_filter ALTER COLUMN filter SET STORAGE EXTERNAL;

-- Key of the advisory lock that lets one opening of an epoch at a time
-- go on in a schema: "idmr" in ASCII, and the epoch table.
CREATE FUNCTION mq_rotation_lock() RETURNS INTEGER[] LANGUAGE sql STABLE AS $$
    SELECT ARRAY[x'69646d72'::integer, 'mq_consume_epoch'::regclass::oid::integer]
$$;

-- As in 0006, one opening at a time (two at once would both create the
-- same partition), recording where the id sequence stands.
CREATE OR REPLACE FUNCTION mq_open_epoch() RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    opened    INTEGER;
    partition TEXT;
    rotation  INTEGER[] := mq_rotation_lock();
    lock      INTEGER[] := mq_epoch_lock();
BEGIN
    PERFORM pg_advisory_xact_lock(rotation[1], rotation[2]);
    SELECT max(epoch) + 1 INTO opened FROM mq_consume_epoch;
    partition := 'mq_consume_record_' || opened;
    EXECUTE format('CREATE TABLE %I (LIKE mq_consume_record INCLUDING DEFAULTS)', partition);
    EXECUTE format('ALTER TABLE %I ALTER COLUMN digest SET NOT NULL', partition);
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I UNIQUE (digest)',
                   partition, partition || '_key');
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I PRIMARY KEY (id)',
                   partition, partition || '_pkey');
    EXECUTE format('ALTER TABLE mq_consume_record ATTACH PARTITION %I FOR VALUES IN (%s)',
                   partition, opened);
    PERFORM pg_advisory_xact_lock(lock[1], lock[2]);
    INSERT INTO mq_consume_epoch (epoch, by_digest, first_id)
        VALUES (opened, true, (SELECT last_value FROM mq_consume_record_id_seq));
    RETURN opened;
END
$$;

-- Opens the next epoch if the current one has taken `max_records` records
-- or more; returns it, or NULL. Several workers may ask at once: the
-- first opens it, the others find the new epoch below the limit.
CREATE FUNCTION mq_rotate(max_records BIGINT) RETURNS INTEGER LANGUAGE plpgsql AS $$
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

-- The claim, as in 0006, told by the caller which closed epochs its
-- filters cover (`filtered`, each with the moment it was closed,
-- `closed_at`: when the next epoch opened, as the caller saw it when it
-- took the filter) and which of those may hold which event: the pairs
-- (`suspect_at`, `suspect_epoch`), a position in `event_ids` and an epoch
-- whose filter holds that event's digest. Each event is looked up in the
-- closed epochs keyed by digest that no filter covers, and in those whose
-- filter may hold it; in those from before the digest key by its text, as
-- before. A filter must cover the whole epoch: the caller builds it once
-- the epoch is closed. One whose epoch was closed at another moment covers
-- nothing: the database was restored from before that moment, and the
-- epoch of that number closed again since, with other records.
CREATE FUNCTION mq_claim(event_ids VARCHAR[], digests UUID[], consumer VARCHAR,
                         filtered INTEGER[], closed_at TIMESTAMPTZ[],
                         suspect_at INTEGER[], suspect_epoch INTEGER[])
RETURNS SETOF VARCHAR LANGUAGE plpgsql AS $$
DECLARE
    current    INTEGER;
    keyed      INTEGER;
    by_text    BOOLEAN;
    unfiltered INTEGER[];
    lock       INTEGER[] := mq_epoch_lock();
    recorded   VARCHAR[] := '{}';
    inserted   VARCHAR[];
    clash      RECORD;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(lock[1], lock[2]);
    SELECT max(epoch), min(epoch) FILTER (WHERE by_digest), bool_or(NOT by_digest)
        INTO current, keyed, by_text
        FROM mq_consume_epoch;
    SELECT coalesce(array_agg(epochs.epoch), '{}') INTO unfiltered
        FROM (SELECT e.epoch, e.by_digest, lead(e.opened_at) OVER (ORDER BY e.epoch) AS closed
              FROM mq_consume_epoch AS e) AS epochs
        WHERE epochs.by_digest AND epochs.closed IS NOT NULL
          AND NOT EXISTS (SELECT FROM unnest(filtered, closed_at) AS held(epoch, closed)
                          WHERE held.epoch = epochs.epoch AND held.closed = epochs.closed);
    -- Each look is one lookup in one partition's unique index (a scalar
    -- subquery, so that no plan reads a partition whole).
    IF cardinality(unfiltered) > 0 OR cardinality(suspect_at) > 0 THEN
        SELECT coalesce(array_agg(look.event_id), '{}') INTO recorded
            FROM (SELECT claim.event_id, claim.digest, other.epoch
                  FROM unnest(event_ids, digests) AS claim(event_id, digest)
                  CROSS JOIN unnest(unfiltered) AS other(epoch)
                  UNION ALL
                  SELECT event_ids[suspect.at], digests[suspect.at], suspect.epoch
                  FROM unnest(suspect_at, suspect_epoch) AS suspect(at, epoch)
                  WHERE suspect.epoch < current) AS look
            WHERE (SELECT 1 FROM mq_consume_record AS older
                   WHERE older.epoch = look.epoch
                     AND older.digest = look.digest AND older.event_id = look.event_id
                   LIMIT 1) IS NOT NULL;
    END IF;
    IF by_text THEN
        recorded := recorded || ARRAY(
            SELECT claim.event_id FROM unnest(event_ids) AS claim(event_id)
            WHERE (SELECT 1 FROM mq_consume_record AS older
                   WHERE older.epoch < keyed
                     AND older.event_id = claim.event_id AND older.consumer_group = consumer
                   LIMIT 1) IS NOT NULL);
    END IF;
    WITH went_in AS (
        INSERT INTO mq_consume_record AS record (event_id, consumer_group, digest, epoch)
        SELECT claim.event_id, consumer, claim.digest, current
        FROM unnest(event_ids, digests) AS claim(event_id, digest)
        WHERE claim.event_id <> ALL (recorded)
        ORDER BY claim.digest
        ON CONFLICT DO NOTHING
        RETURNING record.event_id)
    SELECT array_agg(went_in.event_id) INTO inserted FROM went_in;
    -- What did not go in is a duplicate, unless another id holds its digest
    -- (looked up for those only).
    WITH skipped AS MATERIALIZED (
        SELECT claim.event_id, claim.digest
        FROM unnest(event_ids, digests) AS claim(event_id, digest)
        WHERE claim.event_id NOT IN (SELECT unnest(inserted)))
    SELECT skipped.event_id AS event_id, holder.event_id AS holder INTO clash
        FROM skipped
        CROSS JOIN LATERAL (
            SELECT record.event_id FROM mq_consume_record AS record
            WHERE record.epoch = current AND record.digest = skipped.digest
            LIMIT 1) AS holder
        WHERE holder.event_id <> skipped.event_id
        LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'event % shares its digest with event %, recorded before',
            clash.event_id, clash.holder
            USING ERRCODE = 'unique_violation';
    END IF;
    RETURN QUERY SELECT unnest(inserted);
END
$$;

-- The claim of an idem from 0006, still running while this is applied,
-- and of callers without filters: every closed epoch looked into.
CREATE OR REPLACE FUNCTION mq_claim(event_ids VARCHAR[], digests UUID[], consumer VARCHAR)
RETURNS SETOF VARCHAR LANGUAGE sql AS $$
    SELECT mq_claim(event_ids, digests, consumer, '{}', '{}', '{}', '{}')
$$;
