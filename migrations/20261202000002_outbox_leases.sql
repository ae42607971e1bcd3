-- A relay leases a topic for the time of one batch instead of holding a transaction open across the
-- sink's calls: one row per topic being delivered, gone when the batch is settled. A relay that dies
-- leaves its lease to run out (`until`), and the topic's rows are delivered again by the next one.
CREATE TABLE idempotency_outbox_leases (
    topic  TEXT        PRIMARY KEY,
    -- The holder's random token: a settlement under another token records nothing.
    token  BIGINT      NOT NULL,
    until  TIMESTAMPTZ NOT NULL
);

-- Part of every row's idempotency key (`outbox-<id>-<nonce>`), so a key never repeats when ids do (the
-- sequence restarted by TRUNCATE ... RESTART IDENTITY, a restored backup, a logical-replication
-- upgrade). Written by `Outbox::enqueue`, not by a default: rows written before this migration, or by an
-- older binary during a rollout, keep `outbox-<id>`, the key older relays deliver them under.
ALTER TABLE idempotency_outbox ADD COLUMN key_nonce BIGINT;
