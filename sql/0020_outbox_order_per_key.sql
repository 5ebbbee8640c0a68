-- Order per key through the outbox: the messages of an ordered event (one
-- with an ordering key) leave in the order their events applied, whatever
-- the number of relays.
--
-- The key of each message, NULL for an unordered one. A transaction writes
-- its ordered messages and its unordered ones as two rows of
-- `mq_outbox_batch`: `ordering_keys` is NULL on the unordered row.
ALTER TABLE mq_outbox_batch ADD COLUMN ordering_keys TEXT[];
ALTER TABLE mq_outbox ADD COLUMN ordering_key TEXT;

-- Ids in the order rows were written. With a cache of 1000 ids per
-- connection, a key's later transaction, on another connection, could
-- take an id below its earlier one's; the relay sends in id order. One id
-- per transaction that sends (a row holds all its messages) costs little.
ALTER TABLE mq_outbox_batch ALTER COLUMN id SET CACHE 1;
ALTER TABLE mq_outbox ALTER COLUMN id SET CACHE 1;

-- A relay takes the ordered rows only while it holds the schema's outbox
-- order lock (an advisory lock), in id order and none skipped; any relay
-- takes the unordered ones, skipping those another holds, by this index.
CREATE INDEX mq_outbox_batch_unordered ON mq_outbox_batch (id)
    WHERE ordering_keys IS NULL;
-- A key's messages waiting on their own: a later one is not taken while
-- an earlier one waits for its next attempt.
CREATE INDEX mq_outbox_ordered ON mq_outbox (ordering_key, id)
    WHERE ordering_key IS NOT NULL;

-- Every message the outbox holds, as before, with its ordering key.
CREATE OR REPLACE VIEW mq_outbox_message AS
    SELECT message_id, exchange, routing_key, content_type, headers, body, created_at,
           attempts, last_error, next_attempt_at, sent_at, ordering_key
    FROM mq_outbox
    UNION ALL
    SELECT message.message_id, message.exchange, message.routing_key, message.content_type,
           message.headers::jsonb, message.body, batch.created_at,
           0, NULL, batch.created_at, NULL, message.ordering_key
    FROM mq_outbox_batch AS batch,
         unnest(batch.message_ids, batch.exchanges, batch.routing_keys, batch.content_types,
                batch.headers, batch.bodies, batch.ordering_keys)
             AS message(message_id, exchange, routing_key, content_type, headers, body,
                        ordering_key);
