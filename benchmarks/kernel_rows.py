"""Cost of the bf16 projections of one step by row count: the own kernel vs torch.

A decode step multiplies one row per sequence through every projection and the head; a
verify step 1 + drafts rows per sequence. This times exactly those products (the default
model's shapes, random bf16 weights, bf16 rows as a bf16 model's activations are) from 1 to
256 rows: the own kernel on all threads and on one (on CPUs with AVX512-BF16 also its AVX2
path, what it was before), torch's bf16 ``F.linear`` and the fp32 GEMM against fp32 copies
(what the engine uses above ``MATVEC_ROWS`` where torch has no bf16 GEMM, i.e. for prefill).
Interleaved rounds, median; the ratio to one row is what a verify step at batch 1 costs over a
plain step. The four layers' weights are reused for every layer, so they stay in cache: the
one-row figure is faster than a real step's, which streams 269 MB from memory.

    python -m benchmarks.kernel_rows --out benchmarks/results/kernel_rows.json
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks import report
from tlt_serve.kernels import cpu_kernels, matvec_avx2, native_bf16_gemm, own_avx512_bf16


def shapes(hidden: int, inter: int, kv: int, vocab: int) -> list[tuple[int, int]]:
    """[N, K] of one layer's fused qkv, o, fused gate/up, down; then the head."""
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=576)  # smollm2-135m
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv-dim", type=int, default=192)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,16,32,64,128,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/kernel_rows.json")
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the own kernel is not available here (no AVX2 or no compiler)")
    matvec = kernels.matvec
    g = torch.Generator().manual_seed(0)
    layer = shapes(args.hidden, args.intermediate, args.kv_dim, args.vocab)
    head = (args.vocab, args.hidden)
    weights = [(torch.randn(*s, generator=g) * 0.05).bfloat16() for s in [*layer, head]]
    w32 = [w.float() for w in weights]

    def step(product: Callable[[int, torch.Tensor], torch.Tensor], rows: int) -> Callable[[], None]:
        xs = [torch.randn(rows, w.shape[1], generator=g).bfloat16() for w in weights]

        def run() -> None:
            for _ in range(args.layers):
                for i in range(len(layer)):
                    product(i, xs[i])
            product(len(layer), xs[-1])

        return run

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
    ms: dict[str, dict[int, float]] = {name: {} for name in impls}
    row_counts = [int(r) for r in args.rows.split(",")]
    bar = tqdm(total=len(row_counts) * args.rounds, desc="kernel_rows")
    for rows in row_counts:
        times: dict[str, list[float]] = {name: [] for name in impls}
        runs = {n: step(fn, rows) for n, fn in impls.items()
                if n != "torch_bf16" or rows <= torch_bf16_rows}
        for _ in range(args.rounds):
            for name, run in runs.items():
                torch.set_num_threads(1 if name.endswith("1_thread") else args.threads)
                run()  # warm
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
            bar.update()
        for name in runs:
            ms[name][rows] = round(statistics.median(times[name]) * 1e3, 2)
    bar.close()
    torch.set_num_threads(args.threads)
    weight_bytes = sum(w.numel() * 2 for w in weights[:-1]) * args.layers + weights[-1].numel() * 2
    result = {
        "benchmark": "kernel_rows",
        "args": vars(args),
        "ms_per_step": ms,
        "ratio_to_one_row": {
            n: {r: round(v / d[1], 2) for r, v in d.items()} for n, d in ms.items()
        },
        "kernel_gb_s_one_row": round(weight_bytes / (ms["kernel"][1] / 1e3) / 1e9, 1),
    }
    print(json.dumps({k: result[k] for k in ("ms_per_step", "kernel_gb_s_one_row")}, indent=1))
    report.write(result, args.out, lambda _, png: plot(ms, png))


def plot(ms: dict[str, dict[int, float]], path: Path) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in ms.items():
        ax.plot(list(d), list(d.values()), marker="o", label=name)
    ax.set_xlabel("rows (1 = decode at batch 1; 1 + drafts = a verify step)")
    ax.set_xscale("log", base=2)
    ax.set_ylabel("ms for all projections of one step")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    report.save(fig, path)


if __name__ == "__main__":
    main()
