-- Stands in for the demo's mail provider: receipts sent through the transactional outbox land here, one
-- per idempotency key, the way a real provider deduplicates a re-sent request.
CREATE TABLE receipts (
    idempotency_key TEXT        PRIMARY KEY,
    charge_id       BIGINT      NOT NULL,
    customer        TEXT        NOT NULL,
    sent_at         TIMESTAMPTZ NOT NULL DEFAULT now()
);
