#!/usr/bin/env bash
# Install tlt-serve and its dev extras into the current Python environment.
# On a machine without an NVIDIA GPU, take the CPU build of torch first: an open `torch`
# requirement would otherwise pull a multi-GB CUDA build. Where torch is already installed
# (e.g. a CUDA build on a GPU machine) it is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet torch
  else
    "$PY" -m pip install --quiet torch==2.13.0
  fi
fi
"$PY" -m pip install --quiet -e ".[dev]"
