-- The store's schema, as of the first release. Later changes are expand/contract: a migration adds what
-- the new code needs without breaking the code before it, and removes what only the old code used once no
-- process of it runs, so a rolling deploy never stops a store.

-- The source of truth: one row per (tenant, operation, idempotency_key), named by its digest. The primary
-- key makes "two concurrent claims, exactly one winner" atomic. It is laid out for writing, since every
-- new key writes a row (benches/pgbench, docs/performance.md): a 16-byte digest leads the primary key
-- instead of three text columns, so an index entry is small and compared by memcmp, not by collation; the
-- clear names stay as columns for operators, unindexed. The tenant is in the key too: a digest can only
-- ever name its own tenant's record, and a table partitioned by tenant keeps the key unique per partition.
CREATE TABLE idempotency_records (
    -- `idempotency_key_digest(tenant, operation, idempotency_key)`, as the application computes it.
    digest           uuid        NOT NULL,
    tenant           TEXT        NOT NULL,
    operation        TEXT        NOT NULL,
    idempotency_key  TEXT        NOT NULL,
    -- SHA-256 of the canonical payload that claimed the key.
    fingerprint      BYTEA       NOT NULL,
    -- p in progress, c completed, r released, i indeterminate (the letters Redis copies use too).
    state            "char"      NOT NULL CONSTRAINT idempotency_records_state_check
        CHECK (state IN ('p', 'c', 'r', 'i')),
    -- Fencing token, from `idempotency_fences` on every (re-)acquisition: a stale owner's writes match no row.
    fence            BIGINT      NOT NULL,
    -- Random token of the current owner; Redis markers carry the same one.
    owner            TEXT,
    lease_expires_at TIMESTAMPTZ,
    response         BYTEA,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- When the record may be purged; NULL keeps it forever (ledger entries).
    expires_at       TIMESTAMPTZ,
    -- The tier (policy name) the record was claimed under: what retention was promised to its request,
    -- even after the configuration changes.
    tier             TEXT        NOT NULL,
    -- What a lease that runs out means for this record, as claimed (t take over, m mark indeterminate):
    -- any recoverer (another service, idemctl) applies the rule the record was claimed under.
    on_lease_expiry  "char"      NOT NULL CONSTRAINT idempotency_records_on_lease_expiry_check
        CHECK (on_lease_expiry IN ('t', 'm')),
    -- How long the record is kept once completed (NULL: forever), as claimed: an operator resolving it
    -- later keeps the promise made to its request.
    retention_ms     BIGINT,
    -- How long a purged record's tombstone answers "expired" (NULL: forever), as claimed.
    tombstone_ms     BIGINT,
    -- Set by a claim that waits for this in-progress record's owner (`RunOptions::wait_in_flight`) without
    -- a Redis subscription: the owner's completion or release then announces itself with `pg_notify`.
    -- Only waited-for records pay for a notification.
    waited           BOOLEAN     NOT NULL DEFAULT false,
    CONSTRAINT idempotency_records_pkey PRIMARY KEY (digest, tenant)
);

-- Each secondary index is an entry every new key writes, so there are only those a query needs. The
-- purge (`purge_expired`) walks this one in bounded batches instead of scanning the table.
CREATE INDEX idempotency_records_expires_at
    ON idempotency_records (expires_at) WHERE expires_at IS NOT NULL;

-- The in-progress records, a few per tenant at any time: the live-key quota counts a tenant's from here
-- (at most the limit's number of entries), and recovery of stale leases (`recover_stale`, the stale
-- gauge) reads the whole index, which holds nothing else. A completion leaves the index (its row no
-- longer matches): it writes no entry here.
CREATE INDEX idempotency_records_in_progress
    ON idempotency_records (tenant, operation, lease_expires_at) WHERE state = 'p';

-- Counting and listing records that await an operator stays cheap however large the table grows. No
-- claim or completion writes an entry here.
CREATE INDEX idempotency_records_indeterminate
    ON idempotency_records (updated_at) WHERE state = 'i';

