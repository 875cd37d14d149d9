"""Speculative decoding speed: plain vs n-gram vs drafter vs adaptive, side by side.

Chat/reasoning/code prompts (benchmarks/prompts.py, not the warm-up prompts; each sequence of
a run its own, each configuration the same ones), same number of new tokens (EOS ignored), at
each batch size, every configuration measured in turn within one run (interleaved over
repeats in alternating order) and reported as ratios to plain decoding: the median over
repeats of each repeat's ratio to the plain run beside it, with their range.
``ngram`` and ``drafter`` speculate at every batch size (to show where speculation stops
paying); ``adaptive`` is what the server does by default (``--speculative auto``): speculate
only while at most ``max_batch`` sequences run.

    python -m benchmarks.spec_decode --drafter ~/.cache/tlt-serve/drafters/smollm2-135m \\
        --out benchmarks/results/spec_decode.json
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import report
from benchmarks.prompts import chat_messages
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig


@dataclass
class Run:
    tokens_per_s: float
    accept_length: float  # accepted drafts per sequence verification (excl. bonus)
    verify_fraction: float  # decode steps that verified drafts
    tokens: list[list[int]]


def make(model: str, dtype: str, spec: SpecConfig, rows: int) -> LLM:
    cfg = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, max_model_len=1024),
        cache=CacheConfig(max_num_seqs=rows),
        spec=spec,
    )
    return LLM(config=cfg)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    s = llm.engine.stats
    before = (s.spec.accepted, s.spec.verifies, s.spec.steps, s.decode_steps)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    accepted, verifies, steps, decodes = (
        a - b
        for a, b in zip(
            (s.spec.accepted, s.spec.verifies, s.spec.steps, s.decode_steps), before, strict=True
        )
    )
    tokens = [r.samples[0].token_ids for r in res]
    return Run(
        tokens_per_s=sum(len(t) for t in tokens) / dt,
        accept_length=accepted / verifies if verifies else 0.0,
        verify_fraction=steps / decodes if decodes else 0.0,
        tokens=tokens,
    )


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="drafter checkpoint (tlt-train warmup)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=SpecConfig.num_draft_tokens)
    ap.add_argument("--max-batch", type=int, default=SpecConfig.max_batch)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rows = max(batches)
    forced = dict(num_draft_tokens=args.depth, max_batch=rows)
    specs = {"plain": SpecConfig(), "ngram": SpecConfig(method="ngram", **forced)}
    if args.drafter:
        specs["drafter"] = SpecConfig(method="drafter", drafter=args.drafter, **forced)
    specs["adaptive"] = SpecConfig(
        method="auto", drafter=args.drafter, num_draft_tokens=args.depth, max_batch=args.max_batch
    )
    llms = {name: make(args.model, args.dtype, spec, rows) for name, spec in specs.items()}
    tok = llms["plain"].tokenizer
    params = SamplingParams(
        max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True, seed=0
    )
    for llm in llms.values():  # warm-up: kernels, allocator, first-call overheads
        llm.generate([tok.apply_chat_template(chat_messages(0))], SamplingParams(max_new_tokens=8))

    results: dict[str, dict[str, dict[str, float | list[float]]]] = {name: {} for name in specs}
    total = len(batches) * args.repeats * len(specs)
    bar = tqdm(total=total, desc="spec_decode")
    first = 1  # prompt 0 warmed up; every later sequence gets a prompt of its own
    for bs in batches:
        runs: dict[str, list[Run]] = {name: [] for name in specs}
        for rep in range(args.repeats):
            # Fresh prompts per repeat: at T=0 a repeated prompt would let the n-gram proposer
            # copy its earlier output from the engine's index of completed outputs.
            prompts = [tok.apply_chat_template(chat_messages(first + i)) for i in range(bs)]
            first += bs
            # Alternate the order: on this shared machine speed drifts within a run, and a
            # fixed order would hand the drift to the configurations measured last.
            order = list(llms.items())
            for name, llm in order if rep % 2 == 0 else order[::-1]:
                bar.set_postfix(bs=bs, config=name)
                runs[name].append(run(llm, prompts, params))
                bar.update()
        ref = runs["plain"][0].tokens
        for name, rs in runs.items():
            tps = statistics.median(r.tokens_per_s for r in rs)
            same = sum(a == b for a, b in zip(rs[0].tokens, ref, strict=True)) / bs
            # Each repeat's ratio to plain decoding measured next to it (same prompts, a few
            # seconds apart): the machine's speed drifts by more than ±10% between repeats, so
            # paired ratios say more than a ratio of medians; their range shows the noise.
            pairs = zip(rs, runs["plain"], strict=True)
            ratios = [r.tokens_per_s / p.tokens_per_s for r, p in pairs]
            results[name][str(bs)] = {
                "tokens_per_s": round(tps, 2),
                "speedup": round(statistics.median(ratios), 3),
                "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "accept_length": round(statistics.mean(r.accept_length for r in rs), 3),
                "verify_fraction": round(statistics.mean(r.verify_fraction for r in rs), 3),
                "same_tokens_as_plain": round(same, 3),
            }
    bar.close()
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "new_tokens": args.new_tokens,
        "depth": args.depth,
        "adaptive_max_batch": args.max_batch,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "threads": args.threads,
        "cpu_count": len(__import__("os").sched_getaffinity(0)),
        "results": results,
        # Median tokens/s per batch-size bucket and strategy, as the adaptive policy measured
        # them: where it chose to speculate, and with what.
        "adaptive_policy": llms["adaptive"].engine.spec.policy.table(),
        "command": "python -m benchmarks.spec_decode "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
    }
    print(json.dumps(results, indent=2))
    report.write(result, args.out, plot)


def plot(result: dict, path: Path) -> None:  # type: ignore[type-arg]
    """Tokens/s and speedup vs plain per batch size; the title names ``machine``."""
    plt = report.pyplot()
    results = result["results"]
    names = list(results)
    batches = list(results[names[0]])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(batches))]
        ax1.bar(xs, [results[name][b]["tokens_per_s"] for b in batches], width, label=name)
        mid = [results[name][b]["speedup"] for b in batches]
        r = results[name]
        spans = [r[b].get("speedup_range", [m, m]) for b, m in zip(batches, mid, strict=True)]
        err = [
            [m - lo for m, (lo, _) in zip(mid, spans, strict=True)],
            [hi - m for m, (_, hi) in zip(mid, spans, strict=True)],
        ]
        ax2.errorbar(batches, mid, yerr=err, marker="o", capsize=3, label=name)
    ax1.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(batches))], batches)
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("tokens / s")
    ax1.legend()
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("speedup vs plain (median of paired repeats, range)")
    ax2.legend()
    fig.suptitle(
        f"{result['model']} {result['dtype']}, {result['new_tokens']} new tokens, depth "
        f"{result['depth']}, T={result['temperature']} ({result['machine']})",
        fontsize=9,
    )
    report.save(fig, path)


if __name__ == "__main__":
    main()
