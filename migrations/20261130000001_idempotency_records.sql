-- The source of truth: one row per (tenant, operation, idempotency_key).
-- The primary key makes "two concurrent claims, exactly one winner" atomic.
CREATE TABLE idempotency_records (
    tenant           TEXT        NOT NULL,
    operation        TEXT        NOT NULL,
    idempotency_key  TEXT        NOT NULL,
    -- Hex SHA-256 of the canonical payload that claimed the key.
    fingerprint      TEXT        NOT NULL,
    state            TEXT        NOT NULL
        CHECK (state IN ('in_progress', 'completed', 'released', 'indeterminate')),
    -- Fencing token: +1 on every re-acquisition, so a stale owner's writes match no row.
    fence            BIGINT      NOT NULL,
    -- Random token of the current owner; Redis markers carry the same one.
    owner            TEXT,
    lease_expires_at TIMESTAMPTZ,
    response         BYTEA,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- When the record may be purged; NULL keeps it forever (ledger entries).
    expires_at       TIMESTAMPTZ,
    PRIMARY KEY (tenant, operation, idempotency_key)
);

-- Purging walks this index in bounded batches instead of scanning the table.
CREATE INDEX idempotency_records_expires_at
    ON idempotency_records (expires_at) WHERE expires_at IS NOT NULL;

-- Recovery of stale in-progress records finds them without a scan.
CREATE INDEX idempotency_records_in_progress_lease
    ON idempotency_records (lease_expires_at) WHERE state = 'in_progress';
