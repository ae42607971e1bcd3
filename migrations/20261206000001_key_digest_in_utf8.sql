-- The key digest's length prefixes count the UTF-8 bytes of each name, as the application's digest does
-- (claims find tombstones by the digest the application computes; the purge writes them with this
-- function). In a UTF8 database nothing changes; in another encoding `octet_length` counted the
-- database's bytes, so a tombstone of a name with non-ASCII characters was never found again.
CREATE OR REPLACE FUNCTION idempotency_key_digest(tenant TEXT, operation TEXT, idempotency_key TEXT) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $$
    SELECT encode(substring(sha256(convert_to(
        octet_length(convert_to(tenant, 'UTF8')) || ':' || tenant || ':'
            || octet_length(convert_to(operation, 'UTF8')) || ':' || operation || ':'
            || idempotency_key, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid
$$;
