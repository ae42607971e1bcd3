-- Mirrors src/store/postgres_tier.rs as of 2026-12-06 (see README.md in this directory).
-- The completion statement (a part: run.sh composes it after a claim or an insert).
UPDATE idempotency_records AS r
SET state = 'c', response = '\x7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d'::bytea, owner = NULL, lease_expires_at = NULL, expires_at = clock_timestamp() + r.retention_ms::float8 * interval '1 millisecond', updated_at = now()
WHERE digest = md5('k-' || :k)::uuid AND tenant = 'bench' AND state IN ('p', 'i')
RETURNING waited, CASE WHEN expires_at IS NOT NULL THEN CEIL(GREATEST(0, EXTRACT(EPOCH
FROM expires_at - clock_timestamp()) * 1000))::bigint END AS expires_ms;
