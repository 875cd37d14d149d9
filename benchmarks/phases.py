"""Where a native engine step spends its time, phase by phase, against the floor each phase
could reach on this host.

  run   decode steps (speculation off) of the default model at several batch sizes and one
        prefill: the step split into scheduling, batch building, the model (layers, head),
        sampling and postprocessing (stop rules, detokenization); the model's layers split
        again (projections, attention, norms, the rest) in a second pass with the
        whole-layer kernel off, which is how those parts can be told apart. Floors: the
        weights and the cached keys and values read once at the rate this host reads memory
        (a sum over 1 GiB), and the products' multiply-adds at its measured GEMM rate.

    python -m benchmarks.phases run
    python -m benchmarks.phases run --batches 1,16 --steps 10

Each timed call is wrapped in two clock reads (well under a microsecond each); the wrapped
pass is what the table shows, the unwrapped step time beside it.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common.results import ints, pyplot, report, save, tool


class Clock:
    """Seconds per named phase, from wrapped callables; nested phases are kept whole (the
    parent's own time is what is left once its children are taken out, in ``table``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return timed


def host_rates(threads: int) -> dict[str, float]:
    """This host's rates, best of five: a 1 GiB copy (bytes read + written per second); a 1 GiB
    sum (bytes read per second: what a decode step does with its weights and cached keys,
    where a copy counts two directions at once); GEMMs in fp32 and bf16 ([M, 4096] x
    [4096, 4096], M = 512, or 16 where a first small product shows torch has no fast bf16
    GEMM here)."""
    torch.set_num_threads(threads)
    src = torch.ones(1 << 28)  # 1 GiB fp32
    dst = torch.empty_like(src)
    best = min(_seconds(dst.copy_, src) for _ in range(5))
    rates = {"bandwidth_gbs": 2 * src.numel() * 4 / best / 1e9, "read_gbs": read_rate(src)}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(4096, 4096).to(dtype)
        small = torch.randn(16, 4096).to(dtype)
        # best of three: a first call (pages touched, threads woken) read under 20 GFLOP/s for an
        # fp32 GEMM that runs 26-35 warm on an AVX2 EPYC, and took the 16-row measure
        rate = 2 * 16 * 4096 * 4096 / min(_seconds(torch.matmul, small, w) for _ in range(3)) / 1e9
        m = 512 if rate > 20 else 16  # a slow path measured on little work
        x = torch.randn(m, 4096).to(dtype)
        t = min(_seconds(torch.matmul, x, w) for _ in range(5))
        rates[f"gemm_{str(dtype).split('.')[-1]}_gflops"] = 2 * m * 4096 * 4096 / t / 1e9
    return rates


# Untimed decode steps before each timed pass: the first steps after a prefill ran slower (the
# first batch-1 pass of a process read 9.8 / 12.3 ms a step over 60 steps where a second,
# right after, read 7.6 / 10.0 on an AVX512-BF16 EPYC).
WARMUP_STEPS = 3


def read_rate(src: torch.Tensor, times: int = 5) -> float:
    """GB/s read by the best of ``times`` sums over ``src``."""
    best = min(_seconds(torch.sum, src) for _ in range(times))
    return src.numel() * src.element_size() / best / 1e9


def _seconds(fn: Callable[..., Any], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _llm(a: argparse.Namespace, layer_kernel: bool) -> Any:
    from tlt_serve import LLM
    from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig
    from tlt_serve.models.llama import set_cpu_kernels

    llm = LLM(config=EngineConfig(
        model=ModelConfig(dtype="bfloat16",
                          max_model_len=a.context + a.steps + WARMUP_STEPS + 64),
        cache=CacheConfig(max_num_seqs=max(a.batches)), num_threads=a.threads))
    model = llm.engine.model
    if not layer_kernel and model.kernels is not None:
        set_cpu_kernels(model, replace(model.kernels, layer=None))
    return llm


def _fill(llm: Any, batch: int, a: argparse.Namespace, seed: int) -> float:
    """Admit ``batch`` requests and run their prefill; returns the prefill's seconds."""
    from tlt_serve import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=a.steps + WARMUP_STEPS + 8, temperature=0.0,
                            ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, engine.vocab_size, (a.context,), generator=gen).tolist()
        engine.add_request(f"p{seed}-{i}", prompt, params)
    t0 = time.perf_counter()
    while engine.scheduler.waiting:
        engine.step()
    return time.perf_counter() - t0


def _drain(llm: Any) -> None:
    engine = llm.engine
    for req in list(engine.scheduler.running):
        engine.scheduler.abort(req.rid, engine.weight_version)


def _phases(llm: Any, a: argparse.Namespace, split_layers: bool) -> dict[str, float]:
    """Milliseconds per decode step by phase over ``--steps`` steps (batch already running)."""
    import tlt_serve.engine.runner as runner_mod
    from tlt_serve.models.llama import MLP, Attention, Linear, RMSNorm

    engine, clock = llm.engine, Clock()
    for _ in range(WARMUP_STEPS):
        engine.step()
    model = engine.model
    patches = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "run", "run"),
               (runner_mod, "extend_batch", "batch building"),
               (model, "forward", "model"), (model, "logits", "head"),
               (engine.sampler, "sample", "sampling"),
               (engine.scheduler, "postprocess", "postprocess (stop rules, detokenize)"),
               (engine.stats, "on_step", "stats")]
    if split_layers:
        for m in model.modules():
            if isinstance(m, Attention):
                patches.append((m, "forward", "attention block"))
            elif isinstance(m, MLP):
                patches.append((m, "forward", "mlp block"))
            elif isinstance(m, RMSNorm):
                patches.append((m, "forward", "norms"))
        for name, m in model.named_modules():
            if isinstance(m, Linear) and name != "lm_head":
                patches.append((m, "forward", "projections"))
    # (object, attribute, what it held itself or None: a method its class gives it)
    originals = [(obj, attr, vars(obj).get(attr)) for obj, attr, _ in patches]
    for obj, attr, name in patches:
        setattr(obj, attr, clock.wrap(name, getattr(obj, attr)))
    try:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        for obj, attr, own in reversed(originals):
            if own is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)
    ms = {k: 1000 * v / a.steps for k, v in clock.seconds.items()}
    ms["step"] = 1000 * total / a.steps
    return ms


