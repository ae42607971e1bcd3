#!/usr/bin/env bash
# Postgres alone, without the application: each script of this directory under pgbench, 16 clients,
# 5 seconds, three times, interleaved; prints the median transactions per second of each.
#
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres bash benches/pgbench/run.sh
#
# The database needs idemstore's schema (`cargo run --features cli --bin idemctl -- migrate`); the
# scripts add their own table (bench_charges). Rows they insert stay: use a throwaway database.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${DATABASE_URL:?set DATABASE_URL to a throwaway database migrated by idemctl}"
psql "$DATABASE_URL" -qc "CREATE TABLE IF NOT EXISTS bench_charges (id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, amount BIGINT NOT NULL)"
scripts=(bare records_insert claim_new claim records_insert_complete plain in_tx in_tx_claim_new)
declare -A runs
for round in 1 2 3; do
    for script in "${scripts[@]}"; do
        tps=$(pgbench "$DATABASE_URL" -n -M prepared -c 16 -j 2 -T 5 -f "$here/$script.sql" 2>&1 \
            | awk '/^tps/ { printf "%.0f", $3 }')
        runs[$script]="${runs[$script]:-} $tps"
    done
done
for script in "${scripts[@]}"; do
    median=$(tr ' ' '\n' <<<"${runs[$script]}" | grep . | sort -n | sed -n 2p)
    printf '%-24s %6s tps  (runs:%s)\n' "$script" "$median" "${runs[$script]}"
done
