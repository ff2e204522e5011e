#!/usr/bin/env bash
# agentloop on the peer harness's workloads, beside the hand-written baselines measured in the same run.
#
#   bench/run.sh            # baseline + agentloop (W1 W1a W2 W3 W4), then ratios against the targets
#   bench/run.sh --peers    # also the peer frameworks (builds their venv once in bench/.peers-venv)
#
# Env: the harness's knobs (BENCH_N, BENCH_W3_STEPS, ...; see ../shared/bench/peers/common.py).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
harness=${HARNESS:-"$root/../shared/bench/peers"}
py=${PY_OURS:-"$root/.venv/bin/python"}
[ -d "$harness" ] || { echo "bench: harness not found at $harness" >&2; exit 1; }
[ -x "$py" ] || { echo "bench: no venv at $root/.venv (run the README's install first)" >&2; exit 1; }

filter=(baseline ours)
peers_py=$py
if [ "${1:-}" = "--peers" ]; then
    peers_venv="$here/.peers-venv"
    [ -x "$peers_venv/bin/python" ] || bash "$harness/setup_venv.sh" "$peers_venv"
    peers_py="$peers_venv/bin/python"
    filter=()
fi

export ERR="$here/results.stderr"
PY="$peers_py" PY_OURS="$py" OURS="$here/bench_ours.py" OUT="$here/results-memory.jsonl" \
    bash "$harness/run_all.sh" "${filter[@]}" > /dev/null
# the durable runner: a second pass of the harness with the SQLite script as "ours"
PY="$peers_py" PY_OURS="$py" OURS="$here/bench_ours_sqlite.py" OUT="$here/results-sqlite.jsonl" \
    PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" bash "$harness/run_all.sh" ours > /dev/null
cat "$here/results-memory.jsonl" "$here/results-sqlite.jsonl" > "$here/results.jsonl"
"$py" "$harness/report.py" "$here/results.jsonl" | tee "$here/results.md"
echo
"$py" "$here/report.py" "$here/results.jsonl" "$harness/RESULTS.md"
echo
"$py" "$here/bench_flatness.py"
echo
# how much of the durable W1 figure is SQLite alone (the store's statements replayed without Python)
"$py" "$here/bench_store_floor.py"
