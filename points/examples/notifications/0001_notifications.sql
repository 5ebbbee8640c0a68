-- One notification per credit, for the customer of the order: what the
-- notifications service does with `points.credited`. The unique key says
-- so at the table too: idem's consume record already makes the
-- transaction that writes a row happen once per credit.
CREATE TABLE notification (
    source_event_id VARCHAR(128) COLLATE "C" PRIMARY KEY,
    order_id        VARCHAR(64)  COLLATE "C" NOT NULL,
    points          BIGINT       NOT NULL,
    queued_at       TIMESTAMPTZ  NOT NULL DEFAULT now()
);