def _table(ms: dict[str, float], split: dict[str, float] | None) -> dict[str, float]:
    """Exclusive phases: each parent less what its children took."""
    out = {
        "schedule": ms.get("schedule", 0.0),
        "batch building": ms.get("batch building", 0.0),
        "layers": ms.get("model", 0.0),
        "head": ms.get("head", 0.0),
        "runner, rest": ms.get("run", 0.0) - ms.get("model", 0.0) - ms.get("head", 0.0)
        - ms.get("batch building", 0.0),
        "sampling": ms.get("sampling", 0.0),
        "postprocess (stop rules, detokenize)": ms.get(
            "postprocess (stop rules, detokenize)", 0.0),
        "stats": ms.get("stats", 0.0),
    }
    accounted = sum(out.values())
    out["step, rest (Python, features)"] = ms["step"] - accounted
    if split is not None:  # the layers' parts, from the pass without the whole-layer kernel
        proj = split.get("projections", 0.0)
        attn = split.get("attention block", 0.0)
        mlp = split.get("mlp block", 0.0)
        norms = split.get("norms", 0.0)
        # the attention and MLP blocks less the projections inside them
        layers_split = {
            "layers: projections": proj,
            "layers: attention core, rope, MLP activation": attn + mlp - proj,
            "layers: norms": norms,
            "layers: rest (residuals, embedding)": split.get("model", 0.0) - attn - mlp - norms,
        }
        out.update({f"{k} (layer kernel off)": round(v, 4) for k, v in layers_split.items()})
    return {k: round(v, 4) for k, v in out.items()}


