-- The transactional outbox: rows the application writes in its own transaction, delivered afterwards by
-- a relay (`Outbox::drain`). A row exists until it is delivered; delivery deletes it.
CREATE TABLE idempotency_outbox (
    -- Delivery order within a topic, and the downstream's idempotency key (`outbox-<id>`).
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic           TEXT        NOT NULL,
    -- JSON, not JSONB: the sink receives exactly the text that was enqueued.
    payload         JSON        NOT NULL,
    enqueued_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Failed deliveries so far; the next one waits for `next_attempt_at` (exponential backoff).
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error      TEXT
);

-- Finds each topic's head (its oldest row) and the rows behind it without a scan.
CREATE INDEX idempotency_outbox_topic_id ON idempotency_outbox (topic, id);
