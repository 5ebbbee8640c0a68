-- The outbox: messages an event's effect sends on, written by the
-- transaction that applies the event, so that they exist if and only if the
-- effect committed. A relay publishes the unsent ones with publisher
-- confirms and marks them sent after the confirm; killed in between, it
-- sends one again, with the same message_id.
--
-- message_id is the idempotency key: derived from the consumer group, the
-- incoming event's id and the message's place among that event's messages,
-- so a redelivery (which applies nothing) could not make another; it travels
-- as the AMQP message_id and an Idempotency-Key header for the receiver to
-- deduplicate on. Not unique-indexed: the consume record already makes the
-- transaction that writes it happen once.
CREATE TABLE mq_outbox (
    id              BIGINT GENERATED ALWAYS AS IDENTITY (CACHE 1000) PRIMARY KEY,
    message_id      UUID         NOT NULL,
    exchange        TEXT         NOT NULL,
    routing_key     TEXT         NOT NULL,
    content_type    TEXT,
    -- Headers of the handler's own, as a JSON object of strings.
    headers         JSONB        NOT NULL DEFAULT '{}',
    body            BYTEA        NOT NULL,
    created_at      TIMESTAMPTZ  NOT NULL DEFAULT now(),
    -- Refused (nacked, returned) or failed publishes so far, the last
    -- reason, and when the relay may try again.
    attempts        INTEGER      NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_attempt_at TIMESTAMPTZ  NOT NULL DEFAULT now(),
    sent_at         TIMESTAMPTZ
);

-- What the relay reads: the unsent, oldest first. Small, since sent rows
-- leave it.
CREATE INDEX mq_outbox_unsent ON mq_outbox (id) WHERE sent_at IS NULL;
