"""Offline accept of drafters on prompts none of them trained on: the benchmark prompt set.

The target answers the first ``--prompts`` prompts of ``benchmarks/prompts.py`` greedily
(``--max-new-tokens``, its serving dtype) once; every drafter then drafts greedy chains of
``--depth`` tokens over those answers (no target forward per drafter). Reported per drafter
and per prompt kind (chat / reasoning / code, in turn): the mean accept over every answer
position, the walk accept (the chains greedy serving drafts; what `spec_accept_length`
would show without the confidence cut) and top-1. JSON + PNG.

    python -m benchmarks.drafter_accept --drafters A,B --names templates,self
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import report
from benchmarks.adaptation_reference import version_stub
from benchmarks.prompts import ALL, CHAT, CODE, REASONING, chat_messages
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig
from tlt_serve.llm import LLM
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative.checkpoint import load_drafter
from trainer.data import Sample, make_samples, target_features
from trainer.evaluate import offline_accept, prepare_heldout
from trainer.packing import batches

KINDS = ("chat", "reasoning", "code")


def answers(model_dir: Path, n: int, max_new: int, dtype: str) -> list[Sample]:
    """The target's greedy answers to benchmark prompts 0..n-1, with their features."""
    tok = load_tokenizer(model_dir)
    prompts = [tok.apply_chat_template(chat_messages(i)) for i in range(n)]
    max_len = max(len(p) for p in prompts) + max_new + 1
    llm = LLM(
        config=EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=max_len),
            cache=CacheConfig(max_num_seqs=min(n, 64)),
        )
    )
    res = llm.generate(prompts, SamplingParams(max_new_tokens=max_new), use_tqdm=True)
    responses = [r.samples[0].token_ids for r in res]
    target = llm.engine.model
    del llm
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    return make_samples(prompts, responses, target_features(target, seqs, 4096))


def kind_of(i: int) -> str:
    """benchmarks/prompts.py's kind of prompt i (hand-written by kind; then in turn)."""
    i %= len(ALL)
    for kind, hand in zip(KINDS, (CHAT, REASONING, CODE), strict=True):
        if i < len(hand):
            return kind
        i -= len(hand)
    return KINDS[i % len(KINDS)]


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--drafters", required=True, help="comma-separated checkpoint directories")
    ap.add_argument("--names", default="", help="comma-separated labels (default: dir names)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results/drafter_accept.json")
    a = ap.parse_args()
    dirs = [Path(d).expanduser() for d in a.drafters.split(",")]
    names = a.names.split(",") if a.names else [d.name for d in dirs]
    if len(names) != len(dirs):
        raise SystemExit("--names: one label per drafter")
    model_dir = resolve_model_path(a.model)
    samples = answers(model_dir, a.prompts, a.max_new_tokens, a.dtype)
    stub = version_stub(model_dir)
    groups = {
        "all": samples,
        **{k: [s for i, s in enumerate(samples) if kind_of(i) == k] for k in KINDS},
    }
    results: dict[str, dict] = {}
    for name, d in zip(names, dirs, strict=True):
        drafter = load_drafter(d, stub)
        results[name] = {}
        for g, group in groups.items():
            held = prepare_heldout(drafter, batches(group, 512, 2, None))
            results[name][g] = offline_accept(drafter, held, a.depth).as_dict()
        r = results[name]["all"]
        print(
            f"{name}: accept (all positions) {r['accept_length']:.3f}, walk "
            f"{r['walk_accept_length']:.3f}, top-1 {r['top1']:.3f}; walk by kind "
            + ", ".join(f"{k} {results[name][k]['walk_accept_length']:.3f}" for k in KINDS)
        )
    result = {
        "benchmark": "drafter_accept",
        "args": vars(a),
        "results": results,
        "drafters": {n: str(d) for n, d in zip(names, dirs, strict=True)},
    }
    report.write(result, a.out, lambda _, png: plot(results, png, a))


def plot(results: dict[str, dict], path: Path, a: argparse.Namespace) -> None:
    plt = report.pyplot()
    groups = ["all", *KINDS]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(results)
    for j, (name, r) in enumerate(results.items()):
        xs = [i + j * width for i in range(len(groups))]
        ax.bar(xs, [r[g]["walk_accept_length"] for g in groups], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups)
    ax.set_ylabel(f"accepted drafts per chain (depth {a.depth})")
    ax.set_title(f"walk accept on {a.prompts} benchmark prompts, {a.max_new_tokens} greedy tokens")
    ax.legend()
    report.save(fig, path, dpi=100)


if __name__ == "__main__":
    main()
