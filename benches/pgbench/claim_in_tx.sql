-- Mirrors src/store/postgres_tier.rs as of 2026-12-06 (see README.md in this directory).
-- A part, after begin_locked: the claim inside the transaction (CLAIM_IN_TX), a read; the new record's
-- fence is kept for complete_in_tx. md5 stands in for the key's digest.
WITH key_lock AS MATERIALIZED (
SELECT CASE WHEN current_setting('transaction_isolation') <> 'read committed' THEN NULL
WHEN current_setting('idemstore.key_lock', true) = 'true:' || :key_lock THEN true
WHEN current_setting('idemstore.key_lock', true) = 'false:' || :key_lock THEN false END AS held
), found AS (
SELECT state, fingerprint, fence, owner, response, tier, on_lease_expiry, lease_expires_at, expires_at
FROM idempotency_records WHERE digest = md5('k-' || :k)::uuid AND tenant = 'bench'
), buried AS (SELECT 'e'::"char" AS state, int8send(fingerprint) AS fingerprint, fence, NULL::text AS owner, NULL::bytea AS response, NULL::text AS tier, NULL::"char" AS on_lease_expiry, NULL::timestamptz AS lease_expires_at, expires_at
FROM idempotency_tombstones
WHERE digest = md5('k-' || :k)::uuid AND (expires_at IS NULL OR expires_at > now()) AND NOT EXISTS (SELECT 1 FROM found)
)
SELECT held, state, fingerprint, fence, response, tier, on_lease_expiry, CASE WHEN lease_expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH FROM lease_expires_at - now()) * 1000))::bigint END AS lease_ms, CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH FROM expires_at - now()) * 1000))::bigint END AS expires_ms
FROM key_lock, (SELECT * FROM found UNION ALL SELECT * FROM buried) AS record
UNION ALL
SELECT held, NULL, NULL, CASE WHEN held THEN nextval('idempotency_fences') END, NULL, NULL, NULL, NULL, NULL
FROM key_lock WHERE NOT EXISTS (SELECT 1 FROM found) AND NOT EXISTS (SELECT 1 FROM buried)
\gset
