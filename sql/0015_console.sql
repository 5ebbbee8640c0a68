-- What the console shows without reading the dead-letter queue: failure
-- groups, dead-lettering over time, each letter's body and headers, and
-- the record of what operators did.

-- A failure's fingerprint: its text with quoted values, ids and numbers
-- taken out, so that "order 17 not found" and "order 42 not found" are one
-- group (as ServicePulse and Wolverine group by exception); a number
-- inside a word (a SQLSTATE such as P0001) stays. Stored in each
-- row by the column below: this function is never replaced, for the rows
-- keep what it made; another rule would be another function and column.
CREATE FUNCTION mq_error_fingerprint(error text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN left(
    regexp_replace(
        regexp_replace(
            regexp_replace(
                regexp_replace(
                    regexp_replace(error, '"[^"]*"', '"…"', 'g'),
                    '''[^'']*''', '''…''', 'g'),
                '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}',
                '<id>', 'g'),
            '\m[0-9a-fA-F]{8,}\M', '<id>', 'g'),
        '\m[0-9]+\M', '<n>', 'g'),
    500);

ALTER TABLE mq_dead_letter
    ADD COLUMN fingerprint TEXT GENERATED ALWAYS AS
        (mq_error_fingerprint(coalesce(last_error, ''))) STORED,
    -- The body as it died, up to the worker's limit (null when it kept
    -- none, or for a letter indexed before this migration), its whole
    -- size and its SHA-256; the headers as JSON.
    ADD COLUMN body BYTEA,
    ADD COLUMN body_bytes INTEGER,
    ADD COLUMN body_sha256 BYTEA,
    ADD COLUMN headers JSONB;

-- A group's letters by time (and key, for letters that died in one
-- statement): its first and last, and its pages, each read from one end.
CREATE INDEX mq_dead_letter_by_fingerprint ON mq_dead_letter
    (consumer_group, (md5(fingerprint)::uuid), dead_at, letter_key);

-- The letters of each group per fingerprint, kept by the trigger below in
-- the statement that changes the index; a row whose letters are all gone
-- is removed.
CREATE TABLE mq_dead_letter_group (
    consumer_group VARCHAR(64) COLLATE "C" NOT NULL,
    group_id       UUID        NOT NULL,
    -- What a replay of its letters would do: apply, find them applied
    -- already, or leave invalid bodies where they are.
    invalid        BOOLEAN     NOT NULL,
    applied        BOOLEAN     NOT NULL,
    fingerprint    TEXT        NOT NULL,
    letters        BIGINT      NOT NULL,
    PRIMARY KEY (consumer_group, group_id, invalid, applied)
);

INSERT INTO mq_dead_letter_group
    (consumer_group, group_id, invalid, applied, fingerprint, letters)
SELECT consumer_group, md5(fingerprint)::uuid, invalid, applied, min(fingerprint), sum(copies)
FROM mq_dead_letter GROUP BY 1, 2, 3, 4;

-- Letters that came into the index, per group and hour of their death:
-- dead-lettering over time. Only added to (a letter replayed or discarded
-- still died then); a letter dying again while its row is there counts
-- once. A row per group and hour: some 9,000 a year, kept.
CREATE TABLE mq_dead_letter_hourly (
    consumer_group VARCHAR(64) COLLATE "C" NOT NULL,
    hour           TIMESTAMPTZ NOT NULL,
    letters        BIGINT      NOT NULL,
    PRIMARY KEY (consumer_group, hour)
);

INSERT INTO mq_dead_letter_hourly (consumer_group, hour, letters)
SELECT consumer_group, date_trunc('hour', dead_at), count(*)
FROM mq_dead_letter GROUP BY 1, 2;

-- Kept since by sql/functions/mq_dead_letter_groups.sql.
CREATE FUNCTION mq_dead_letter_groups() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE TRIGGER mq_dead_letter_groups_insert AFTER INSERT ON mq_dead_letter
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION mq_dead_letter_groups();
CREATE TRIGGER mq_dead_letter_groups_update AFTER UPDATE ON mq_dead_letter
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION mq_dead_letter_groups();
CREATE TRIGGER mq_dead_letter_groups_delete AFTER DELETE ON mq_dead_letter
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION mq_dead_letter_groups();

-- What operators did from the console: who, when, on which letters, how
-- many were expected (the dry run they confirmed) and acted on, and how
-- it ended (null while it runs).
CREATE TABLE idem_console_audit (
    id             BIGSERIAL    PRIMARY KEY,
    consumer_group VARCHAR(64)  NOT NULL,
    action         VARCHAR(16)  NOT NULL,
    who            TEXT         NOT NULL,
    filter         TEXT         NOT NULL,
    expected       BIGINT       NOT NULL,
    started_at     TIMESTAMPTZ  NOT NULL DEFAULT now(),
    finished_at    TIMESTAMPTZ,
    letters        BIGINT,
    outcome        TEXT,
    -- Where a discard wrote its letters first.
    file           TEXT
);

CREATE INDEX idem_console_audit_by_time ON idem_console_audit (started_at);
