-- mq_digest as it is now: `migrate` applies this file again when it changes
-- (sql/functions/README.md). Edit it here, never in a migration.

-- The digest: the first 16 bytes of the SHA-256 of the group, a zero byte
-- and the id, as a uuid. The worker computes the same (idem's
-- `store::digest`); this one is for other claims and for operators.
CREATE OR REPLACE FUNCTION mq_digest(consumer_group VARCHAR, event_id VARCHAR)
RETURNS UUID LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT encode(substring(sha256(convert_to(consumer_group, 'UTF8') || '\x00'::bytea
                                   || convert_to(event_id, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid
$$;
