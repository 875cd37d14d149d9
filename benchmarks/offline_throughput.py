"""Offline decode throughput: tlt-serve's engine vs the HF transformers generate loop.

Same prompts (chat-templated), same number of new tokens (EOS ignored), bf16, greedy, at
batch 1, 16 and 64, measured side by side in one run and reported as ratios.

    python -m benchmarks.offline_throughput --out benchmarks/results/offline_throughput.json
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import report
from benchmarks.prompts import chat_messages
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig


def run_ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    p = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate(prompts, p)
    dt = time.perf_counter() - t0
    assert all(len(r.samples[0].token_ids) == new_tokens for r in res)
    return len(prompts) * new_tokens / dt


def run_hf(hf, pad_id: int, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF generate expects
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / dt


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    cfg = EngineConfig(
        model=ModelConfig(model=args.model, dtype="bfloat16", max_model_len=1024),
        cache=CacheConfig(max_num_seqs=max(batches)),
    )
    llm = LLM(config=cfg)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.bfloat16).eval()
    pad = llm.tokenizer.hf.pad_token_id or 0
    rows = []
    for bs in tqdm(batches, desc="batch sizes"):
        prompts = [llm.tokenizer.apply_chat_template(chat_messages(i)) for i in range(bs)]
        run_ours(llm, prompts[:1], 4)  # warm-up both paths at this shape
        run_hf(hf, pad, prompts[:1], 4)
        ours = max(run_ours(llm, prompts, args.new_tokens) for _ in range(args.repeats))
        ref = max(run_hf(hf, pad, prompts, args.new_tokens) for _ in range(args.repeats))
        rows.append({"batch": bs, "tlt_tok_s": ours, "hf_tok_s": ref, "ratio": ours / ref})
        print(f"bs {bs:3d}: tlt-serve {ours:8.1f} tok/s   HF {ref:8.1f} tok/s   x{ours / ref:.2f}")
    result = {
        "benchmark": "offline_throughput",
        "model": args.model,
        "dtype": "bfloat16",
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    report.write(result, args.out, plot)


def plot(result: dict, path: Path) -> Path:
    """Grouped bars: tok/s of tlt-serve and HF per batch size, ratio on top."""
    plt = report.pyplot()
    rows = result["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [r["tlt_tok_s"] for r in rows], 0.4, label="tlt-serve")
    ax.bar([x + 0.2 for x in xs], [r["hf_tok_s"] for r in rows], 0.4, label="HF generate")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x - 0.2, r["tlt_tok_s"], f"x{r['ratio']:.2f}", ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['model']} {result['dtype']}, {result['new_tokens']} new tokens")
    ax.legend()
    return report.save(fig, path, dpi=100)


if __name__ == "__main__":
    main()
