-- The demo webhook receiver's side effect: one row per handled event (no unique constraint, so a double
-- handling would show as two rows).
CREATE TABLE webhook_events (
    id          BIGSERIAL   PRIMARY KEY,
    provider    TEXT        NOT NULL,
    event_id    TEXT        NOT NULL,
    received_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
