#!/usr/bin/env bash
# Install agentloop with its test dependencies and the small embedded model, then run the suite
# (ruff and mypy run inside it, as tests). The first install compiles llama.cpp (about 9 minutes
# on 2 cores; scripts/install.sh keeps the wheel, so later installs take seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev,local-small
exec .venv/bin/python -m pytest "$@"
