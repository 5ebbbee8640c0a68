-- The retry budget, kept by idem rather than by the broker: RabbitMQ 3.x
-- counts a crash or a closed channel as a delivery of every message held,
-- and 4.3+ does not count every return. One row per event and consumer
-- group whose transaction genuinely failed; written in its own transaction
-- after the failed one rolled back, and deleted by the transaction that
-- finally applies the event.
CREATE TABLE mq_failure_ledger (
    event_id        VARCHAR(128) COLLATE "C" NOT NULL,
    consumer_group  VARCHAR(64)  COLLATE "C" NOT NULL,
    failures        INTEGER      NOT NULL,
    first_failed_at TIMESTAMPTZ  NOT NULL DEFAULT now(),
    last_failed_at  TIMESTAMPTZ  NOT NULL DEFAULT now(),
    last_error      TEXT         NOT NULL,
    PRIMARY KEY (event_id, consumer_group)
);
