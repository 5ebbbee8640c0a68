-- The dead-letter index: what each consumer group's dead-letter queue
-- holds, kept in PostgreSQL so that `idem status`, `idem dlq summary` and
-- the pruner read a table instead of taking every letter off the queue
-- and giving it back.
--
-- One row per event id (or, for a body the handler cannot decode, per
-- digest of the body) and group, `copies` counting the letters of it. The
-- worker writes the row before it rejects the delivery (so the index never
-- lacks a letter idem dead-lettered; a worker stopped between the two
-- counts one copy too many until the next sync); a replay or a discard
-- takes a copy off once its ack is sent; `idem dlq sync` sets every row to
-- what the queue holds, adding the letters that came by other ways (the
-- broker's delivery limit, an older idem).
CREATE TABLE mq_dead_letter (
    consumer_group VARCHAR(64)  COLLATE "C" NOT NULL,
    -- 'event <id>', or 'body <hex>' for an invalid body.
    letter_key     VARCHAR(200) COLLATE "C" NOT NULL,
    event_id       VARCHAR(128) COLLATE "C",
    -- The queue it died in, and why (x-death's queue and reason).
    queue          VARCHAR(255) NOT NULL,
    reason         VARCHAR(64)  NOT NULL,
    -- The failure ledger's count and last error when it died; for an
    -- invalid body, no failure and why it is invalid.
    failures       INTEGER      NOT NULL,
    last_error     TEXT,
    invalid        BOOLEAN      NOT NULL,
    copies         INTEGER      NOT NULL,
    dead_at        TIMESTAMPTZ  NOT NULL,
    -- Last written, by a worker or a sync: a sync removes the rows it
    -- neither found nor saw written while it ran.
    touched_at     TIMESTAMPTZ  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer_group, letter_key)
);

CREATE INDEX mq_dead_letter_by_time ON mq_dead_letter (consumer_group, dead_at);

-- When each group's index was last set to its queue, and what it found.
CREATE TABLE mq_dead_letter_sync (
    consumer_group VARCHAR(64) COLLATE "C" PRIMARY KEY,
    synced_at      TIMESTAMPTZ NOT NULL,
    letters        BIGINT      NOT NULL
);

-- The letters of each group per reason, kept by the triggers below in the
-- statement that changes the index: a status reads a row per reason,
-- however many letters there are.
CREATE TABLE mq_dead_letter_tally (
    consumer_group VARCHAR(64) COLLATE "C" NOT NULL,
    reason         VARCHAR(64) NOT NULL,
    letters        BIGINT      NOT NULL,
    PRIMARY KEY (consumer_group, reason)
);

CREATE FUNCTION mq_dead_letter_tally() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO mq_dead_letter_tally AS tally (consumer_group, reason, letters)
        SELECT consumer_group, reason, sum(copies) FROM new_rows
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (consumer_group, reason)
        DO UPDATE SET letters = tally.letters + EXCLUDED.letters;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO mq_dead_letter_tally AS tally (consumer_group, reason, letters)
        SELECT consumer_group, reason, sum(copies) FROM (
            SELECT consumer_group, reason, copies FROM new_rows
            UNION ALL
            SELECT consumer_group, reason, -copies FROM old_rows) AS changed
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (consumer_group, reason)
        DO UPDATE SET letters = tally.letters + EXCLUDED.letters;
    ELSE
        INSERT INTO mq_dead_letter_tally AS tally (consumer_group, reason, letters)
        SELECT consumer_group, reason, -sum(copies) FROM old_rows
        GROUP BY 1, 2 ORDER BY 1, 2
        ON CONFLICT (consumer_group, reason)
        DO UPDATE SET letters = tally.letters + EXCLUDED.letters;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER mq_dead_letter_tally_insert AFTER INSERT ON mq_dead_letter
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION mq_dead_letter_tally();
CREATE TRIGGER mq_dead_letter_tally_update AFTER UPDATE ON mq_dead_letter
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION mq_dead_letter_tally();
CREATE TRIGGER mq_dead_letter_tally_delete AFTER DELETE ON mq_dead_letter
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION mq_dead_letter_tally();
