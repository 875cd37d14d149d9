"""The own CPU kernels: what each buys a decoding engine, and the bf16 products by row count.

  ab    one bf16 engine on the default model; between rounds its modules switch one kernel
        to torch's (or all of them to another revision's build: ``rev:REV``); decode
        tokens/s per batch size against all own kernels
  prefill  the same engine's prefill of a few shapes under the same configurations
  rows  the projections of one step by row count (1 row per sequence in a decode step,
        1 + drafts in a verify step): the own kernel against torch

Interleaved rounds, medians.

    python -m benchmarks.kernels ab
    python -m benchmarks.kernels ab --configs rev:HEAD~1 --batches 1,2,3,4,8
    python -m benchmarks.kernels prefill --configs widened
    python -m benchmarks.kernels rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common.prompts import chat_prompts
from benchmarks.common.results import grouped_bars, ints, pyplot, report, save, tool

OFF = ("all", "layer", "matvec", "norm", "attention")  # "x": everything but x
INVARIANT = "invariant"  # every row through the own kernels (``kernels.batch_invariant``)
TOKENS = "tokens"  # prefills attend token by token, as decode rows (no blocks of 16)
LABELS = {"all": "every own kernel", "layer": "the own kernels op by op, no whole-layer kernel",
          **{c: f"torch's {c} instead" for c in OFF[2:]},
          "avx2": "the own product's AVX2 path (rows <= 8)",
          "widened": "the own attention with keys widened to fp32, decode rows only (op by op)",
          "invariant": "batch invariant: the own kernels take every row (--batch-invariant)",
          "tokens": "prefills attend token by token (no blocks of 16 tokens)"}
SHORT = {"all": "all own kernels", "layer": "own kernels op by op",
         "avx2": "own product, AVX2 path", "widened": "own attention, keys widened, SDPA prefills",
         "invariant": "batch invariant", "tokens": "prefill attention token by token"}
ONLY_AVX512_BF16 = ("avx2", "widened")  # configurations that differ from "all" only there
REV = "rev:"  # "rev:REV": every own kernel as built from revision REV's sources
REPO = Path(__file__).resolve().parents[1]


# a limit configuration's prefix → the ``CpuKernels`` fields it sets, and its words
LIMITS = {"rows": (("matvec_rows", "large_rows"), "own product up to {} rows"),
          "large": (("large_rows",), "large products up to {} rows"),
          "layer": (("layer_rows",), "layer kernel up to {} rows")}


def _limit_parts(config: str) -> list[tuple[str, int]] | None:
    """(prefix, N) of each part of a limit configuration: ``rowsN`` (the own product up to N
    rows, torch's above), ``largeN`` (the same for a layer's products of ``LARGE_PRODUCT``
    weights or more), ``layerN`` (the whole-layer kernel up to N rows, its products above
    their limits torch's), or several joined by "+" (``rows8+layer64``); None: not one."""
    parts = []
    for part in config.split("+"):
        prefix = part.rstrip("0123456789")
        if prefix not in LIMITS or prefix == part:
            return None
        parts.append((prefix, int(part[len(prefix):])))
    return parts


def row_limits(config: str) -> dict[str, int] | None:
    """The ``CpuKernels`` row limits a configuration sets, or None (not a limit one)."""
    parts = _limit_parts(config)
    if parts is None:
        return None
    return {field: n for prefix, n in parts for field in LIMITS[prefix][0]}


@cache  # one build and import per revision and process
def revision_build(rev: str) -> Any:
    """The own kernels compiled from revision ``rev``'s sources (``git show``); the build
    lands in torch's extension folder, the sources are removed after it."""
    from tlt_serve.kernels import SOURCES, build_of

    with tempfile.TemporaryDirectory(prefix="tlt-kernels-") as tmp:
        here = Path(tmp)
        for f in SOURCES:
            text = subprocess.run(["git", "show", f"{rev}:tlt_serve/kernels/{f}"], cwd=REPO,
                                  capture_output=True, check=False)
            if text.returncode:
                raise SystemExit(f"--configs {REV}{rev}: {text.stderr.decode().strip()}")
            (here / f).write_bytes(text.stdout)
        return build_of(here)


def label(config: str) -> str:
    if config.startswith(REV):
        return f"every own kernel as at {config[len(REV):]}"
    parts = _limit_parts(config)
    if parts is None:
        return LABELS[config]
    return ", ".join(LIMITS[prefix][1].format(n) for prefix, n in parts)


def switch(model: Any, kernels: Any, off: str) -> None:
    """Own kernels everywhere except ``off`` ("all": none off; "avx2": the AVX2 product;
    "rowsN", "largeN", "layerN" and their joins: all, with those row limits)."""
    from tlt_serve.kernels import (
        ATTENTION_QUERIES,
        EVERY_ROW,
        MATVEC_ROWS_NATIVE_BF16,
        attention_widened,
        batch_invariant,
        kernels_of,
        matvec_avx2,
    )
    from tlt_serve.models.llama import set_cpu_kernels

    limits = row_limits(off)
    # op by op: the whole-layer kernel multiplies and attends with its own paths
    if off == "avx2":
        kernels = replace(kernels, matvec=matvec_avx2(), matvec_rows=MATVEC_ROWS_NATIVE_BF16,
                          large_rows=MATVEC_ROWS_NATIVE_BF16, layer=None)
    elif off == "widened":  # prefills back to SDPA
        kernels = replace(kernels, attention=attention_widened(),
                          attention_queries=ATTENTION_QUERIES, layer=None)
    elif off == INVARIANT:
        kernels = batch_invariant(kernels)
    elif off == TOKENS:
        kernels = replace(kernels, block_queries=EVERY_ROW)
    elif limits is not None:
        kernels = replace(kernels, **limits)
    elif off.startswith(REV):
        kernels = kernels_of(revision_build(off[len(REV):]), kernels)
    keep = (off in ("all", INVARIANT, TOKENS, *ONLY_AVX512_BF16) or limits is not None
            or off.startswith(REV))
    set_cpu_kernels(model, kernels if keep else replace(kernels, **{off: None}))


def ab(a: argparse.Namespace) -> Path:
    """What each own CPU kernel buys a decoding engine: all on vs each switched off in turn.
    One bf16 engine; between rounds its modules are switched to torch's kernel for one of:
    the bf16 products (``matvec``), the RMSNorms (``norm``), the decode attention
    (``attention``), or none (``all``); ``layer``: the same kernels op by op instead of the
    whole-layer kernel (which needs all three, so switching any of them off also runs the
    layers op by op); ``invariant``: every row of every step through the own kernels
    (``--batch-invariant``); on CPUs with AVX512-BF16 also ``avx2``: the own product on its
    AVX2 path with the row limit it had there, and ``widened``: the own attention scoring
    with keys widened to fp32, for decode rows only (prefills to SDPA); with AMX tiles also
    ``tokens``: prefills attending token by token, as decode rows. ``--configs`` picks some
    (``all`` always runs: the reference). Greedy, ``--new-tokens`` per sequence, EOS
    ignored, fresh prompts every round, configurations interleaved, median tokens/s per
    batch size; every configuration's tokens are compared with ``all``'s (bf16 rounding
    differs between kernels, so a few may differ)."""
    from tlt_serve import SamplingParams

    llm, model, kernels, configs = _engine(a, max(a.batches), 1024)
    tok = llm.tokenizer
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(chat_prompts(tok, 0, 1), SamplingParams(max_new_tokens=8))
    results: dict[str, dict[str, dict[str, float]]] = {c: {} for c in configs}
    bar = tqdm(total=len(a.batches) * a.rounds * len(configs), desc="kernels ab")
    first = 1
    for bs in a.batches:
        tps: dict[str, list[float]] = {c: [] for c in configs}
        same: dict[str, list[float]] = {c: [] for c in configs}
        for _ in range(a.rounds):
            prompts = chat_prompts(tok, first, bs)
            first += bs
            ref: list[tuple[int, ...]] = []
            for c in configs:
                switch(model, kernels, c)
                bar.set_postfix(bs=bs, off=c)
                t0 = time.perf_counter()
                toks = [tuple(r.samples[0].token_ids) for r in llm.generate(prompts, params)]
                tps[c].append(sum(map(len, toks)) / (time.perf_counter() - t0))
                ref = ref or toks
                same[c].append(sum(x == y for x, y in zip(toks, ref, strict=True)) / bs)
                bar.update()
        base = statistics.median(tps["all"])
        for c in configs:
            med = statistics.median(tps[c])
            results[c][str(bs)] = {"tokens_per_s": round(med, 2), "vs_all": round(med / base, 3),
                                   "same_tokens_as_all": round(statistics.mean(same[c]), 3)}
    bar.close()
    switch(model, kernels, "all")
    for c in configs:
        print(c.ljust(10), "  ".join(f"bs{b} {v['tokens_per_s']:6.1f} tok/s (x{v['vs_all']:.2f})"
                                     for b, v in results[c].items()))
    return report(a, {"configs": {c: label(c) for c in configs}, "results": results},
                  plot_ab)


def _engine(
    a: argparse.Namespace, seqs: int, max_len: int
) -> tuple[Any, Any, Any, tuple[str, ...]]:
    """One bf16 engine on ``a.model`` for ``seqs`` sequences of ``max_len`` tokens, no prefix
    cache: (LLM, its model, the model's full set of own kernels, the configurations to
    compare: ``a.configs`` or every one this CPU has, "all" first)."""
    from tlt_serve import LLM
    from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig
    from tlt_serve.kernels import own_avx512_bf16

    torch.set_num_threads(a.threads)
    # no prefix cache: ab runs each round's prompts under every configuration, and the later
    # ones would reuse the first one's KV and skip their prefills
    llm = LLM(config=EngineConfig(
        model=ModelConfig(model=a.model, dtype="bfloat16", max_model_len=max_len),
        cache=CacheConfig(max_num_seqs=seqs, prefix_cache=False)))
    model, kernels = llm.engine.model, llm.engine.model.kernels  # the full set
    if kernels is None:
        raise SystemExit("the own kernels are not available here (no AVX2 or no compiler)")
    configs = (*OFF, INVARIANT, *(ONLY_AVX512_BF16 + (TOKENS,) if own_avx512_bf16() else ()))
    if a.configs:
        unknown = {c for c in a.configs
                   if c not in configs and row_limits(c) is None and not c.startswith(REV)}
        if unknown:
            raise SystemExit(f"--configs: {sorted(unknown)} not among {list(configs)} here")
        configs = ("all", *(c for c in a.configs if c != "all"))
    return llm, model, kernels, configs


def prefill(a: argparse.Namespace) -> Path:
    """What the kernels buy a prefill: one bf16 engine prefilling ``--shapes`` (sequences x
    tokens of random ids, one new token each) under each configuration of ``ab``, rounds
    interleaved, median seconds and tokens/s per shape."""
    from tlt_serve import SamplingParams

    llm, model, kernels, configs = _engine(a, max(b for b, _ in a.shapes),
                                           max(n for _, n in a.shapes) + 8)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(batch: int, tokens: int) -> float:
        for _ in range(batch):
            ids = torch.randint(0, engine.vocab_size, (tokens,), generator=gen).tolist()
            engine.add_request(f"p{next(count)}", ids, params)
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t0

    count = iter(range(1 << 62))
    timed(2, 64)  # warm
    seconds: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
    bar = tqdm(total=a.rounds * len(configs) * len(a.shapes), desc="kernels prefill")
    for _ in range(a.rounds):
        for c in configs:
            switch(model, kernels, c)
            for b, n in a.shapes:
                seconds[c].setdefault(f"{b}x{n}", []).append(timed(b, n))
                bar.update()
    bar.close()
    switch(model, kernels, "all")
    results: dict[str, dict[str, dict[str, float]]] = {c: {} for c in configs}
    for c in configs:
        for shape, runs in seconds[c].items():
            med, base = statistics.median(runs), statistics.median(seconds["all"][shape])
            b, n = map(int, shape.split("x"))
            results[c][shape] = {"seconds": round(med, 3), "tokens_per_s": round(b * n / med, 1),
                                 "time_vs_all": round(med / base, 3)}
        print(c.ljust(10), "  ".join(f"{s} {v['seconds']:.2f} s (x{v['time_vs_all']:.2f} all's)"
                                     for s, v in results[c].items()))
    return report(a, {"configs": {c: label(c) for c in configs}, "results": results},
                  plot_prefill)


def plot_prefill(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    results = result["results"]
    shapes = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(7, 4))
    grouped_bars(ax, shapes, {short(c): {
        s: v["tokens_per_s"] for s, v in r.items()}
                              for c, r in results.items()},
                 [f"{s.replace('x', ' x ')} tokens" for s in shapes])
    ax.set_ylabel("prefill tokens/s (bf16)")
    ax.set_title("Prefill under each kernel configuration")
    ax.legend(fontsize=8)
    stamped_save(fig, result, path)


def stamped_save(fig: Any, result: dict[str, Any], path: Path) -> None:
    """Saves ``fig`` with the run's host, date and commit above it."""
    fig.suptitle(f"{result['machine']} ({result['date']}, {result['commit']})", fontsize=8)
    save(fig, path)


def short(config: str) -> str:
    """A configuration's name in a legend."""
    if config.startswith(REV):
        return f"own kernels as at {config[len(REV):]}"
    return SHORT.get(config, f"torch's {config}")


def plot_ab(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    results, batches = result["results"], [str(b) for b in result["args"]["batches"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    grouped_bars(ax, batches, {short(c): {
        b: cells["tokens_per_s"] for b, cells in r.items()} for c, r in results.items()},
        [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s (bf16, greedy)")
    revs = any(c.startswith(REV) for c in results)
    ax.set_title("The own CPU kernels against another revision's" if revs
                 else "Each own CPU kernel switched off in turn")
    ax.legend(fontsize=8)
    stamped_save(fig, result, path)


def _ab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=ints, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", type=lambda s: s.split(","), default=None,
                   help="comma-separated configurations (all, layer, matvec, norm, attention, "
                        "invariant, rowsN: the own product's row limit N; largeN: the same "
                        "for a layer's products of 4M weights or more; layerN: the "
                        "whole-layer kernel's; joined by +: several; "
                        "avx2, widened with AVX512-BF16; tokens with AMX; rev:REV: every "
                        "own kernel built from git revision REV's sources); default every one")


# ---- rows ---------------------------------------------------------------------------------


def shapes(hidden: int, inter: int, kv: int) -> list[tuple[int, int]]:
    """[N, K] of one layer's fused qkv, o, fused gate/up, down."""
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]


def rows(a: argparse.Namespace) -> Path:
    """Cost of the bf16 projections of one step by row count: the own kernel vs torch. A
    decode step multiplies one row per sequence through every projection and the head; a
    verify step 1 + drafts rows per sequence. This times exactly those products (the default
    model's shapes, random bf16 weights, bf16 rows as a bf16 model's activations are) from 1
    to 256 rows: the own kernel on all threads and on one (on CPUs with AVX512-BF16 also its
    AVX2 path), torch's bf16 ``F.linear`` and the fp32 GEMM against fp32 copies (what the
    engine uses above ``MATVEC_ROWS`` where torch has no bf16 GEMM, i.e. for prefill). The
    ratio to one row is what a verify step at batch 1 costs over a plain step. The four
    layers' weights are reused for every layer, so they stay in cache: the one-row figure
    is faster than a real step's, which streams 269 MB from memory."""
    import torch.nn.functional as F

    from tlt_serve.kernels import cpu_kernels, matvec_avx2, native_bf16_gemm, own_avx512_bf16

    kernels = cpu_kernels()
    if kernels is None or kernels.matvec is None:
        raise SystemExit("the own kernel is not available here (no AVX2 or no compiler)")
    matvec = kernels.matvec
    g = torch.Generator().manual_seed(0)
    layer = shapes(a.hidden, a.intermediate, a.kv_dim)
    weights = [(torch.randn(*s, generator=g) * 0.05).bfloat16()
               for s in [*layer, (a.vocab, a.hidden)]]
    w32 = [w.float() for w in weights]
    avx2 = matvec_avx2() if own_avx512_bf16() else None
    impls: dict[str, Callable[[int, torch.Tensor], torch.Tensor]] = {
        "kernel": lambda i, x: matvec(weights[i], x, True),
        "kernel_1_thread": lambda i, x: matvec(weights[i], x, True),
        **({"kernel_avx2": lambda i, x: avx2(weights[i], x, True)} if avx2 else {}),
        "torch_bf16": lambda i, x: F.linear(x, weights[i]),
        "torch_fp32_copy": lambda i, x: F.linear(x.float(), w32[i]).bfloat16(),
    }
    # without bf16 GEMM units torch's bf16 product is one matrix-vector product per row
    torch_bf16_rows = 1 << 30 if native_bf16_gemm() else 16

    def step(product: Callable[[int, torch.Tensor], torch.Tensor], n: int) -> Callable[[], None]:
        xs = [torch.randn(n, w.shape[1], generator=g).bfloat16() for w in weights]

        def run() -> None:
            for _ in range(a.layers):
                for i in range(len(layer)):
                    product(i, xs[i])
            product(len(layer), xs[-1])

        return run

    ms: dict[str, dict[int, float]] = {name: {} for name in impls}
    bar = tqdm(total=len(a.rows) * a.rounds, desc="kernels rows")
    for n in a.rows:
        times: dict[str, list[float]] = {name: [] for name in impls}
        runs = {name: step(fn, n) for name, fn in impls.items()
                if name != "torch_bf16" or n <= torch_bf16_rows}
        for _ in range(a.rounds):
            for name, run in runs.items():
                torch.set_num_threads(1 if name.endswith("1_thread") else a.threads)
                run()  # warm
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
            bar.update()
        for name in runs:
            ms[name][n] = round(statistics.median(times[name]) * 1e3, 2)
    bar.close()
    torch.set_num_threads(a.threads)
    weight_bytes = sum(w.numel() * 2 for w in weights[:-1]) * a.layers + weights[-1].numel() * 2
    result = {"ms_per_step": ms,
              "ratio_to_one_row": {n: {r: round(v / d[1], 2) for r, v in d.items()}
                                   for n, d in ms.items()},
              "kernel_gb_s_one_row": round(weight_bytes / (ms["kernel"][1] / 1e3) / 1e9, 1)}
    print(json.dumps({k: result[k] for k in ("ms_per_step", "kernel_gb_s_one_row")}, indent=1))
    return report(a, result, plot_rows)


def plot_rows(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in result["ms_per_step"].items():
        ax.plot([int(r) for r in d], list(d.values()), marker="o", label=name)
    ax.set_xlabel("rows (1 = decode at batch 1; 1 + drafts = a verify step)")
    ax.set_xscale("log", base=2)
    ax.set_ylabel("ms for all projections of one step")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    stamped_save(fig, result, path)


def _rows_arguments(p: argparse.ArgumentParser) -> None:
    for flag, default in (("hidden", 576), ("intermediate", 1536), ("kv-dim", 192),
                          ("vocab", 49152), ("layers", 30)):  # smollm2-135m
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--rows", type=ints, default=[1, 2, 3, 4, 5, 6, 8, 16, 32, 64, 128, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)


def _prefill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--shapes", type=lambda s: [tuple(map(int, x.split("x"))) for x in s.split(",")],
                   default=[(16, 512), (64, 128), (1, 2048)],
                   help="comma-separated SEQUENCESxTOKENS")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", type=lambda s: s.split(","), default=None,
                   help="as ab's")


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "kernels", {"ab": (_ab_arguments, ab),
                                     "prefill": (_prefill_arguments, prefill),
                                     "rows": (_rows_arguments, rows)}, argv)


if __name__ == "__main__":
    main()
