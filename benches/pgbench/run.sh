#!/usr/bin/env bash
# Postgres alone, without the application: each script of this directory under pgbench, 16 clients,
# 5 seconds, three times, interleaved; prints the median transactions per second of each.
#
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres bash benches/pgbench/run.sh
#
# The database needs idemstore's schema (`cargo run -p idemstore-cli -- migrate`); the
# scripts add their own table (bench_charges). Rows they insert stay: use a throwaway database.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${DATABASE_URL:?set DATABASE_URL to a throwaway database migrated by idemctl}"
psql "$DATABASE_URL" -qc "CREATE TABLE IF NOT EXISTS bench_charges (id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, amount BIGINT NOT NULL)"
# The statements are parts; a script is a sequence of them, composed here so that each statement is
# written once: `name=part part ...`, with BEGIN and COMMIT as parts of their own.
scripts=(
    bare=bare
    records_insert=records_insert
    claim_new=claim_new
    claim=claim
    records_insert_complete="records_insert complete"
    plain="claim bare complete"
    in_tx="BEGIN claim bare complete COMMIT"
    in_tx_claim_new="BEGIN claim_new bare complete COMMIT"
    in_tx_floor="BEGIN bare records_insert_completed COMMIT"
)
composed="$(mktemp -d)"
trap 'rm -rf "$composed"' EXIT
for entry in "${scripts[@]}"; do
    name="${entry%%=*}"
    {
        echo '\set k random(1, 2000000000)'
        # The key's lock: taken inside a transaction only, as the store does.
        key_lock='NULL::int8'
        for part in ${entry#*=}; do
            case "$part" in
                BEGIN) echo "$part;"; key_lock="(hashtext('k-' || :k)::int8 | (1::int8 << 63))" ;;
                COMMIT) echo "$part;"; key_lock='NULL::int8' ;;
                *) grep -v '^--' "$here/$part.sql" | sed "s/:key_lock/$key_lock/g" ;;
            esac
        done
    } > "$composed/$name.sql"
done
declare -A runs
# SCRIPTS="a b" runs those only.
selected=()
for entry in "${scripts[@]}"; do
    [[ -z "${SCRIPTS:-}" || " $SCRIPTS " == *" ${entry%%=*} "* ]] && selected+=("$entry")
done
scripts=("${selected[@]}")
for round in 1 2 3; do
    for entry in "${scripts[@]}"; do
        script="${entry%%=*}"
        tps=$(pgbench "$DATABASE_URL" -n -M prepared -c 16 -j 2 -T 5 -f "$composed/$script.sql" 2>&1 \
            | awk '/^tps/ { printf "%.0f", $3 }')
        runs[$script]="${runs[$script]:-} $tps"
    done
done
for entry in "${scripts[@]}"; do
    script="${entry%%=*}"
    median=$(tr ' ' '\n' <<<"${runs[$script]}" | grep . | sort -n | sed -n 2p)
    printf '%-24s %6s tps  (runs:%s)\n' "$script" "$median" "${runs[$script]}"
done
