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

export OUT="$here/results.jsonl" ERR="$here/results.stderr"
PY="$peers_py" PY_OURS="$py" OURS="$here/bench_ours.py" \
    bash "$harness/run_all.sh" "${filter[@]}" > "$here/results.md"
cat "$here/results.md"
echo
"$py" "$here/report.py" "$OUT" "$harness/RESULTS.md"
echo
"$py" "$here/bench_flatness.py"
