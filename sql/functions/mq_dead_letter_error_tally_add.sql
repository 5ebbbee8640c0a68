-- mq_dead_letter_error_tally_add as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- Adds `letters` of each kind, in key order (two writers of the index
-- lock the same tally rows in the same order), and removes the rows it
-- brought to none.
CREATE OR REPLACE FUNCTION mq_dead_letter_error_tally_add(changed mq_dead_letter_error_tally[])
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
