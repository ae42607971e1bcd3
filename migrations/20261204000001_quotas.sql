-- Per-tenant quotas (`Quota`). New keys are counted per tenant and operation in fixed windows of the
-- epoch (`window_index` windows of `window_ms`), one row per Postgres backend that counted: a
-- connection runs one transaction at a time, so a claim inside an application's transaction holds only
-- its own connection's row until it commits, and no claim ever waits for another's counter. The claim
-- estimates a sliding window from the current and previous windows' rows. A row is useless once both
-- windows have passed (`expires_at`); `purge_expired` deletes it.
CREATE TABLE idempotency_quota_usage (
    tenant       TEXT        NOT NULL,
    operation    TEXT        NOT NULL,
    window_ms    BIGINT      NOT NULL,
    window_index BIGINT      NOT NULL,
    backend      INTEGER     NOT NULL,
    claims       INTEGER     NOT NULL,
    expires_at   TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant, operation, window_ms, window_index, backend)
);

CREATE INDEX idempotency_quota_usage_expires_at ON idempotency_quota_usage (expires_at);

-- Every claim writes through this table (its statement names it, quota or not): each role granted
-- privileges on idempotency_records (the application's, when it does not own the tables) gets the same
-- ones here.
DO $$
DECLARE
    privilege record;
BEGIN
    FOR privilege IN
        SELECT a.privilege_type, a.grantee
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'idempotency_records'::regclass AND a.grantee <> c.relowner
          AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')
    LOOP
        EXECUTE format('GRANT %s ON idempotency_quota_usage TO %s', privilege.privilege_type,
            CASE WHEN privilege.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(privilege.grantee)) END);
    END LOOP;
END
$$;

-- Live keys are counted from the records in progress: at most the limit's number of index entries.
-- Every in-progress write maintains it, quota or not. Built under a lock that holds writes back
-- (migrations run in a transaction): on a large unpartitioned table, create it beforehand with CREATE
-- INDEX CONCURRENTLY under this name (check that it is valid), and this statement skips it.
CREATE INDEX IF NOT EXISTS idempotency_records_tenant_live
    ON idempotency_records (tenant, operation, lease_expires_at) WHERE state = 'p';
