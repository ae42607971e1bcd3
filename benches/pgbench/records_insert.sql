-- Mirrors src/store/postgres_tier.rs as of 2026-12-06 (see README.md in this directory).
-- A part: run.sh adds the key variable and composes the transactions.
-- A plain insert of an in-progress record: the table's own cost.
INSERT INTO idempotency_records AS r (digest, tenant, operation, idempotency_key, fingerprint, state, fence, owner, lease_expires_at, expires_at, tier, on_lease_expiry, retention_ms, tombstone_ms) VALUES (md5('k-' || :k)::uuid, 'bench', 'New', 'k-' || :k, '\x235a2fc965e95da766b78d4046bd29afbc73c90555bb3f8667fc9ed80c9255c8'::bytea, 'p', nextval('idempotency_fences'), 'd380a9403f008efb2d7d4bf4b159f555', now() + interval '30 s', now() + interval '1 day', 'standard', 't', 86400000, 604800000)
ON CONFLICT (digest, tenant) DO NOTHING;
