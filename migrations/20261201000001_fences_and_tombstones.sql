-- Fences come from one sequence, so a key's fences never repeat over its whole life, purges included:
-- an owner whose record was purged and claimed again can never match the new record with its old fence.
CREATE SEQUENCE idempotency_fences AS BIGINT;
SELECT setval('idempotency_fences', COALESCE((SELECT max(fence) FROM idempotency_records), 0) + 1, false);

-- How long a purged record's tombstone answers "expired" (NULL: forever), as claimed. Records stored
-- before this column get 7 days (the constant default costs no table rewrite); new rows always say.
ALTER TABLE idempotency_records ADD COLUMN tombstone_ms BIGINT DEFAULT 604800000;
ALTER TABLE idempotency_records ALTER COLUMN tombstone_ms DROP DEFAULT;

-- A 16-byte digest naming a key in the tombstone table: `uuid` is Postgres's fixed 16-byte type, so the
-- tombstone and its index entry stay small. The lengths make the input unambiguous, as in Redis keys.
CREATE FUNCTION idempotency_key_digest(tenant TEXT, operation TEXT, idempotency_key TEXT) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $$
    SELECT encode(substring(sha256(convert_to(
        octet_length(tenant) || ':' || tenant || ':' || octet_length(operation) || ':' || operation || ':'
            || idempotency_key, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid
$$;

-- What is left of a completed record once its retention ran out and it was purged: enough to refuse a
-- late retry ("expired", or "mismatch" for another payload) instead of executing it again.
CREATE TABLE idempotency_tombstones (
    digest       uuid        PRIMARY KEY,
    -- The first 8 bytes of the payload fingerprint that completed: enough to tell "expired" (this
    -- payload) from "mismatch" (another); both refuse, so a collision could only pick the other refusal.
    fingerprint  BIGINT      NOT NULL,
    -- The last fence of the key.
    fence        BIGINT      NOT NULL,
    -- When the tombstone may go (NULL: never); after that the key is new again. (No completion time:
    -- 8 more bytes a row would take a tombstone past 120 bytes with its index.)
    expires_at   TIMESTAMPTZ
);

-- Tombstones are written in purge order, so their horizons correlate with the heap: a BRIN index finds
-- the ones to remove at a few bytes per thousand rows.
CREATE INDEX idempotency_tombstones_expires_at ON idempotency_tombstones USING brin (expires_at);
