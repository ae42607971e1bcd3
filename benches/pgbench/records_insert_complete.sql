-- Mirrors src/store/postgres_tier.rs as of 2026-12-02 (see README.md in this directory).
-- A plain insert, then the completion statement.
\set k random(1, 2000000000)
INSERT INTO idempotency_records AS r (tenant, operation, idempotency_key, fingerprint, state, fence, owner, lease_expires_at, expires_at, tier, on_lease_expiry, retention_ms, tombstone_ms) VALUES ('bench', 'New', 'k-' || :k, '\x235a2fc965e95da766b78d4046bd29afbc73c90555bb3f8667fc9ed80c9255c8'::bytea, 'p', nextval('idempotency_fences'), 'd380a9403f008efb2d7d4bf4b159f555', now() + interval '30 s', now() + interval '1 day', 'standard', 't', 86400000, 604800000)
ON CONFLICT (tenant, operation, idempotency_key) DO NOTHING;
UPDATE idempotency_records
SET state = 'c', response = '\x7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d'::bytea, owner = NULL, lease_expires_at = NULL, expires_at = now() + retention_ms::float8 * interval '1 millisecond', updated_at = now()
WHERE tenant = 'bench' AND operation = 'New' AND idempotency_key = 'k-' || :k AND state IN ('p', 'i')
RETURNING waited, CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM expires_at - now()) * 1000))::bigint END AS expires_ms;
