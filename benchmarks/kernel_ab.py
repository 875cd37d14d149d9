"""What each own CPU kernel buys a decoding engine: all on vs each switched off in turn.

One bf16 engine on the default model; between rounds its modules are switched to torch's
kernel for one of: the bf16 products (``matvec``), the RMSNorms (``norm``), the decode
attention (``attention``), or none (``all``); ``layer``: the same kernels op by op instead of
the whole-layer kernel (which needs all three, so switching any of them off also runs the
layers op by op); on CPUs with AVX512-BF16 also ``avx2``: the own
product on its AVX2 path with the row limit it had there (what it was before its AVX512-BF16
path). Greedy, ``--new-tokens`` per sequence, EOS
ignored, fresh prompts every round, configurations interleaved, median tokens/s per batch
size; every configuration's tokens are compared with ``all``'s (bf16 rounding differs between
kernels, so a few may differ). JSON + PNG.

    python -m benchmarks.kernel_ab --out benchmarks/results/kernel_ab.json
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import report
from benchmarks.prompts import chat_messages
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig
from tlt_serve.kernels import MATVEC_ROWS_NATIVE_BF16, CpuKernels, matvec_avx2, own_avx512_bf16
from tlt_serve.models.llama import LlamaModel, set_cpu_kernels

OFF = ("all", "layer", "matvec", "norm", "attention")  # "x": everything but x


def switch(model: LlamaModel, kernels: CpuKernels, off: str) -> None:
    """Own kernels everywhere except ``off`` ("all": none off; "avx2": the AVX2 product)."""
    if off == "avx2":  # op by op: the whole-layer kernel multiplies with its own product
        kernels = replace(
            kernels, matvec=matvec_avx2(), matvec_rows=MATVEC_ROWS_NATIVE_BF16, layer=None
        )
    set_cpu_kernels(model, kernels if off in ("all", "avx2") else replace(kernels, **{off: None}))


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/kernel_ab.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(config=EngineConfig(
        model=ModelConfig(model=args.model, dtype="bfloat16", max_model_len=1024),
        cache=CacheConfig(max_num_seqs=max(batches)),
    ))
    model = llm.engine.model
    kernels = model.kernels  # the full set; each round switches one of them off
    if kernels is None:
        raise SystemExit("the own kernels are not available here (no AVX2 or no compiler)")
    configs = (*OFF, "avx2") if own_avx512_bf16() else OFF
    tok = llm.tokenizer
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([tok.apply_chat_template(chat_messages(0))], SamplingParams(max_new_tokens=8))
    results: dict[str, dict[str, dict[str, float]]] = {c: {} for c in configs}
    bar = tqdm(total=len(batches) * args.rounds * len(configs), desc="kernel_ab")
    first = 1
    for bs in batches:
        tps: dict[str, list[float]] = {c: [] for c in configs}
        same: dict[str, list[float]] = {c: [] for c in configs}
        for _ in range(args.rounds):
            prompts = [tok.apply_chat_template(chat_messages(first + i)) for i in range(bs)]
            first += bs
            ref: list[tuple[int, ...]] = []
            for c in configs:
                switch(model, kernels, c)
                bar.set_postfix(bs=bs, off=c)
                t0 = time.perf_counter()
                res = llm.generate(prompts, params)
                dt = time.perf_counter() - t0
                toks = [tuple(r.samples[0].token_ids) for r in res]
                ref = ref or toks
                tps[c].append(sum(map(len, toks)) / dt)
                same[c].append(sum(a == b for a, b in zip(toks, ref, strict=True)) / bs)
                bar.update()
        base = statistics.median(tps["all"])
        for c in configs:
            med = statistics.median(tps[c])
            results[c][str(bs)] = {"tokens_per_s": round(med, 2), "vs_all": round(med / base, 3),
                                   "same_tokens_as_all": round(statistics.mean(same[c]), 3)}
    bar.close()
    switch(model, kernels, "all")
    result = {"model": args.model, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "threads": args.threads,
              "configs": {"all": "every own kernel",
                          "layer": "the own kernels op by op, no whole-layer kernel",
                          **{c: f"torch's {c} instead" for c in OFF[2:]},
                          "avx2": "the own product's AVX2 path (rows <= 8)"},
              "results": results}
    for c in configs:
        print(c.ljust(10), "  ".join(f"bs{b} {v['tokens_per_s']:6.1f} tok/s (x{v['vs_all']:.2f})"
                                     for b, v in results[c].items()))
    report.write(result, args.out, lambda _, png: plot(results, batches, png))


def plot(results: dict, batches: list[int], path: Path) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    configs = list(results)
    width = 0.8 / len(configs)
    for i, c in enumerate(configs):
        xs = [j + i * width for j in range(len(batches))]
        labels = {"all": "all own kernels", "avx2": "own product, AVX2 path"}
        label = labels.get(c, f"torch's {c}")
        ax.bar(xs, [results[c][str(b)]["tokens_per_s"] for b in batches], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))],
                  [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s (bf16, greedy)")
    ax.set_title("Each own CPU kernel switched off in turn")
    ax.legend(fontsize=8)
    report.save(fig, path)


if __name__ == "__main__":
    main()
