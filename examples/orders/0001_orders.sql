-- Each order's status, which only moves forward, and every status change
-- in the order it was applied.
CREATE TABLE order_status (
    order_id VARCHAR(128) PRIMARY KEY,
    status   TEXT    NOT NULL,
    rank     INTEGER NOT NULL
);

CREATE TABLE order_transitions (
    applied  BIGSERIAL PRIMARY KEY,
    order_id VARCHAR(128) NOT NULL,
    status   TEXT NOT NULL,
    event_id VARCHAR(128) NOT NULL
);
CREATE INDEX order_transitions_by_order ON order_transitions (order_id, applied);
