-- The demo's side effect: one row per executed charge. Deliberately without a unique constraint on the
-- idempotency key, so a double execution would show up as two rows.
CREATE TABLE charges (
    id         BIGSERIAL   PRIMARY KEY,
    tenant     TEXT        NOT NULL,
    amount     BIGINT      NOT NULL,
    currency   TEXT        NOT NULL,
    customer   TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
