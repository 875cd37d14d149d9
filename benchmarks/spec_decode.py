"""Speculative decoding speed: plain vs n-gram vs suffix vs drafter vs adaptive, side by side.

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

``--backends native,vllm`` (or ``--http``) measures through the servers instead, every
backend the same way (benchmarks/spec_served.py): for each backend and method (``--methods``
off, ngram, drafter) a fresh ``tlt-serve serve --backend B``, one ``/generate`` call of B
prompts per batch size, speedups against the same backend's ``off``, native / vLLM ``off``,
and with ``--vllm-serve`` our vLLM backend against plain ``vllm serve``:

    python -m benchmarks.spec_decode --backends native,vllm --methods off,ngram,drafter \\
        --drafter ~/.cache/tlt-serve/drafters/smollm2-135m --vllm-serve --repeats 3 \\
        --out benchmarks/results/spec_decode_backends.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import report, spec_served
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
    ap.add_argument("--suffix-depth", type=int, default=8,
                    help="most suffix drafts per step (they end earlier where unsure)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (in-process only)")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/"
                    "spec_decode.json, served: spec_decode_backends.json)")
    served = ap.add_argument_group("served (backend against backend)")
    served.add_argument("--backends", default="native",
                        help="comma-separated, from native,vllm; native alone (default): "
                        "in-process engines as above; with vllm: every backend through its "
                        "server")
    served.add_argument("--http", action="store_true",
                        help="measure through the servers even for native alone")
    served.add_argument("--methods", default=None,
                        help="served: from off,ngram,drafter (default: off,ngram and drafter "
                        "with --drafter)")
    served.add_argument("--max-model-len", type=int, default=1024)
    served.add_argument("--served-max-batch", type=int, default=None, metavar="N",
                        help="served: speculate while at most N sequences run (default: the "
                        "largest batch, i.e. always); e.g. 8 measures what tail-only "
                        "speculation costs at larger batches")
    served.add_argument("--min-draft-confidence", type=float, default=0.0, metavar="P",
                        help="served: the native drafter's chain cut (default 0: K drafts "
                        "every step, as vLLM's EAGLE drafts: like for like)")
    served.add_argument("--vllm-serve", action="store_true",
                        help="also measure plain `vllm serve` (needs vllm in --backends)")
    served.add_argument("--vllm-serve-batches", default=None,
                        help="its batch sizes (default: the smallest and largest of --batches)")
    served.add_argument("--vllm-serve-args", default="",
                        help="extra `vllm serve` flags, one string (default: vLLM's own "
                        "defaults, torch.compile on a CPU; our vLLM backend runs eager with "
                        "32-token blocks: '--enforce-eager --block-size 32' is like for like)")
    args = ap.parse_args()
    if served_mode(ap, args):
        main_served(args)
        return
    args.out = args.out or "benchmarks/results/spec_decode.json"
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rows = max(batches)
    forced = dict(num_draft_tokens=args.depth, max_batch=rows)
    specs = {"plain": SpecConfig(), "ngram": SpecConfig(method="ngram", **forced),
             "suffix": SpecConfig(method="suffix", num_draft_tokens=args.suffix_depth,
                                  max_batch=rows)}
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
        "command": command(args),
    }
    print(json.dumps(results, indent=2))
    report.write(result, args.out, plot)


SERVED_ONLY = ("backends", "http", "methods", "max_model_len", "vllm_serve",
               "vllm_serve_batches", "vllm_serve_args")
IN_PROCESS_ONLY = ("max_batch", "threads")


def command(args: argparse.Namespace, skip: tuple[str, ...] = SERVED_ONLY) -> str:
    """The command line that measures the same again (the options of the other mode left
    out)."""
    parts = []
    for k, v in vars(args).items():
        if k in skip or v is None or v is False:
            continue
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            parts.append(flag)
        elif isinstance(v, list):
            parts.append(f"{flag} {','.join(map(str, v))}")
        else:
            parts.append(f"{flag} {shlex.quote(str(v))}" if str(v) else "")
    return "python -m benchmarks.spec_decode " + " ".join(p for p in parts if p)


def served_mode(ap: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Whether to measure through the servers; checks and normalises the served options
    (``ap.error`` before minutes of servers, not after). The in-process defaults of the
    served-only options are left as they were."""
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in spec_served.BACKENDS:
            ap.error(f"--backends: unknown {b!r} (from {','.join(spec_served.BACKENDS)})")
    if not backends:
        ap.error("--backends: none given")
    if backends == ["native"] and not args.http:
        for flag, value in (("--methods", args.methods), ("--vllm-serve", args.vllm_serve),
                            ("--vllm-serve-batches", args.vllm_serve_batches)):
            if value:
                ap.error(f"{flag}: only through the servers (--backends with vllm, or --http)")
        return False
    from tlt_serve.backends import missing

    if "vllm" in backends and (why := missing("vllm")):
        ap.error(why)
    if args.vllm_serve and "vllm" not in backends:
        ap.error("--vllm-serve: compares with our vLLM backend; add vllm to --backends")
    methods = [m for m in (args.methods or "").split(",") if m] or (
        ["off", "ngram"] + (["drafter"] if args.drafter else []))
    for m in methods:
        if m not in spec_served.METHODS:
            ap.error(f"--methods: unknown {m!r} (from {','.join(spec_served.METHODS)})")
    if "off" not in methods:
        ap.error("--methods: needs off (every speedup is against the same backend's off)")
    if "drafter" in methods and not args.drafter:
        ap.error("--methods drafter: needs --drafter (a tlt-train warmup checkpoint)")
    args.batches = [int(b) for b in args.batches.split(",")]
    serve = args.vllm_serve_batches
    args.vllm_serve_batches = ([int(b) for b in serve.split(",")] if serve
                               else sorted({min(args.batches), max(args.batches)}))
    if args.vllm_serve and not set(args.vllm_serve_batches) <= set(args.batches):
        ap.error("--vllm-serve-batches: each must be one of --batches (it is compared there)")
    args.backends, args.methods = backends, list(dict.fromkeys(methods))
    args.out = args.out or "benchmarks/results/spec_decode_backends.json"
    return True


