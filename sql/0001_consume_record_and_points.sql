-- The consume record: one row per (event, consumer group) whose effect was
-- applied. The unique key is what makes a redelivery a no-op.
CREATE TABLE mq_consume_record (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id       VARCHAR(128) NOT NULL,
    consumer_group VARCHAR(64)  NOT NULL,
    consumed_at    TIMESTAMPTZ  NOT NULL DEFAULT now(),
    CONSTRAINT uk_event_consumer UNIQUE (event_id, consumer_group)
);

-- The business effect of the reference handler: points per order.
CREATE TABLE user_points (
    order_id VARCHAR(64) PRIMARY KEY,
    points   BIGINT NOT NULL DEFAULT 0
);
