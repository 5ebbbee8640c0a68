-- mq_dead_letter_groups as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- The dead-letter index's trigger for the console: keeps the letters per
-- failure group (mq_dead_letter_group) and the letters that came per hour
-- (mq_dead_letter_hourly) as rows of mq_dead_letter come, change and go.
CREATE OR REPLACE FUNCTION mq_dead_letter_groups() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO mq_dead_letter_hourly AS hourly (consumer_group, hour, letters)
        SELECT consumer_group, date_trunc('hour', dead_at), count(*)
        FROM new_rows GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (consumer_group, hour)
        DO UPDATE SET letters = hourly.letters + EXCLUDED.letters;
        INSERT INTO mq_dead_letter_group AS grp
            (consumer_group, group_id, invalid, applied, fingerprint, letters)
        SELECT consumer_group, md5(fingerprint)::uuid, invalid, applied, min(fingerprint),
               sum(copies)
        FROM new_rows GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4
        ON CONFLICT (consumer_group, group_id, invalid, applied)
        DO UPDATE SET letters = grp.letters + EXCLUDED.letters;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO mq_dead_letter_group AS grp
            (consumer_group, group_id, invalid, applied, fingerprint, letters)
        SELECT consumer_group, md5(fingerprint)::uuid, invalid, applied, min(fingerprint),
               sum(copies) FROM (
            SELECT consumer_group, fingerprint, invalid, applied, copies FROM new_rows
            UNION ALL
            SELECT consumer_group, fingerprint, invalid, applied, -copies FROM old_rows) AS changed
        GROUP BY 1, 2, 3, 4 HAVING sum(copies) <> 0 ORDER BY 1, 2, 3, 4
        ON CONFLICT (consumer_group, group_id, invalid, applied)
        DO UPDATE SET letters = grp.letters + EXCLUDED.letters;
    ELSE
        INSERT INTO mq_dead_letter_group AS grp
            (consumer_group, group_id, invalid, applied, fingerprint, letters)
        SELECT consumer_group, md5(fingerprint)::uuid, invalid, applied, min(fingerprint),
               -sum(copies)
        FROM old_rows GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4
        ON CONFLICT (consumer_group, group_id, invalid, applied)
        DO UPDATE SET letters = grp.letters + EXCLUDED.letters;
    END IF;
    -- Only a group a letter left can have none left.
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM mq_dead_letter_group AS grp
        WHERE grp.letters <= 0
          AND (grp.consumer_group, grp.group_id, grp.invalid, grp.applied) IN (
            SELECT DISTINCT consumer_group, md5(fingerprint)::uuid, invalid, applied
            FROM old_rows);
    END IF;
    RETURN NULL;
END
$$;