def main_served(args: argparse.Namespace) -> None:
    measured = spec_served.run_served(args)
    result = {
        "mode": "served",
        "model": args.model,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "backends": args.backends,
        "methods": args.methods,
        "batches": args.batches,
        "vllm_serve_batches": args.vllm_serve_batches if args.vllm_serve else None,
        "vllm_serve_args": args.vllm_serve_args if args.vllm_serve else None,
        "new_tokens": args.new_tokens,
        "depth": args.depth,
        "max_model_len": args.max_model_len,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "cpu_count": len(__import__("os").sched_getaffinity(0)),
        "command": command(args, IN_PROCESS_ONLY),
        **measured,
    }
    print_served(measured)
    report.write(result, args.out, spec_served.plot)


def print_served(measured: dict) -> None:  # type: ignore[type-arg]
    """One line per backend x method x batch, then the cross-backend ratios."""
    for backend, methods in measured["results"].items():
        for method, cells in methods.items():
            for bs, c in cells.items():
                rng = c["speedup_range"] or [None, None]
                print(f"{backend:>6} {method:>7} bs={bs:>3}: {c['tokens_per_s']:8.1f} tok/s  "
                      f"speedup x{c['speedup']} [{rng[0]}, {rng[1]}]  "
                      f"accept {c['accept_length']}  verify/seq {c['verify_ct_per_seq']}  "
                      f"same tokens as off {c['same_tokens_as_off']}")
    for key, label in (("native_over_vllm_off", "native / vLLM backend, off"),
                       ("vllm_backend_over_vllm_serve", "vLLM backend (off) / vllm serve")):
        for bs, c in measured.get(key, {}).items():
            print(f"{label} bs={bs}: x{c['ratio']} {c['range']}, same tokens "
                  f"{c['same_tokens']}")


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
