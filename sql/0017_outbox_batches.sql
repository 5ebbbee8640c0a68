-- The outbox's messages, one row per transaction that sends: the
-- transaction that applies a batch of events writes its messages as one
-- row of arrays, index for index, and the relay removes the row once
-- every one of them is confirmed. A row per message cost each message an
-- insert into the heap and two indexes (405 bytes of WAL with bodies of
-- about 110 bytes, under pgbench) and, once sent, a row lock and a delete
-- (116 bytes more); a row of 450 such messages, which PostgreSQL
-- compresses as one value, wrote 37 bytes of WAL a message, and taking and
-- removing it about 1. `mq_outbox` keeps the messages that wait on their
-- own: refused by the broker (their attempts counted, tried again later),
-- left over when a channel closed mid-batch, and those of older idem
-- versions; the relay sends those first.
CREATE TABLE mq_outbox_batch (
    id            BIGINT      GENERATED ALWAYS AS IDENTITY (CACHE 1000) PRIMARY KEY,
    message_ids   UUID[]      NOT NULL,
    exchanges     TEXT[]      NOT NULL,
    routing_keys  TEXT[]      NOT NULL,
    -- An element is NULL where a message has none.
    content_types TEXT[]      NOT NULL,
    -- Headers of the handler's own, each a JSON object of strings.
    headers       TEXT[]      NOT NULL,
    bodies        BYTEA[]     NOT NULL,
    -- How many: counted without reading the arrays.
    messages      INTEGER     NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Every message the outbox holds, whichever table it waits in: what an
-- operator, `check` and the tests read.
CREATE VIEW mq_outbox_message AS
    SELECT message_id, exchange, routing_key, content_type, headers, body, created_at,
           attempts, last_error, next_attempt_at, sent_at
    FROM mq_outbox
    UNION ALL
    SELECT message.message_id, message.exchange, message.routing_key, message.content_type,
           message.headers::jsonb, message.body, batch.created_at,
           0, NULL, batch.created_at, NULL
    FROM mq_outbox_batch AS batch,
         unnest(batch.message_ids, batch.exchanges, batch.routing_keys, batch.content_types,
                batch.headers, batch.bodies)
             AS message(message_id, exchange, routing_key, content_type, headers, body);

-- The arrays compressed with lz4 where the server has it (PostgreSQL 14 or
-- later, built with it): under pgbench, a row of 450 messages took 1.3 µs
-- a message to write against 2.4 with the default pglz, for the same WAL
-- within a tenth.
DO $$
BEGIN
    IF current_setting('server_version_num')::integer >= 140000 THEN
        EXECUTE 'ALTER TABLE mq_outbox_batch '
             || 'ALTER COLUMN exchanges SET COMPRESSION lz4, '
             || 'ALTER COLUMN routing_keys SET COMPRESSION lz4, '
             || 'ALTER COLUMN content_types SET COMPRESSION lz4, '
             || 'ALTER COLUMN headers SET COMPRESSION lz4, '
             || 'ALTER COLUMN bodies SET COMPRESSION lz4';
    END IF;
EXCEPTION WHEN feature_not_supported THEN
    NULL;
END
$$;
