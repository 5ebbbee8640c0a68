-- Accounts, which no transfer may overdraw, and one row per transfer made:
-- what an auditor reads, and what `wallet check --witness` counts.
CREATE TABLE account (
    id      VARCHAR(64) COLLATE "C" PRIMARY KEY,
    balance BIGINT NOT NULL CHECK (balance >= 0)
);

CREATE TABLE transfer (
    event_id     VARCHAR(128) COLLATE "C" PRIMARY KEY,
    from_account VARCHAR(64)  COLLATE "C" NOT NULL,
    to_account   VARCHAR(64)  COLLATE "C" NOT NULL,
    amount       BIGINT       NOT NULL
);
