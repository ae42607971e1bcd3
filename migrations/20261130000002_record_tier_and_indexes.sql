-- The tier (policy name) a record was stored under: what retention was promised to its request, even
-- after the configuration changes. NULL for records stored before this column existed.
ALTER TABLE idempotency_records ADD COLUMN tier TEXT;

-- What a lease that runs out means for this record ('take_over' or 'mark_indeterminate'), as claimed:
-- any recoverer (another service, idemctl) applies the rule the record was claimed under.
ALTER TABLE idempotency_records ADD COLUMN on_lease_expiry TEXT
    CHECK (on_lease_expiry IN ('take_over', 'mark_indeterminate'));

-- How long the record is kept once completed (NULL: forever), as claimed: an operator resolving it
-- later keeps the promise made to its request.
ALTER TABLE idempotency_records ADD COLUMN retention_ms BIGINT;

-- Counting and listing records that await an operator stays cheap however large the table grows.
CREATE INDEX idempotency_records_indeterminate
    ON idempotency_records (updated_at) WHERE state = 'indeterminate';