-- Fences come from one sequence, so a key's fences never repeat over its whole life, purges included:
-- an owner whose record was purged and claimed again can never match the new record with its old fence.
CREATE SEQUENCE idempotency_fences AS BIGINT;

-- A 16-byte digest naming a key in the records and tombstones: `uuid` is Postgres's fixed 16-byte type, so
-- rows and their index entries stay small. The lengths make the input unambiguous, as in Redis keys; they
-- count the UTF-8 bytes of each name, as the application's digest does, whatever the database's encoding.
CREATE FUNCTION idempotency_key_digest(tenant TEXT, operation TEXT, idempotency_key TEXT) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $$
    SELECT encode(substring(sha256(convert_to(
        octet_length(convert_to(tenant, 'UTF8')) || ':' || tenant || ':'
            || octet_length(convert_to(operation, 'UTF8')) || ':' || operation || ':'
            || idempotency_key, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid
$$;

-- What is left of a completed record once its retention ran out and it was purged: enough to refuse a
-- late retry ("expired", or "mismatch" for another payload) instead of executing it again.
CREATE TABLE idempotency_tombstones (
    digest       uuid        PRIMARY KEY,
    -- The first 8 bytes of the payload fingerprint that completed: enough to tell "expired" (this
    -- payload) from "mismatch" (another); both refuse, so a collision could only pick the other refusal.
    fingerprint  BIGINT      NOT NULL,
    -- The last fence of the key.
    fence        BIGINT      NOT NULL,
    -- When the tombstone may go (NULL: never); after that the key is new again. (No completion time:
    -- 8 more bytes a row would take a tombstone past 120 bytes with its index.)
    expires_at   TIMESTAMPTZ
);

-- Tombstones are written in purge order, so their horizons correlate with the heap: a BRIN index finds
-- the ones to remove at a few bytes per thousand rows.
CREATE INDEX idempotency_tombstones_expires_at ON idempotency_tombstones USING brin (expires_at);

-- The transactional outbox: rows the application writes in its own transaction, delivered afterwards by
-- a relay (`Outbox::drain`). A row exists until it is delivered; delivery deletes it.
CREATE TABLE idempotency_outbox (
    -- Delivery order within a topic.
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic           TEXT        NOT NULL,
    -- JSON, not JSONB: the sink receives exactly the text that was enqueued.
    payload         JSON        NOT NULL,
    enqueued_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Failed deliveries so far; the next one waits for `next_attempt_at` (exponential backoff).
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error      TEXT,
    -- Part of the row's idempotency key downstream (`outbox-<id>-<nonce>`), so a key never repeats when
    -- ids do (the sequence restarted by TRUNCATE ... RESTART IDENTITY, a restored backup, a
    -- logical-replication upgrade). Random, below 2^52.
    key_nonce       BIGINT      NOT NULL DEFAULT (floor(random() * 4503599627370496))::bigint
);

-- Finds each topic's head (its oldest row) and the rows behind it without a scan.
CREATE INDEX idempotency_outbox_topic_id ON idempotency_outbox (topic, id);

-- A relay leases a topic for the time of one batch instead of holding a transaction open across the
-- sink's calls: one row per topic being delivered, gone when the batch is settled. A relay that dies
-- leaves its lease to run out (`until`), and the topic's rows are delivered again by the next one.
CREATE TABLE idempotency_outbox_leases (
    topic  TEXT        PRIMARY KEY,
    -- The holder's random token: a settlement under another token records nothing.
    token  BIGINT      NOT NULL,
    until  TIMESTAMPTZ NOT NULL
);

-- Per-tenant quotas (`Quota`). New keys are counted per tenant and operation in fixed windows of the
-- epoch (`window_index` windows of `window_ms`), one row per Postgres backend that counted: a
-- connection runs one transaction at a time, so a claim inside an application's transaction holds only
-- its own connection's row until it commits, and no claim ever waits for another's counter. The claim
-- estimates a sliding window from the current and previous windows' rows. A row is useless once both
-- windows have passed (`expires_at`); `purge_expired` deletes it. Every claim writes through this table
-- (its statement names it, quota or not): a role that uses the store needs the same privileges here as
-- on idempotency_records.
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
