#!/usr/bin/env bash
# Install agentloop with its test dependencies and the small embedded model, then run the suite
# (ruff and mypy run inside it, as tests). The first install compiles llama.cpp (about 9 minutes
# on 2 cores; pip caches the wheel, so later installs take seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} .venv/bin/python -m pip install -e '.[dev,local-small]'
exec .venv/bin/python -m pytest "$@"
