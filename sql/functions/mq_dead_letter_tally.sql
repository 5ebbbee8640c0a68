-- mq_dead_letter_tally as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- The dead-letter index's triggers: keeps the tallies by reason and by
-- last error (mq_dead_letter_tally, mq_dead_letter_error_tally) as rows of
-- mq_dead_letter come, change and go, so that a summary reads no letter.
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
