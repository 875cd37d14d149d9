"""Build vLLM's ``AsyncLLM`` from an ``EngineConfig``, with the native engine's capacity and
speculation settings.

- Capacity: ``max_num_seqs`` sequences of ``max_model_len`` tokens, as the native KV cache
  holds; the KV budget is computed from the model's shape (vLLM's CPU worker otherwise
  wants 92% of the machine's memory free). Blocks of 32 tokens, so the n samples of a prompt
  share its prefix blocks.
- Eager mode: no graph capture or compile at start, and target / drafter weights can be
  reloaded in place (``worker.py``).
- Speculation: ``ngram`` → vLLM's n-gram method; ``suffix`` → vLLM's suffix decoding
  (arctic-inference); ``drafter`` (and ``auto`` with a drafter) → vLLM's EAGLE with our
  checkpoint, exported on load into a temporary directory. Tail-only speculation: vLLM v1 has
  no switch that turns speculation off above a batch size, but its
  ``num_speculative_tokens_per_batch_size`` drafts K tokens up to ``max_batch`` sequences and
  0 above (its EAGLE drafter still runs one forward per step there). Its suffix proposer
  refuses such a schedule, so suffix speculates at every batch size.
- On a GPU (found by NVML, without initialising CUDA: ``tlt_serve/devices.py``) vLLM's
  processes start by spawn, chunked prefill is on, and ``gpu_memory_utilization`` is what the
  engine needs (weights, KV, drafter, working memory) rather than vLLM's 0.9, which vLLM
  requires free at start: a co-located trainer or a second replica keeps the rest.
- On a CPU the OpenMP threads of vLLM's worker are bound to every core this process may use
  (vLLM otherwise keeps one core for its scheduler: half the speed on 2 cores).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tlt_serve.config import ConfigError, EngineConfig, SpecConfig
from tlt_serve.devices import Gpu

BLOCK_SIZE = 32
MAX_BATCH_ANY = 1 << 20  # "every batch size above max_batch" in vLLM's per-batch-size table
# GPU memory vLLM takes beyond weights and KV: CUDA context, activations of a
# max_num_batched_tokens forward, sampler workspace (eager mode: no graph pool)
GPU_WORKING_BYTES = 2 << 30
GPU_WORKING_SHARE = 0.1  # ... and this share of weights + KV on top


@dataclass(frozen=True)
class VllmSpec:
    """What speculation resolved to on vLLM."""

    proposer: str  # none | ngram | suffix | drafter
    config: dict[str, Any] | None  # vLLM's speculative_config
    drafter_dir: str | None = None  # the exported EAGLE checkpoint vLLM loads


def set_cpu_env() -> None:
    """vLLM's CPU settings for this process and its children, unless the user set them."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}-{cores[-1]}")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def kv_cache_bytes(
    model_dir: Path, config: EngineConfig, extra_tokens: int, extra_layers: int = 0
) -> int:
    """Bytes of KV for ``max_num_seqs`` sequences of ``max_model_len`` tokens (+ extra
    tokens: drafts in flight; + extra layers: a drafter's)."""
    hf = json.loads((model_dir / "config.json").read_text())
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    element = 4 if config.model.dtype == "float32" else 2
    per_token = 2 * (hf["num_hidden_layers"] + extra_layers) * kv_heads * head_dim * element
    tokens = config.cache.max_num_seqs * (config.model.max_model_len + BLOCK_SIZE) + extra_tokens
    return per_token * tokens


def resolve_spec(spec: SpecConfig, export_root: Path) -> VllmSpec:
    """Our speculation settings as vLLM's ``speculative_config``; exports the drafter."""
    method = spec.method
    if method == "auto":
        method = "drafter" if spec.drafter else "ngram"
    if method == "off":
        return VllmSpec("none", None)
    k = spec.num_draft_tokens
    config: dict[str, Any] = {
        "num_speculative_tokens": k,
        # K drafts while at most max_batch sequences run, none above (the long tail only)
        "num_speculative_tokens_per_batch_size": [
            (1, spec.max_batch, k), (spec.max_batch + 1, MAX_BATCH_ANY, 0),
        ],
    }
    if method == "ngram":
        config.update(method="ngram", prompt_lookup_min=spec.ngram_min_n,
                      prompt_lookup_max=spec.ngram_max_n)
        return VllmSpec("ngram", config)
    if method == "suffix":  # vLLM's suffix decoding: arctic-inference's SuffixDecodingCache
        # Its proposer requires one draft length at every batch size (it asserts so): it
        # speculates at every batch size, its drafts as long as its estimates allow.
        del config["num_speculative_tokens_per_batch_size"]
        config.update(method="suffix", suffix_decoding_min_token_prob=spec.suffix_min_prob,
                      suffix_decoding_max_tree_depth=max(24, k + 16))
        return VllmSpec("suffix", config)
    assert spec.drafter is not None  # SpecConfig.validate
    out = export_drafter(spec.drafter, export_root)
    config.update(method="eagle", model=str(out))
    return VllmSpec("drafter", config, str(out))


