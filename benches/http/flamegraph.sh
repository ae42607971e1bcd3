#!/usr/bin/env bash
# A flame graph of the HTTP bench's server side (the app, the layer, the store's clients; not wrk, Redis or
# Postgres), from perf's software clock (works without hardware counters).
#   bash benches/http/flamegraph.sh <subject> <workload> <connections> <out.svg>
#   e.g. bash benches/http/flamegraph.sh two-tier replay 64 docs/bench/flame/http-replay-two-tier.svg
# Needs linux-perf (apt) and inferno (cargo install inferno).
set -euo pipefail
subject=$1 workload=$2 connections=$3 out=$4
cd "$(dirname "$0")/../.."
binary=$(cargo bench --bench http --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys; print(next(m["executable"] for m in map(json.loads, sys.stdin) if m.get("target", {}).get("name") == "http" and m.get("executable")))')
"$binary" --bench --subjects "$subject" --workloads "$workload" --concurrency "$connections" --rounds 1 --seconds 20 \
  >/dev/null 2>&1 &
bench=$!
sleep 8 # past the servers' start, the warm-up and the cell's preparation
data=$(mktemp)
perf record -q -e cpu-clock -F 997 --call-graph dwarf,16384 -p "$bench" -o "$data" -- sleep 8
wait "$bench"
perf script -i "$data" 2>/dev/null | inferno-collapse-perf | inferno-flamegraph --minwidth 0.2 \
  --title "$subject $workload, $connections connections" >"$out"
rm -f "$data"
echo "written: $out"
