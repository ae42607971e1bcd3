-- Mirrors src/store/postgres_tier.rs as of 2026-12-05 (see README.md in this directory).
-- A part: run.sh adds the key variable and composes the transactions.
-- The claim of a key Redis had nothing of (CLAIM_NEW), as sent, the parameters inlined; md5 stands in
-- for the key's digest. run.sh writes :key_lock as NULL outside a transaction (nothing is taken), and
-- as the key's lock inside one (hashtext stands in for the digest's 63 bits).
WITH key_lock AS MATERIALIZED (
SELECT CASE WHEN :key_lock IS NULL THEN true ELSE pg_try_advisory_xact_lock(:key_lock) END AS held
)
INSERT INTO idempotency_records AS r
(tenant, operation, idempotency_key, fingerprint, state, fence, owner, lease_expires_at, expires_at,
tier, on_lease_expiry, retention_ms, tombstone_ms)
SELECT 'bench'::text, 'New'::text, ('k-' || :k)::text, '\x235a2fc965e95da766b78d4046bd29afbc73c90555bb3f8667fc9ed80c9255c8'::bytea, 'p'::"char", nextval('idempotency_fences'), '158a0a2e0c7cdcfc36f7e45c9a502e04'::text,
now() + '30000'::float8::float8 * interval '1 millisecond',
CASE WHEN '86400000'::float8::float8 IS NOT NULL
THEN now() + GREATEST('30000'::float8::float8, '86400000'::float8::float8) * interval '1 millisecond' END,
'standard'::text, CASE WHEN true THEN 't' ELSE 'm' END::"char", '86400000'::float8::float8::bigint,
'604800000'::float8::float8::bigint
FROM key_lock
WHERE key_lock.held
AND NOT EXISTS (SELECT 1 FROM idempotency_records
WHERE tenant = 'bench'::text AND operation = 'New'::text AND idempotency_key = ('k-' || :k)::text)
AND NOT EXISTS (SELECT 'e'::"char" AS state, int8send(fingerprint) AS fingerprint, fence,
NULL::text AS owner, NULL::bytea AS response, NULL::text AS tier, NULL::"char" AS on_lease_expiry,
NULL::timestamptz AS lease_expires_at, expires_at
FROM idempotency_tombstones
WHERE digest = md5('k-' || :k)::uuid AND (expires_at IS NULL OR expires_at > now()))
ON CONFLICT (tenant, operation, idempotency_key) DO NOTHING
RETURNING true AS acquired, NULL::"char" AS prior_state, NULL::"char" AS quota_limit,
NULL::bigint AS quota_retry_ms, true AS held, state, fingerprint, fence, response, tier, on_lease_expiry,
CASE WHEN lease_expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH FROM lease_expires_at - now()) * 1000))::bigint END AS lease_ms,
CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH FROM expires_at - now()) * 1000))::bigint END AS expires_ms;
