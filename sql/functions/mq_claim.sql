-- mq_claim as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- The claim: records each of `event_ids` (with `digests`, as
-- `store::digest` computes them) for consumer group `consumer` in the
-- current epoch unless an epoch holds it already, and returns those it
-- recorded. It reads the epochs after the epochs' shared lock, in its own
-- snapshot. An event is looked up in the closed epochs keyed by digest
-- that no filter covers (`filtered`, `closed_at`: the epochs the caller
-- holds a filter of, and when each was closed; one closed at another
-- moment covers nothing), in those whose filter may hold it (`suspect_at`,
-- `suspect_epoch`: a position in `event_ids` and an epoch), and in those
-- from before the digest key by its text. A duplicate whose digest another
-- event holds is an error (unique_violation), never skipped.
--
-- One event id (what per-message mode claims each time) takes a path of
-- its own: a single-row INSERT … VALUES in place of the INSERT from
-- unnest, its sort (which orders a batch's rows against deadlocks) and the
-- aggregate of what went in. Under pgbench (the function alone, one id a
-- call, prepared, 4 clients) the batch path took 346-421 µs of PostgreSQL
-- CPU a transaction, the single-row path 274-297, and a plain INSERT into
-- the record table 241-247. The read of the closed epochs no filter covers
-- is skipped when no epoch is closed, and the digest clash check looks
-- only at the ids that did not go in (migrations 0007 to 0009 tell the
-- measurements behind each).
CREATE OR REPLACE FUNCTION mq_claim(event_ids VARCHAR[], digests UUID[], consumer VARCHAR,
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
    any_closed BOOLEAN;
    one        VARCHAR;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(lock[1], lock[2]);
    SELECT max(epoch), min(epoch) FILTER (WHERE by_digest), bool_or(NOT by_digest),
           count(*) > 1
        INTO current, keyed, by_text, any_closed
        FROM mq_consume_epoch;
    -- Only an epoch that has a successor is closed: with none, no closed
    -- epoch lacks a filter.
    IF any_closed THEN
        SELECT coalesce(array_agg(epochs.epoch), '{}') INTO unfiltered
            FROM (SELECT e.epoch, e.by_digest, lead(e.opened_at) OVER (ORDER BY e.epoch) AS closed
                  FROM mq_consume_epoch AS e) AS epochs
            WHERE epochs.by_digest AND epochs.closed IS NOT NULL
              AND NOT EXISTS (SELECT FROM unnest(filtered, closed_at) AS held(epoch, closed)
                              WHERE held.epoch = epochs.epoch AND held.closed = epochs.closed);
    ELSE
        unfiltered := '{}';
    END IF;
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
    IF cardinality(event_ids) = 1 THEN
        IF event_ids[1] <> ALL (recorded) THEN
            INSERT INTO mq_consume_record AS record (event_id, consumer_group, digest, epoch)
                VALUES (event_ids[1], consumer, digests[1], current)
                ON CONFLICT DO NOTHING
                RETURNING record.event_id INTO one;
            IF one IS NOT NULL THEN
                RETURN NEXT one;
                RETURN;
            END IF;
        END IF;
        -- Not in: `inserted` stays NULL, as 0008's aggregate of no row.
    ELSE
        WITH went_in AS (
            INSERT INTO mq_consume_record AS record (event_id, consumer_group, digest, epoch)
            SELECT claim.event_id, consumer, claim.digest, current
            FROM unnest(event_ids, digests) AS claim(event_id, digest)
            WHERE claim.event_id <> ALL (recorded)
            ORDER BY claim.digest
            ON CONFLICT DO NOTHING
            RETURNING record.event_id)
        SELECT array_agg(went_in.event_id) INTO inserted FROM went_in;
        -- What did not go in is a duplicate, unless another id holds its
        -- digest (looked up for those only: when every id went in, none).
        IF coalesce(cardinality(inserted), 0) = cardinality(event_ids) THEN
            RETURN QUERY SELECT unnest(inserted);
            RETURN;
        END IF;
    END IF;
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

-- The claim of idem 0006's workers, and of callers without filters:
-- every closed epoch looked into.
CREATE OR REPLACE FUNCTION mq_claim(event_ids VARCHAR[], digests UUID[], consumer VARCHAR)
RETURNS SETOF VARCHAR LANGUAGE sql AS $$
    SELECT mq_claim(event_ids, digests, consumer, '{}', '{}', '{}', '{}')
$$;

-- The claim of idem before 0006, whose workers may still run while a
-- newer one migrates: the same, with the digests computed here.
CREATE OR REPLACE FUNCTION mq_claim(event_ids VARCHAR[], consumer VARCHAR)
RETURNS SETOF VARCHAR LANGUAGE sql AS $$
    SELECT mq_claim(event_ids,
                    ARRAY(SELECT mq_digest(consumer, id) FROM unnest(event_ids) AS id),
                    consumer)
$$;
