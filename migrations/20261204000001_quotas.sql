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

-- Live keys are counted from the records in progress: at most the limit's number of index entries.
-- Built under a lock that holds writes back (migrations run in a transaction): on a large table, create
-- it beforehand with CREATE INDEX CONCURRENTLY under this name, and this statement skips it.
CREATE INDEX IF NOT EXISTS idempotency_records_tenant_live
    ON idempotency_records (tenant, operation, lease_expires_at) WHERE state = 'p';
