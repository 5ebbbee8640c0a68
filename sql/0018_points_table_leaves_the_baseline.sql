-- The points handler's table leaves what every schema starts with.
--
-- Migration 0001 created user_points in every schema, before handlers had
-- migrations of their own; since then the points handler creates it (its
-- own 0001, IF NOT EXISTS), and a schema migrated for another service (a
-- stock, a wallet) should not hold a table of points.
--
-- A schema whose idem migrations all ran in this transaction is new: its
-- user_points was created a moment ago, holds nothing and belongs to no
-- handler yet, so it goes; the points handler, migrated after idem in the
-- same transaction, creates it again. A schema migrated before keeps its
-- table, whatever it holds: this never drops a table that existed before
-- this migration ran.
DO $$
BEGIN
    IF (SELECT min(applied_at) FROM idem_schema_migrations) = now() THEN
        DROP TABLE IF EXISTS user_points;
    END IF;
END
$$;
