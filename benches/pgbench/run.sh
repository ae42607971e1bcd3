#!/usr/bin/env bash
# Postgres alone, without the application: each script of this directory under pgbench, at each
# number of clients in CLIENTS (default "16"), SECONDS_EACH (default 5) seconds, three times, interleaved;
# prints the median transactions per second of each and its ratio to `bare` at the same clients.
#
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres CLIENTS="1 16 64" bash benches/pgbench/run.sh
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
    bare_in_tx="BEGIN bare COMMIT"
    records_insert=records_insert
    claim_new=claim_new
    claim=claim
    records_insert_complete="records_insert complete"
    plain="claim_new bare complete"
    in_tx="begin_locked claim_in_tx bare complete_in_tx COMMIT"
    in_tx_floor="BEGIN bare records_insert_completed COMMIT"
)
composed="$(mktemp -d)"
trap 'rm -rf "$composed"' EXIT
for entry in "${scripts[@]}"; do
    name="${entry%%=*}"
    {
        echo '\set k random(1, 2000000000)'
        for part in ${entry#*=}; do
            case "$part" in
                BEGIN|COMMIT) echo "$part;" ;;
                # CLAIM_NEW is the full claim without its re-acquisition, as in the store.
                claim_new) grep -v '^--' "$here/claim.sql" \
                    | sed "/^ON CONFLICT (digest, tenant) DO UPDATE\$/,/^WHERE (r.state/c\\ON CONFLICT (digest, tenant) DO NOTHING" ;;
                *) grep -v '^--' "$here/$part.sql" ;;
            esac
        done
    # The key's lock, as every claim takes it: hashtext stands in for the digest's 63 bits.
    } | sed "s/:key_lock/(hashtext('k-' || :k)::int8 | (1::int8 << 63))/g" > "$composed/$name.sql"
done
declare -A runs
# SCRIPTS="a b" runs those only.
selected=()
for entry in "${scripts[@]}"; do
    [[ -z "${SCRIPTS:-}" || " $SCRIPTS " == *" ${entry%%=*} "* ]] && selected+=("$entry")
done
scripts=("${selected[@]}")
clients="${CLIENTS:-16}"
for round in 1 2 3; do
    for c in $clients; do
        for entry in "${scripts[@]}"; do
            script="${entry%%=*}"
            tps=$(pgbench "$DATABASE_URL" -n -M prepared -c "$c" -j "$(( c < 2 ? 1 : 2 ))" -T "${SECONDS_EACH:-5}" \
                -f "$composed/$script.sql" 2>&1 | awk '/^tps/ { printf "%.0f", $3 }')
            runs[$script@$c]="${runs[$script@$c]:-} $tps"
        done
    done
done
printf '%-24s %7s %8s %7s  %s\n' script clients tps "/ bare" runs
for c in $clients; do
    bare=$(tr ' ' '\n' <<<"${runs[bare@$c]:-}" | grep . | sort -n | sed -n 2p || true)
    for entry in "${scripts[@]}"; do
        script="${entry%%=*}"
        median=$(tr ' ' '\n' <<<"${runs[$script@$c]}" | grep . | sort -n | sed -n 2p)
        ratio=$([[ -n "$bare" ]] && awk -v a="$median" -v b="$bare" 'BEGIN { printf "%.2f", a / b }' || echo -)
        printf '%-24s %7s %8s %7s  (%s)\n' "$script" "$c" "$median" "$ratio" "${runs[$script@$c]# }"
    done
done
