#!/usr/bin/env bash
# Quick durable check: baseline-sqlite and ours-sqlite alternated, R rounds, one workload each (default W1).
#   bench/quick.sh [W1|W3|W4] [rounds]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
harness=${HARNESS:-"$root/../shared/bench/peers"}
py="${PY:-$root/.venv/bin/python}"
wl=${1:-W1}; rounds=${2:-3}
export PYTHONPATH="$harness:$here"
for _ in $(seq "$rounds"); do
    "$py" "$harness/bench_baseline.py" --sqlite "$wl"
    "$py" "$here/bench_ours_sqlite.py" "$wl"
done
