-- Order per key. On an ordered queue (slots), a key whose head event
-- failed is parked: the head waits here for its next attempt (or lies in
-- the dead letters), and the key's later events are kept here, in the
-- order their slot delivered them, instead of being applied before it.
-- The worker applies a parked key's events oldest first once its head is
-- due; the key's row goes when its last parked event has applied.
CREATE TABLE mq_parked_key (
    consumer_group VARCHAR(64)  COLLATE "C" NOT NULL,
    ordering_key   VARCHAR(128) COLLATE "C" NOT NULL,
    -- The event that holds the key: the oldest parked one while it
    -- waits, the dead letter while it lies in the dead-letter queue.
    head_event_id  VARCHAR(128) COLLATE "C" NOT NULL,
    head_dead      BOOLEAN      NOT NULL DEFAULT false,
    -- When a worker tries the head again; NULL while it is dead.
    due_at         TIMESTAMPTZ,
    last_error     TEXT,
    parked_at      TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, ordering_key),
    CHECK (head_dead = (due_at IS NULL))
);

CREATE INDEX mq_parked_key_due ON mq_parked_key (consumer_group, due_at)
    WHERE due_at IS NOT NULL;

CREATE TABLE mq_parked_event (
    consumer_group VARCHAR(64)  COLLATE "C" NOT NULL,
    ordering_key   VARCHAR(128) COLLATE "C" NOT NULL,
    -- The key's order: a dead head replayed goes before the others.
    position       BIGINT       NOT NULL,
    event_id       VARCHAR(128) COLLATE "C" NOT NULL,
    -- The slot queue it came from: where a replay of its dead letter goes.
    queue          VARCHAR(255) COLLATE "C" NOT NULL,
    body           BYTEA        NOT NULL,
    -- The delivery's properties, as the dead-letter index keeps them.
    properties     JSONB,
    parked_at      TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, ordering_key, position),
    UNIQUE (consumer_group, event_id),
    FOREIGN KEY (consumer_group, ordering_key)
        REFERENCES mq_parked_key (consumer_group, ordering_key) ON DELETE CASCADE
);

CREATE SEQUENCE mq_parked_position;

-- The workers consuming an ordered queue, each seen within its heartbeat:
-- they share the queue's slots among them, slot i to the (i mod n)-th
-- member in the order of their ids. RabbitMQ's single active consumer
-- keeps a slot to one of them while they agree.
CREATE TABLE mq_slot_member (
    consumer_group VARCHAR(64)  COLLATE "C" NOT NULL,
    queue          VARCHAR(255) COLLATE "C" NOT NULL,
    member         UUID         NOT NULL,
    seen_at        TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, queue, member)
);
