-- mq_standbys_have as it is now: `migrate` applies this file again when it
-- changes (sql/functions/README.md). Edit it here, never in a migration.

-- How many standbys streaming from this server have flushed its WAL up to
-- `target`, once `wanted` of them have, or once `within` has passed
-- (fewer then). What a worker that acks after standbys (`--ack-after-standbys`)
-- waits on, on the connection that committed, with `target` the WAL
-- position after its commit. A walsender reports a standby's flush as the
-- standby replies (at once after each flush it makes): the wait asks again
-- after a short nap, longer each time. Reading the standbys' positions
-- needs the role to be a member of pg_read_all_stats (or a superuser);
-- without that they read as NULL and never count.
CREATE OR REPLACE FUNCTION mq_standbys_have(target pg_lsn, wanted INTEGER, within INTERVAL)
RETURNS INTEGER LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    deadline TIMESTAMPTZ := clock_timestamp() + within;
    nap      DOUBLE PRECISION := 0.0001;
    have     INTEGER;
BEGIN
    LOOP
        SELECT count(*) INTO have FROM pg_stat_replication AS standby
            WHERE standby.flush_lsn >= target;
        IF have >= wanted OR clock_timestamp() >= deadline THEN
            RETURN have;
        END IF;
        PERFORM pg_sleep(nap);
        nap := least(nap * 2, 0.01);
    END LOOP;
END $$;
