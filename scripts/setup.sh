#!/usr/bin/env bash
# Create .venv (once) and install minivllm with its test and notebook extras.
# On a machine without CUDA the CPU build of torch goes in first, so that pip does not pull the
# multi-GB CUDA build; on a GPU machine the default (CUDA) build is used.
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
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "$VPY" -m pip install -q "torch>=2.11"
    else
      # CPU-only: our CPU machines hold the CPU wheel of this version locally
      "$VPY" -m pip install -q "torch==2.13.0"
    fi
  fi
  "$VPY" -m pip install -q -e ".[dev]"
  touch .venv/.minivllm-installed
fi
