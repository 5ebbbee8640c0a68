-- The points handler's table: points per order.
--
-- idem's own migration 0001 created this table before handlers had
-- migrations of their own, so every database migrated by idem has it
-- already and this is a no-op there; from here on the points handler owns
-- it, and changes to it are migrations of this handler.
CREATE TABLE IF NOT EXISTS user_points (
    order_id VARCHAR(64) COLLATE "C" PRIMARY KEY,
    points   BIGINT NOT NULL DEFAULT 0
) WITH (fillfactor = 50);
