-- The consume record: one row per (event, consumer group) whose effect was
-- applied. The unique key is what makes a redelivery a no-op.
--
-- Keys are identifiers, not prose: the "C" collation compares them byte by
-- byte, which keeps the unique index's comparisons cheap (a locale such as
-- en_US.UTF-8 or C.UTF-8 goes through strcoll for every comparison).
CREATE TABLE mq_consume_record (
    id             BIGINT GENERATED ALWAYS AS IDENTITY (CACHE 1000) PRIMARY KEY,
    event_id       VARCHAR(128) COLLATE "C" NOT NULL,
    consumer_group VARCHAR(64)  COLLATE "C" NOT NULL,
    consumed_at    TIMESTAMPTZ  NOT NULL DEFAULT now(),
    CONSTRAINT uk_event_consumer UNIQUE (event_id, consumer_group)
);

-- The business effect of the reference handler: points per order.
CREATE TABLE user_points (
    order_id VARCHAR(64) COLLATE "C" PRIMARY KEY,
    points   BIGINT NOT NULL DEFAULT 0
) WITH (fillfactor = 50);
