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
