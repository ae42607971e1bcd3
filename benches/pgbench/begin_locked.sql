-- Mirrors src/store/postgres_tier.rs as of 2026-12-06 (see README.md in this directory).
-- A part: BEGIN with the key's lock tried in the same round trip (begin_statement), pipelined here as
-- the store sends it in one simple query; :key_lock is written by run.sh.
\startpipeline
BEGIN;
SELECT set_config('idemstore.key_lock', pg_try_advisory_xact_lock(:key_lock)::text || ':' || :key_lock, true);
\endpipeline
