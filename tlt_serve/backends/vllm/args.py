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

from tlt_serve.config import EngineConfig, SpecConfig

BLOCK_SIZE = 32
MAX_BATCH_ANY = 1 << 20  # "every batch size above max_batch" in vLLM's per-batch-size table


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


def _on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def engine_args(model_dir: Path, config: EngineConfig, spec: VllmSpec) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    k = spec.config["num_speculative_tokens"] if spec.config else 0
    mc = config.model
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
        "enable_chunked_prefill": _on_gpu(),
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": kv_cache_bytes(
            model_dir, config, config.cache.max_num_seqs * (k + 1) * 2,
            extra_layers=1 if spec.drafter_dir else 0),
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "per_request_spec_decode_metrics": "summary" if spec.config else "none",
        "speculative_config": spec.config,
        "worker_extension_cls": "tlt_serve.backends.vllm.worker.TltWorker",
        "disable_log_stats": False,
    }
    return AsyncEngineArgs(**kwargs)
