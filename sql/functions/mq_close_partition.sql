-- mq_close_partition as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- Makes the partition of `epoch` refuse new records, if it is there and
-- does not already.
CREATE OR REPLACE FUNCTION mq_close_partition(epoch INTEGER) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    partition TEXT := 'mq_consume_record_' || epoch;
BEGIN
    IF to_regclass(quote_ident(partition)) IS NOT NULL
       AND NOT EXISTS (SELECT FROM pg_constraint
                       WHERE conrelid = to_regclass(quote_ident(partition))
                         AND conname = partition || '_closed') THEN
        EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (false) NOT VALID',
                       partition, partition || '_closed');
    END IF;
END
$$;
