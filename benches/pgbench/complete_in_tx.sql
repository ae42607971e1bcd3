-- Mirrors src/store/postgres_tier.rs as of 2026-12-06 (see README.md in this directory).
-- A part, after claim_in_tx: the completion inside the claim's transaction (COMPLETE_IN_TX), the record
-- inserted once, completed, under the fence the claim took.
INSERT INTO idempotency_records AS r (digest, tenant, operation, idempotency_key, fingerprint, state, fence, response, expires_at, tier, on_lease_expiry, retention_ms, tombstone_ms)
VALUES (md5('k-' || :k)::uuid, 'bench', 'New', 'k-' || :k, '\x235a2fc965e95da766b78d4046bd29afbc73c90555bb3f8667fc9ed80c9255c8'::bytea, 'c', :fence, '\x7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d'::bytea, clock_timestamp() + '86400000'::float8 * interval '1 millisecond', 'standard', CASE WHEN true THEN 't' ELSE 'm' END::"char", '86400000'::float8::bigint, '604800000'::float8::bigint)
ON CONFLICT (digest, tenant) DO UPDATE SET state = 'c', response = EXCLUDED.response, owner = NULL, lease_expires_at = NULL, expires_at = clock_timestamp() + r.retention_ms::float8 * interval '1 millisecond', updated_at = now()
WHERE r.fence = EXCLUDED.fence AND r.state IN ('p', 'i')
RETURNING waited, CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000))::bigint END AS expires_ms;
