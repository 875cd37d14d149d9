#!/usr/bin/env bash
# The GPU check: what tlt-serve claims on a GPU, measured on one, in under 8 minutes.
#
#   bash scripts/gpu_check.sh                  on a machine with a CUDA GPU
#   bash scripts/gpu_check.sh --device cpu     its dry run on a CPU (small shapes)
#   bash scripts/gpu_check.sh --out DIR        results under DIR (default: $OUT, else
#                                              gpu_check_out/)
#   bash scripts/gpu_check.sh --vllm           also install vLLM 0.32.0 (needs the network)
#                                              and run the vLLM backend's tests on the GPU
#
# It needs no network and nothing installed beyond python3 with torch (CUDA build), pytest,
# transformers, tokenizers, safetensors, tqdm and matplotlib: it runs from the checkout
# (PYTHONPATH), not an installed package. Wheels put in .whl/ are installed first
# (pip --no-index into /tmp/tlt-site), for an image that lacks one of those.
#
# It runs, printing everything and writing its results to the output folder:
#   1. versions and the device;
#   2. the native engine's CUDA tests (tests/test_cuda.py: fp32 greedy and seeded output
#      with speculation on equals plain decoding, alone and batched, on tiny random models;
#      CUDA graphs against eager steps; sampler and verifier on CUDA logits), the vLLM
#      capture's pinned copies (tests/test_step_copy.py) and the GPU probe
#      (tests/test_devices.py);
#   3. the step cost profile (python -m benchmarks.profile steps): random-weight models at
#      the shapes of Qwen3-1.7B, Llama-3.1-8B and Qwen2.5-0.5B in bf16, plain and verify
#      steps by batch size, eager and from CUDA graphs (the layers as written and compiled,
#      with torch's attention and the own Triton kernel), the kernels of a plain step, the drafter's forward and a training micro-step ->
#      profile_steps.json / .png;
#   4. the trainer beside the engine (python -m benchmarks.profile beside): the engine's
#      step time while the drafter trains on the same GPU vs idle, and the trainer's yield
#      -> profile_beside.json / .png;
#   5. the whole native engine's decode step by batch size, from CUDA graphs (layers compiled)
#      against graphs of the layers as written, with the Triton attention, and eager, and
#      capturing drafter samples with features kept on the GPU against copied to the
#      host each step (python -m benchmarks.engine_steps run) -> engine_steps.json / .png;
#   6. with --vllm: scripts/install.sh --vllm, then tests/test_vllm_compat.py and
#      tests/test_vllm_backend.py (the real default model, downloaded by pip).
# Exit status: 0 when every part passed, else the number of parts that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
VLLM=0
DEST=${OUT:-gpu_check_out}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --out) DEST=$2; shift 2 ;;
    --vllm) VLLM=1; shift ;;
    *) echo "gpu_check.sh: unknown option $1 (known: --device cpu|cuda, --out DIR, --vllm)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$DEST"
exec > >(tee "$DEST/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tlt-site .whl/*.whl && export PYTHONPATH=/tmp/tlt-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TLT_SERVE_NO_KERNELS=1  # the CPU kernels are the CPU path's; nothing here builds them
FAILED=()
START=$(date +%s)

part() {  # part NAME SECONDS COMMAND...: run, time, keep going on failure
  local name=$1 limit=$2; shift 2
  echo; echo "== $name ($(($(date +%s) - START)) s in)"
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "-- $name: rc $rc in $(($(date +%s) - t0)) s"
  [ $rc -eq 0 ] || FAILED+=("$name (rc $rc)")
}

echo "== versions"
"$PY" - <<'EOF'
import platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm_{p.major}{p.minor}",
          p.multi_processor_count, "SMs")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv
git log -1 --format='commit %h %cd' 2>/dev/null || true
part nvml 30 "$PY" -c "from tlt_serve.devices import gpus; print('GPUs found by NVML:', gpus())"

if [ "$DEVICE" = cuda ]; then
  part tests 200 env TLT_REQUIRE_CUDA=1 "$PY" -m pytest -q --noconftest -p no:cacheprovider \
    tests/test_cuda.py tests/test_step_copy.py tests/test_devices.py
  part profile 270 "$PY" -m benchmarks.profile steps --device cuda --shapes 1.7b,8b,0.5b \
    --compiled 1.7b,8b --k 1,4,8 --iters 5 --repeats 3 --bandwidth-gbs 4300 --budget-s 200 \
    --out "$DEST/profile_steps.json"
  part beside 70 "$PY" -m benchmarks.profile beside --device cuda --shape 1.7b --batch 16 \
    --out "$DEST/profile_beside.json"
  part engine 200 "$PY" -m benchmarks.engine_steps run --device cuda --shape 1.7b \
    --arms graphs,uncompiled,triton,eager,capture,capture-host --batches 1,16,64 --rounds 2 \
    --out "$DEST/engine_steps.json"
else
  part tests 600 env TLT_TEST_DEVICE=cpu "$PY" -m pytest -q --noconftest -p no:cacheprovider \
    tests/test_cuda.py tests/test_step_copy.py tests/test_devices.py
  part profile 600 "$PY" -m benchmarks.profile steps --device cpu --shapes tiny --batches 1,4 \
    --k 1,4 --context 128 --iters 2 --repeats 1 --train-rows 1 --train-row-len 64 \
    --draft-vocab 1024 --out "$DEST/profile_steps.json"
  part beside 300 "$PY" -m benchmarks.profile beside --device cpu --shape tiny --batch 4 \
    --context 128 --rounds 2 --iters 5 --train-rows 1 --train-row-len 64 --draft-vocab 1024 \
    --out "$DEST/profile_beside.json"
  part engine 300 "$PY" -m benchmarks.engine_steps run --device cpu --shape tiny --batches 1,4 \
    --context 64 --tokens 8 --rounds 1 --arms graphs,eager,capture,capture-host \
    --out "$DEST/engine_steps.json"
fi

if [ "$VLLM" = 1 ]; then
  part vllm-install 900 bash scripts/install.sh --vllm
  part vllm-tests 1800 env TLT_REQUIRE_VLLM=1 "$PY" -m pytest -q tests/test_vllm_compat.py \
    tests/test_vllm_backend.py
fi

echo
echo "== gpu_check ($DEVICE) done in $(($(date +%s) - START)) s; results in $DEST:"
ls -l "$DEST"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit ${#FAILED[@]}
fi
echo "every part passed"
