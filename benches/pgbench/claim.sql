-- Mirrors src/store/postgres_tier.rs as of 2026-12-06 (see README.md in this directory).
-- A part: run.sh adds the key variable and composes the transactions.
-- The claim statement (no quota) for a new key (run.sh makes CLAIM_NEW of it: the same without the
-- re-acquisition); md5 stands in for the key's digest, and :key_lock is written by run.sh.
WITH key_lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock_shared(:key_lock) AS held), prior AS (
SELECT state, fingerprint, fence, owner, response, tier, on_lease_expiry, lease_expires_at, expires_at
FROM idempotency_records
WHERE digest = md5('k-' || :k)::uuid AND tenant = 'bench'::text
), buried AS (SELECT 'e'::"char" AS state, int8send(fingerprint) AS fingerprint, fence, NULL::text AS owner, NULL::bytea AS response, NULL::text AS tier, NULL::"char" AS on_lease_expiry, NULL::timestamptz AS lease_expires_at, expires_at
FROM idempotency_tombstones
WHERE digest = md5('k-' || :k)::uuid AND (expires_at IS NULL OR expires_at > now()) AND NOT EXISTS (SELECT 1
FROM prior)
), claimed AS (
INSERT INTO idempotency_records AS r (digest, tenant, operation, idempotency_key, fingerprint, state, fence, owner, lease_expires_at, expires_at, tier, on_lease_expiry, retention_ms, tombstone_ms)
SELECT md5('k-' || :k)::uuid, 'bench'::text, 'New'::text, ('k-' || :k)::text, '\x235a2fc965e95da766b78d4046bd29afbc73c90555bb3f8667fc9ed80c9255c8'::bytea, 'p'::"char", nextval('idempotency_fences'), 'd380a9403f008efb2d7d4bf4b159f555'::text, now() + '30000'::float8::float8 * interval '1 millisecond', CASE WHEN '86400000'::float8::float8 IS NOT NULL THEN now() + GREATEST('30000'::float8::float8, '86400000'::float8::float8) * interval '1 millisecond' END, 'standard'::text, CASE WHEN true THEN 't' ELSE 'm' END::"char", '86400000'::float8::float8::bigint, '604800000'::float8::float8::bigint
WHERE (SELECT held FROM key_lock) AND NOT EXISTS (SELECT 1
FROM buried) AND NOT EXISTS (SELECT 1
FROM prior
WHERE state IN ('c', 'i') OR (state = 'p' AND (lease_expires_at > now() OR on_lease_expiry = 'm')))
ON CONFLICT (digest, tenant) DO UPDATE
SET fingerprint = EXCLUDED.fingerprint, state = 'p', fence = GREATEST(nextval('idempotency_fences'), r.fence + 1), owner = EXCLUDED.owner, lease_expires_at = EXCLUDED.lease_expires_at, response = NULL, expires_at = CASE WHEN r.retention_ms::float8 IS NOT NULL THEN now() + GREATEST('30000'::float8::float8, r.retention_ms::float8) * interval '1 millisecond' END, waited = false, updated_at = now()
WHERE (r.state = 'r' AND (r.fingerprint = EXCLUDED.fingerprint OR r.expires_at <= now())) OR (r.state = 'p' AND r.lease_expires_at <= now() AND r.on_lease_expiry = 't' AND (r.fingerprint = EXCLUDED.fingerprint OR r.expires_at <= now()))
RETURNING state, fingerprint, fence, owner, response, tier, on_lease_expiry, lease_expires_at, expires_at )
SELECT true AS acquired, (SELECT state
FROM prior) AS prior_state, NULL::"char" AS quota_limit, NULL::bigint AS quota_retry_ms, state, fingerprint, fence, response, tier, on_lease_expiry, CASE WHEN lease_expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM lease_expires_at - now()) * 1000))::bigint END AS lease_ms, CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM expires_at - now()) * 1000))::bigint END AS expires_ms, true AS held
FROM claimed UNION ALL
SELECT false, NULL, NULL, NULL, state, fingerprint, fence, response, tier, on_lease_expiry, CASE WHEN lease_expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM lease_expires_at - now()) * 1000))::bigint END AS lease_ms, CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM expires_at - now()) * 1000))::bigint END AS expires_ms, (SELECT held FROM key_lock)
FROM prior
WHERE NOT EXISTS (SELECT 1
FROM claimed) UNION ALL
SELECT false, NULL, NULL, NULL, state, fingerprint, fence, response, tier, on_lease_expiry, CASE WHEN lease_expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM lease_expires_at - now()) * 1000))::bigint END AS lease_ms, CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM expires_at - now()) * 1000))::bigint END AS expires_ms, (SELECT held FROM key_lock)
FROM buried UNION ALL
SELECT false, NULL, NULL, NULL, NULL::"char", NULL::bytea, NULL::bigint, NULL::bytea, NULL::text, NULL::"char", NULL::bigint, NULL::bigint, false
WHERE NOT (SELECT held FROM key_lock) AND NOT EXISTS (SELECT 1 FROM prior) AND NOT EXISTS (SELECT 1 FROM buried);
