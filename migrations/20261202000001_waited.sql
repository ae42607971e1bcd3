-- Set by a claim that waits for this in-progress record's owner (`RunOptions::wait_in_flight`) without
-- a Redis subscription: the owner's completion or release then announces itself with `pg_notify`. Only
-- waited-for records pay for a notification. (A constant default costs no table rewrite.)
ALTER TABLE idempotency_records ADD COLUMN waited BOOLEAN NOT NULL DEFAULT false;
