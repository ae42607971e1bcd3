-- Mirrors src/store/postgres_tier.rs as of 2026-12-05 (see README.md in this directory).
-- A part: the key's lock (and, under a live-key quota, a slot; none here) that a claim inside the
-- caller's transaction takes before the claim (HOLD_KEY); hashtext stands in for the key's digest.
SELECT held, CASE WHEN held AND NULL::int4 IS NOT NULL THEN (
SELECT slot FROM (SELECT generate_series(0, least(NULL::int4, 65536) - 1) AS slot) AS slots
WHERE pg_try_advisory_xact_lock((1::int8 << 16) | slot) LIMIT 1) END AS slot
FROM (SELECT pg_try_advisory_xact_lock(hashtext('k-' || :k)::int8 | (1::int8 << 63)) AS held) AS key;
