-- Units of each SKU still available. The CHECK is what an oversold
-- reservation breaks: its transaction fails, and the message with it.
CREATE TABLE stock (
    sku       VARCHAR(64) COLLATE "C" PRIMARY KEY,
    available BIGINT NOT NULL CHECK (available >= 0)
);
