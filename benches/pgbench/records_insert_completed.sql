-- Mirrors src/store/postgres_tier.rs as of 2026-12-06 (see README.md in this directory).
-- A part: run.sh adds the key variable and composes the transactions.
-- A plain insert of a completed record, its response included: the least a store that keeps the answer
-- in this table writes for a new key (no claim before the work, no update after it).
INSERT INTO idempotency_records AS r (digest, tenant, operation, idempotency_key, fingerprint, state, fence, owner, lease_expires_at, expires_at, tier, on_lease_expiry, retention_ms, tombstone_ms, response) VALUES (md5('k-' || :k)::uuid, 'bench', 'New', 'k-' || :k, '\x235a2fc965e95da766b78d4046bd29afbc73c90555bb3f8667fc9ed80c9255c8'::bytea, 'c', nextval('idempotency_fences'), NULL, NULL, now() + interval '1 day', 'standard', 't', 86400000, 604800000, '\x7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d7b22636861726765223a31327d'::bytea)
ON CONFLICT (digest, tenant) DO NOTHING;
