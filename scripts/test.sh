#!/usr/bin/env bash
# Install agentloop with its test dependencies and the small embedded model, then run the suite
# (ruff and mypy run inside it, as tests). The first install compiles llama.cpp (about 9 minutes
# on 2 cores; scripts/install.sh keeps the wheel, so later installs take seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev,local-small
# One pytest worker per core, at most 4 (each starts its own PostgreSQL and Chromium when its tests
# need them); a test file's tests stay together on one worker, sharing its module fixtures.
workers=$(nproc 2>/dev/null || echo 1)
if [ "$workers" -gt 4 ]; then workers=4; fi
if [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadfile "$@"; fi
exec .venv/bin/python -m pytest "$@"
