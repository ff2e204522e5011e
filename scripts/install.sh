#!/usr/bin/env bash
# Create .venv (when missing) and install agentloop in it with the given extras:
#   bash scripts/install.sh local,server
#
# The embedded model's llama.cpp bindings compile from source (about 9 minutes on 2 cores, once).
# On x86-64 they are built for a portable baseline (AVX2, FMA, F16C) instead of for this CPU
# (-march=native): on virtual machines whose CPU reports AMX (Intel Sapphire Rapids and later) but
# whose hypervisor does not let a process use it, a native build dies with SIGSEGV in ggml's AMX
# matrix multiply at the first prompt. pip's own wheel cache does not know the build flags (a native
# wheel built earlier would come back), so the wheel is kept in a cache of its own, named by them.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-local,server}
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip)
"${pip[@]}" install -q --upgrade pip

if [[ ",$extras," =~ ,local(-small)?, ]]; then
    pin=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | head -1 | tr -d '"')
    flags=""
    if [ "$(uname -m)" = x86_64 ]; then
        flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    fi
    if [ -n "${CMAKE_ARGS:-}" ]; then
        flags="$flags $CMAKE_ARGS"  # the caller's own flags (a GPU backend, say) come last and win
    fi
    key=$(echo "$pin $flags" | sha256sum | cut -c1-16)
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/agentloop/wheels/$key"
    marker=.venv/.agentloop-llama-build  # which build the venv holds: a native one from an older install is replaced
    if [ "$(cat "$marker" 2>/dev/null)" != "$key" ]; then
        if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
            echo "building $pin (llama.cpp compiles from source: about 9 minutes on 2 cores, once)" >&2
            CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
                "${pip[@]}" wheel -q --no-deps --no-cache-dir -w "$wheels" "$pin"
        fi
        "${pip[@]}" install -q --no-deps --force-reinstall "$wheels"/llama_cpp_python-*.whl
        echo "$key" > "$marker"
    fi
fi
"${pip[@]}" install -q -e ".[$extras]"