def run(a: argparse.Namespace) -> Path:
    rates = host_rates(a.threads)
    probe = torch.ones(1 << 28)  # 1 GiB fp32, summed around each row's steps
    print(f"host: {rates['read_gbs']:.1f} GB/s read, {rates['bandwidth_gbs']:.1f} GB/s copy "
          f"(read + written), fp32 GEMM "
          f"{rates['gemm_float32_gflops']:.0f} GFLOP/s, bf16 GEMM "
          f"{rates['gemm_bfloat16_gflops']:.0f} GFLOP/s")
    gemm = max(rates["gemm_float32_gflops"], rates["gemm_bfloat16_gflops"]) * 1e9
    fused, unfused = _llm(a, layer_kernel=True), _llm(a, layer_kernel=False)
    model = fused.engine.model
    cfg = model.cfg
    linear_params = sum(m.weight.numel() for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear))  # the head included
    weight_bytes = 2 * linear_params  # bf16, each read once a step
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    rows: list[dict[str, Any]] = []
    for i, b in enumerate(tqdm(a.batches, desc="phases")):
        prefill_s = _fill(fused, b, a, seed=i)
        # this host's read rate moved from 50 to 32 GB/s within minutes: each row's floor
        # takes the faster of the rates read right before and right after its steps
        before = read_rate(probe)
        ms = _phases(fused, a, split_layers=False)
        read = max(before, read_rate(probe))
        _drain(fused)
        _fill(unfused, b, a, seed=i)
        split = _phases(unfused, a, split_layers=True)
        _drain(unfused)
        context = a.context + WARMUP_STEPS + a.steps // 2
        floor = {
            "weights_ms": 1000 * weight_bytes / (read * 1e9),
            "kv_ms": 1000 * b * context * kv_per_token / (read * 1e9),
            "multiply_adds_ms": 1000 * 2 * linear_params * b / gemm,
        }
        floor["step_ms"] = max(floor["weights_ms"] + floor["kv_ms"], floor["multiply_adds_ms"])
        floor["read_gbs"] = read
        row = {"batch": b, "step_ms": round(ms["step"], 4),
               "step_ms_layer_kernel_off": round(split["step"], 4),
               "prefill_s": round(prefill_s, 4), "prefill_tokens": b * a.context,
               "phases_ms": _table(ms, split), "floor": {k: round(v, 4) for k, v in floor.items()}}
        rows.append(row)
        _print(row)
    return report(a, {"model": "smollm2-135m", "dtype": "bfloat16", "threads": a.threads,
                      "host_rates": {k: round(v, 2) for k, v in rates.items()},
                      "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
                      "rows": rows}, plot)


def _print(row: dict[str, Any]) -> None:
    f = row["floor"]
    print(f"\nbatch {row['batch']}: step {row['step_ms']:.2f} ms (whole-layer kernel off: "
          f"{row['step_ms_layer_kernel_off']:.2f}; floor {f['step_ms']:.2f} at "
          f"{f['read_gbs']:.1f} GB/s read: "
          f"weights {f['weights_ms']:.2f} + KV {f['kv_ms']:.2f}, multiply-adds "
          f"{f['multiply_adds_ms']:.2f}); prefill of {row['prefill_tokens']} tokens "
          f"{row['prefill_s']:.2f} s")
    for name, v in row["phases_ms"].items():
        whole = row["step_ms_layer_kernel_off" if "layer kernel off" in name else "step_ms"]
        print(f"  {name:<68} {v:8.3f} ms  {100 * v / whole:5.1f}%")


def plot(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = result["rows"]
    names = [k for k in rows[0]["phases_ms"] if "layer kernel off" not in k]
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for name in names:
        values = [max(0.0, r["phases_ms"][name]) / r["step_ms"] for r in rows]
        ax.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    floors = [r["floor"]["step_ms"] / r["step_ms"] for r in rows]
    ax.plot(list(x), floors, "k_", markersize=30, markeredgewidth=2, label="floor")
    ax.set_xticks(list(x), [f"batch {r['batch']}\n{r['step_ms']:.1f} ms" for r in rows])
    ax.set_ylabel("share of a decode step")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    ax.set_title(f"where a decode step goes: {result['model']} bf16, {result['threads']} "
                 "threads", fontsize=10)
    fig.suptitle(f"{result['machine']} ({result['date']}, {result['commit']})", fontsize=8)
    save(fig, png)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=ints, default=[1, 16, 64, 128])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    p.add_argument("--threads", type=int, default=2)


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "phases", {"run": (_arguments, run)}, argv)


if __name__ == "__main__":
    main()
