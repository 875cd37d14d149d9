#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install the vLLM extra (CUDA vLLM), then run the
# vLLM-backend tests and the native-vs-vLLM speculative-decoding benchmark on the default
# model. Prints what it measured; meant to finish in under 10 minutes.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      (results under OUT_DIR, default gpu_check/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check}
mkdir -p "$OUT"
nvidia-smi -L
t0=$(date +%s)
bash scripts/install.sh --vllm
python3 -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'vllm', vllm.__version__)"
echo "install: $(( $(date +%s) - t0 )) s"
TLT_REQUIRE_VLLM=1 timeout 420 python3 -m pytest -q -x tests/test_vllm_backend.py \
  2>&1 | tail -20 | tee "$OUT/tests.txt"
timeout 240 python3 -m benchmarks.decode served --backends native,vllm --batches 1,16,64 \
  --repeats 1 --out "$OUT/decode_served_gpu.json" 2>&1 | tail -30 | tee "$OUT/decode_served.txt"
echo "total: $(( $(date +%s) - t0 )) s"
