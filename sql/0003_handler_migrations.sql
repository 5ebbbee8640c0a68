-- Handlers bring migrations of their own (the points handler's user_points,
-- a team's stock table), tracked apart from idem's so that each can evolve:
-- one row per handler and version applied. idem's own stay in
-- idem_schema_migrations.
CREATE TABLE idem_handler_migrations (
    handler    VARCHAR(64) NOT NULL,
    version    INTEGER     NOT NULL,
    name       TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, version)
);
