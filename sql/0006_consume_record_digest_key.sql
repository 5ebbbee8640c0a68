-- A narrower key for the consume records: each new epoch's partition is
-- unique on a 16-byte digest of the consumer group and the event id instead
-- of on their whole text. Its index is several times smaller, so fewer of
-- its pages are written to the WAL whole after each checkpoint, and the
-- claims compare fixed-width keys. The full id stays in the row: the claim
-- checks it, so that two events sharing a digest are never taken for one.
--
-- The epochs from before keep their key (nothing is rewritten); the claims
-- look into them by the text, until the retention drops them.

-- The digest: the first 16 bytes of the SHA-256 of the group, a zero byte
-- and the id, as a uuid. The worker computes the same (idem's
-- `store::digest`); this one is for other claims and for operators.
CREATE FUNCTION mq_digest(consumer_group VARCHAR, event_id VARCHAR)
RETURNS UUID LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT encode(substring(sha256(convert_to(consumer_group, 'UTF8') || '\x00'::bytea
                                   || convert_to(event_id, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid
$$;

-- A column added without a default changes the catalog only.
ALTER TABLE mq_consume_record ADD COLUMN digest UUID;
-- Whether an epoch's partition is unique on the digest (else on the text).
ALTER TABLE mq_consume_epoch ADD COLUMN by_digest BOOLEAN NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION mq_open_epoch() RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    opened    INTEGER;
    partition TEXT;
    lock      INTEGER[] := mq_epoch_lock();
BEGIN
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
    INSERT INTO mq_consume_epoch (epoch, by_digest) VALUES (opened, true);
    RETURN opened;
END
$$;

-- The claim, as in 0005, with each id's digest (`digests`, index for index
-- with `event_ids`): in digest order, the order of the current partition's
-- key. The closed epochs keyed by digest are looked into by digest and id,
-- those from before by id and group: each look is a lookup in one unique
-- index, made only when there are such epochs (with one partition left to
-- look into, PostgreSQL does not leave it out of a kept plan when it is
-- not one to look into). A digest that another id holds in the current
-- epoch is an error naming both ids, never a duplicate.
CREATE FUNCTION mq_claim(event_ids VARCHAR[], digests UUID[], consumer VARCHAR)
RETURNS SETOF VARCHAR LANGUAGE plpgsql AS $$
DECLARE
    current  INTEGER;
    keyed    INTEGER;
    by_text  BOOLEAN;
    lock     INTEGER[] := mq_epoch_lock();
    inserted VARCHAR[];
    clash    RECORD;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(lock[1], lock[2]);
    SELECT max(epoch), min(epoch) FILTER (WHERE by_digest), bool_or(NOT by_digest)
        INTO current, keyed, by_text
        FROM mq_consume_epoch;
    IF by_text THEN
        -- Left out: the ids an epoch from before the digest key holds.
        SELECT coalesce(array_agg(claim.event_id), '{}'), coalesce(array_agg(claim.digest), '{}')
            INTO event_ids, digests
            FROM unnest(event_ids, digests) AS claim(event_id, digest)
            WHERE (SELECT 1 FROM mq_consume_record AS older
                   WHERE older.epoch < keyed
                     AND older.event_id = claim.event_id AND older.consumer_group = consumer
                   LIMIT 1) IS NULL;
    END IF;
    WITH went_in AS (
        INSERT INTO mq_consume_record AS record (event_id, consumer_group, digest, epoch)
        SELECT claim.event_id, consumer, claim.digest, current
        FROM unnest(event_ids, digests) AS claim(event_id, digest)
        WHERE (SELECT 1 FROM mq_consume_record AS older
               WHERE keyed < current
                 AND older.epoch < current AND older.epoch >= keyed
                 AND older.digest = claim.digest AND older.event_id = claim.event_id
               LIMIT 1) IS NULL
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

-- The claim of an idem from before this migration, still running while it
-- is applied: the same, with the digests computed here.
CREATE OR REPLACE FUNCTION mq_claim(event_ids VARCHAR[], consumer VARCHAR)
RETURNS SETOF VARCHAR LANGUAGE sql AS $$
    SELECT mq_claim(event_ids,
                    ARRAY(SELECT mq_digest(consumer, id) FROM unnest(event_ids) AS id),
                    consumer)
$$;

-- The epoch of each of `event_ids` that consumer group `consumer` recorded
-- (one at most: a claim never records an id an older epoch holds), each a
-- lookup in one unique index, as in the claim.
CREATE FUNCTION mq_recorded(event_ids VARCHAR[], consumer VARCHAR)
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

-- New claims go to a partition keyed by digest at once; the epoch that was
-- current is dropped if it holds no record.
DO $$
DECLARE
    was   INTEGER := (SELECT max(epoch) FROM mq_consume_epoch);
    empty BOOLEAN;
BEGIN
    PERFORM mq_open_epoch();
    EXECUTE format('SELECT NOT EXISTS (SELECT FROM %I)', 'mq_consume_record_' || was) INTO empty;
    IF empty THEN
        EXECUTE format('DROP TABLE %I', 'mq_consume_record_' || was);
        DELETE FROM mq_consume_epoch WHERE epoch = was;
    END IF;
END
$$;