def export_drafter(src: str, export_root: Path) -> Path:
    """Our drafter checkpoint in the form vLLM's EAGLE loads (``tlt-train export-vllm``)."""
    from tlt_serve.speculative.export import export_vllm_eagle

    out = Path(tempfile.mkdtemp(prefix="drafter-", dir=export_root))
    export_vllm_eagle(src, out, keep_extras=True)
    return out


def set_gpu_env() -> None:
    """vLLM's engine core and workers start by spawn on a GPU (a fork after anything in this
    process touched CUDA would leave them without it)."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of the model's weights served in ``dtype`` (from its safetensors headers)."""
    from tlt_serve.backends.vllm.weights import header, safetensors_files

    element = 4 if dtype == "float32" else 2
    total = 0
    for f in safetensors_files(model_dir):
        for _, shape in header(f).values():
            n = 1
            for d in shape:
                n *= d
            total += n * element
    return total


def gpu_memory_utilization(
    config: EngineConfig, gpu: Gpu, weights: int, kv: int
) -> float:
    """The share of ``gpu`` vLLM takes: the flag's, or what it needs (weights, KV, working
    memory), never more than what ``gpu_reserve_bytes`` (the co-located trainer's) leaves."""
    cache = config.cache
    room = (gpu.total_bytes - cache.gpu_reserve_bytes) / gpu.total_bytes
    if cache.gpu_memory_utilization is not None:
        share = cache.gpu_memory_utilization
    else:
        need = (weights + kv) * (1 + GPU_WORKING_SHARE) + GPU_WORKING_BYTES
        share = round(need / gpu.total_bytes + 0.005, 2)
    if share > room + 1e-9:
        raise ConfigError(
            f"gpu_memory_utilization: the engine needs {share:.2f} of {gpu.name}'s "
            f"{gpu.total_bytes / 2**30:.0f} GiB; the trainer's reserve "
            f"({cache.gpu_reserve_bytes / 2**30:.1f} GiB) leaves {room:.2f}")
    return share


def engine_args(model_dir: Path, config: EngineConfig, spec: VllmSpec, gpu: Gpu | None) -> Any:
    """vLLM's engine arguments; ``gpu``: the device vLLM runs on (None: its CPU build)."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    k = spec.config["num_speculative_tokens"] if spec.config else 0
    mc = config.model
    kv = kv_cache_bytes(model_dir, config, config.cache.max_num_seqs * (k + 1) * 2,
                        extra_layers=1 if spec.drafter_dir else 0)
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": mc.dtype,
        "max_model_len": mc.max_model_len,
        "max_num_seqs": config.cache.max_num_seqs,
        "max_num_batched_tokens": max(config.scheduler.max_prefill_tokens, mc.max_model_len),
        "seed": config.seed,
        # Whole prompts per step on a CPU: vLLM-CPU 0.32 rewinds a seeded request's generator
        # after a partial prefill with an offset CPU generators do not have, and the engine
        # dies ("CPU Generator does not use offset") once a seeded prompt is chunked.
        "enable_chunked_prefill": gpu is not None,
        # Compiled unless --enforce-eager: CUDA graphs on a GPU (capture reads what vLLM hands
        # its drafter, outside them); on a CPU the model traced once by dynamo and compiled
        # by inductor (x1.05-1.24 the eager throughput over benchmarks/engines.py's shapes, a
        # minute more to start; fp32 greedy outputs equal eager ones; weights and drafters
        # reloaded in place reach the compiled code: the parameters are its inputs)
        "enforce_eager": mc.enforce_eager,
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": kv,
        "enable_prefix_caching": config.cache.prefix_cache,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": mc.max_logprobs,
        "per_request_spec_decode_metrics": "summary" if spec.config else "none",
        "speculative_config": spec.config,
        "worker_extension_cls": "tlt_serve.backends.vllm.worker.TltWorker",
        "disable_log_stats": False,
        # JSON under a schema without free whitespace, as the native engine writes it (else a
        # greedy answer can fill its token budget with newlines)
        "structured_outputs_config": StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=True
        ),
    }
    if gpu is not None:
        weights = weight_bytes(model_dir, mc.dtype)
        if spec.drafter_dir:
            weights += weight_bytes(Path(spec.drafter_dir), mc.dtype)
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization(config, gpu, weights, kv)
    return AsyncEngineArgs(**kwargs)
