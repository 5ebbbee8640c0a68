-- Each applied migration's checksum (the SHA-256 of its text), so that
-- `migrate` refuses a schema whose applied migration was edited since:
-- idem's (its history table, which migrate itself keeps, gets the column
-- before any migration runs) and each handler's. Rows from before are
-- given the checksum of the text this migrate would apply.
ALTER TABLE idem_handler_migrations ADD COLUMN checksum TEXT;

-- The functions of sql/functions, one row per text applied: `migrate`
-- applies a file whose text is not here, and leaves one whose text was
-- replaced since (by a newer idem) as it is. The current definition is a
-- name's latest row.
CREATE TABLE idem_schema_functions (
    ordinal    BIGINT      GENERATED ALWAYS AS IDENTITY,
    name       TEXT        NOT NULL,
    checksum   TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (name, checksum)
);
