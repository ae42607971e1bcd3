-- Mirrors src/store/postgres_tier.rs as of 2026-12-02 (see README.md in this directory).
-- The bare handler's insert.
INSERT INTO bench_charges (tenant, amount) VALUES ('bench', 1200) RETURNING id;
