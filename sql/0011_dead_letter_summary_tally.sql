-- A summary of the dead-letter index that costs the same with a million
-- letters as with ten: `idem dlq summary` had to aggregate every row of
-- the group and look up each event's consume record to say what a replay
-- would apply.
--
-- Each row now says whether the group had applied its event when the row
-- was written (by the worker dead-lettering it, or by a sync): a replay of
-- it would be acked as a duplicate. A copy of the event applied later (a
-- replay of another copy, a copy published again) leaves it as it was
-- until the next sync.
ALTER TABLE mq_dead_letter ADD COLUMN applied BOOLEAN NOT NULL DEFAULT false;

UPDATE mq_dead_letter AS letter SET applied = true
FROM (SELECT DISTINCT consumer_group FROM mq_dead_letter) AS grp
CROSS JOIN LATERAL mq_recorded(
    ARRAY(SELECT event_id FROM mq_dead_letter
          WHERE consumer_group = grp.consumer_group AND event_id IS NOT NULL),
    grp.consumer_group) AS recorded
WHERE letter.consumer_group = grp.consumer_group AND letter.event_id = recorded.event_id;

-- The letters of each group per reason, last error (or why the body is
-- invalid; '' for none), invalid body and applied event: what a summary
-- shows, kept by the index's triggers beside the per-reason tally. A row
-- whose letters are all gone is removed, so that errors that name their
-- event do not pile up.
CREATE TABLE mq_dead_letter_error_tally (
    consumer_group VARCHAR(64) COLLATE "C" NOT NULL,
    reason         VARCHAR(64) NOT NULL,
    invalid        BOOLEAN     NOT NULL,
    applied        BOOLEAN     NOT NULL,
    last_error     TEXT        NOT NULL,
    -- An error is up to 2,000 characters: too long for a key.
    error_digest   UUID        GENERATED ALWAYS AS (md5(last_error)::uuid) STORED,
    letters        BIGINT      NOT NULL,
    PRIMARY KEY (consumer_group, reason, invalid, applied, error_digest)
);

INSERT INTO mq_dead_letter_error_tally
    (consumer_group, reason, invalid, applied, last_error, letters)
SELECT consumer_group, reason, invalid, applied, coalesce(last_error, ''), sum(copies)
FROM mq_dead_letter
GROUP BY 1, 2, 3, 4, 5;

-- The oldest and newest letter of each tally row, for a summary filtered
-- by error: a row read at each end instead of every row of the group.
CREATE INDEX mq_dead_letter_by_error ON mq_dead_letter
    (consumer_group, (md5(coalesce(last_error, ''))::uuid), dead_at);

-- Adds `letters` of each kind, in key order (two writers of the index
-- lock the same tally rows in the same order), and removes the rows it
-- brought to none.
CREATE FUNCTION mq_dead_letter_error_tally_add(changed mq_dead_letter_error_tally[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO mq_dead_letter_error_tally AS tally
        (consumer_group, reason, invalid, applied, last_error, letters)
    SELECT c.consumer_group, c.reason, c.invalid, c.applied, c.last_error, sum(c.letters)
    FROM unnest(changed) AS c
    GROUP BY 1, 2, 3, 4, 5
    HAVING sum(c.letters) <> 0
    ORDER BY 1, 2, 3, 4, md5(c.last_error)::uuid
    ON CONFLICT (consumer_group, reason, invalid, applied, error_digest)
    DO UPDATE SET letters = tally.letters + EXCLUDED.letters;
    DELETE FROM mq_dead_letter_error_tally AS tally
    USING (SELECT DISTINCT c.consumer_group, c.reason, c.invalid, c.applied,
                           md5(c.last_error)::uuid AS error_digest
           FROM unnest(changed) AS c) AS touched
    WHERE tally.consumer_group = touched.consumer_group AND tally.reason = touched.reason
      AND tally.invalid = touched.invalid AND tally.applied = touched.applied
      AND tally.error_digest = touched.error_digest AND tally.letters = 0;
END
$$;

CREATE OR REPLACE FUNCTION mq_dead_letter_tally() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO mq_dead_letter_tally AS tally (consumer_group, reason, letters)
        SELECT consumer_group, reason, sum(copies) FROM new_rows
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (consumer_group, reason)
        DO UPDATE SET letters = tally.letters + EXCLUDED.letters;
        PERFORM mq_dead_letter_error_tally_add(ARRAY(
            SELECT (consumer_group, reason, invalid, applied, coalesce(last_error, ''), NULL,
                    copies)::mq_dead_letter_error_tally
            FROM new_rows));
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO mq_dead_letter_tally AS tally (consumer_group, reason, letters)
        SELECT consumer_group, reason, sum(copies) FROM (
            SELECT consumer_group, reason, copies FROM new_rows
            UNION ALL
            SELECT consumer_group, reason, -copies FROM old_rows) AS changed
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (consumer_group, reason)
        DO UPDATE SET letters = tally.letters + EXCLUDED.letters;
        PERFORM mq_dead_letter_error_tally_add(ARRAY(
            SELECT (consumer_group, reason, invalid, applied, coalesce(last_error, ''), NULL,
                    copies)::mq_dead_letter_error_tally
            FROM new_rows
            UNION ALL
            SELECT (consumer_group, reason, invalid, applied, coalesce(last_error, ''), NULL,
                    -copies)::mq_dead_letter_error_tally
            FROM old_rows));
    ELSE
        INSERT INTO mq_dead_letter_tally AS tally (consumer_group, reason, letters)
        SELECT consumer_group, reason, -sum(copies) FROM old_rows
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (consumer_group, reason)
        DO UPDATE SET letters = tally.letters + EXCLUDED.letters;
        PERFORM mq_dead_letter_error_tally_add(ARRAY(
            SELECT (consumer_group, reason, invalid, applied, coalesce(last_error, ''), NULL,
                    -copies)::mq_dead_letter_error_tally
            FROM old_rows));
    END IF;
    RETURN NULL;
END
$$;
