"""Scoring given sequences (prompt logprobs only) against a plain prefill of the same tokens,
servers side by side, all through ``/v1/completions`` (so vLLM's own server is a peer):

  plain  every sequence sent as a prompt for one new token: its prefill, the head on its
         last position
  score  the same with ``prompt_logprobs`` (each token's logprob given the tokens before it:
         the head on every position)

Every sequence is its own request, all sent at once. The prefix cache is off everywhere (a
repeat would otherwise find the sequence cached; scoring never reads a cached position).
Configurations (``--configs``): ``native``, ``native-invariant`` (``--batch-invariant``),
``vllm`` (``--backend vllm``) and ``vllm-cpu`` (vLLM's own server, ``--vllm-python`` its
interpreter). Modes alternate within each server
over ``--repeats``; figures are medians. The floor of what scoring adds: the head's
multiply-adds on every position over a prefill's (printed from the model's shape).

    python -m benchmarks.scoring run
    python -m benchmarks.scoring run --configs native,vllm-cpu --sequences 64 --tokens 512

``consistency``: the logprobs sequences were generated with against those of scoring them
afterwards, in-process on the native engine, with and without ``--batch-invariant``.

    python -m benchmarks.scoring consistency
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common.prompts import ALL, chat_prompts, tokenizer
from benchmarks.common.results import grouped_bars, ints, names, pyplot, report, save, tool
from benchmarks.common.servers import VLLM_SERVED_NAME, running_server, running_vllm

CONFIGS = {"native": ["--no-prefix-cache"],
           "native-invariant": ["--no-prefix-cache", "--batch-invariant"],
           "vllm": ["--backend", "vllm", "--no-prefix-cache"]}
MODES = ("plain", "score")


def sequences(tok: Any, count: int, tokens: int) -> list[list[int]]:
    """``count`` distinct sequences of ``tokens`` tokens: the benchmark texts joined, each
    sequence starting at another text."""
    stream = [t for text in ALL for t in tok.encode(text + "\n")]
    out = []
    for i in range(count):
        offset = (i * 97) % len(stream)
        ring = stream[offset:] + stream[:offset]
        out.append((ring * (tokens // len(ring) + 1))[:tokens])
    return out


async def one_mode(http: httpx.AsyncClient, model: str, seqs: list[list[int]],
                   mode: str) -> dict[str, Any]:
    async def one(ids: list[int]) -> int:
        body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1,
                                "temperature": 1.0}
        if mode == "score":
            body["prompt_logprobs"] = 0
        resp = await http.post("/v1/completions", json=body)
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        if mode == "score":
            assert len(choice["prompt_logprobs"]) == len(ids), "every position scored"
        return len(ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(s) for s in seqs)))
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 3), "prompt_tok_s": round(tokens / seconds, 1)}


@contextmanager
def server(a: argparse.Namespace, config: str) -> Iterator[tuple[str, str]]:
    """The configuration's server for the ``with`` block: (URL, model name)."""
    if config == "vllm-cpu":
        from tlt_serve.models.provision import resolve_model_path

        path = str(resolve_model_path(a.model))
        peer = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
                "--no-enable-prefix-caching"]
        with running_vllm(a.vllm_python, path, peer) as url:
            yield url, VLLM_SERVED_NAME
        return
    args = ["--model", a.model, "--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
            *CONFIGS[config]]
    with running_server(args) as url:
        yield url, a.model


def head_share(model: str, tokens: int) -> float:
    """What scoring adds at least: the head's multiply-adds on every position (but the one
    a plain prefill computes) over a plain prefill's (layers on every position, the head
    on one)."""
    from tlt_serve.models.arch import ArchConfig
    from tlt_serve.models.provision import resolve_model_path

    cfg = ArchConfig.from_dir(resolve_model_path(model))
    head = cfg.hidden_size * cfg.vocab_size
    layer = cfg.hidden_size * (2 * cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size)
    prefill = tokens * cfg.num_layers * layer + head
    return (tokens - 1) * head / prefill


def run(a: argparse.Namespace) -> Path:
    bad = [c for c in a.configs if c not in CONFIGS and c != "vllm-cpu"]
    if bad:
        raise SystemExit(f"unknown configurations {bad}: {', '.join([*CONFIGS, 'vllm-cpu'])}")
    seqs = sequences(tokenizer(a.model), a.sequences, a.tokens)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {m: [] for m in MODES} for c in a.configs}
    bar = tqdm(total=len(a.configs) * a.repeats * len(MODES), desc="runs")
    for config in a.configs:
        with server(a, config) as (url, model):
            async def modes(url: str = url, model: str = model, config: str = config) -> None:
                async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
                    await one_mode(http, model, seqs[:2], "score")  # warm both paths
                    for r in range(a.repeats):
                        order = MODES if r % 2 == 0 else MODES[::-1]
                        for mode in order:
                            runs[config][mode].append(await one_mode(http, model, seqs, mode))
                            bar.update()

            asyncio.run(modes())
    bar.close()
    rows = []
    for config in a.configs:
        row: dict[str, Any] = {"config": config}
        for mode in MODES:
            row[mode] = {"runs": runs[config][mode],
                         "seconds": statistics.median(f["seconds"] for f in runs[config][mode])}
        row["score_over_plain"] = round(row["score"]["seconds"] / row["plain"]["seconds"], 3)
        rows.append(row)
    floor = head_share(a.model, a.tokens)
    base = rows[-1]
    for row in rows:
        row["score_vs_" + base["config"]] = round(
            base["score"]["seconds"] / row["score"]["seconds"], 3)
        print(f"{row['config']:9s} plain {row['plain']['seconds']:7.2f} s  score "
              f"{row['score']['seconds']:7.2f} s  score/plain x{row['score_over_plain']}  "
              f"scoring x{row['score_vs_' + base['config']]} {base['config']}'s speed")
    print(f"floor of score/plain (the head on every position): x{1 + floor:.3f}")
    shape = f"{a.sequences} sequences x {a.tokens} tokens, each its own request, all at once"
    return report(a, {"shape": shape, "rows": rows, "floor_score_over_plain": round(1 + floor, 3)},
                  plot)


def plot(result: dict[str, Any], png: Path) -> None:
    series = {m: {r["config"]: r[m]["seconds"] for r in result["rows"]} for m in MODES}
    _bars(result, png, [r["config"] for r in result["rows"]], series,
          "seconds (lower is better)", f"scoring vs plain prefill: {result['shape']}")


def _bars(result: dict[str, Any], png: Path, groups: list[str],
          series: dict[str, dict[str, float]], ylabel: str, title: str) -> None:
    """One grouped bar chart, the run's host, date and commit under its title."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    grouped_bars(ax, groups, series)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{title}\n{result['machine']} ({result['date']}, {result['commit']})",
                 fontsize=8)
    save(fig, png)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", type=names, default=["native", "vllm", "vllm-cpu"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the interpreter of an environment with vLLM (configuration vllm-cpu)")


# ---- consistency ---------------------------------------------------------------------------

MODELS = {"default": False, "batch-invariant": True}  # label → ModelConfig.batch_invariant


def consistency(a: argparse.Namespace) -> Path:
    """Sequences sampled at T = 1 (a seed each) with their tokens' logprobs, then sent back
    as prompts to be scored (``prompt_logprobs``): per engine and batch size, how far the
    scored logprobs are from the generated ones (mean, largest, the share bit for bit
    equal). One in-process engine per mode, prefix cache off."""
    import torch

    from tlt_serve import LLM, SamplingParams
    from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig

    torch.set_num_threads(a.threads)
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(MODELS) * len(a.batches), desc="consistency")
    for label, invariant in MODELS.items():
        llm = LLM(config=EngineConfig(
            model=ModelConfig(model=a.model, dtype="bfloat16", max_model_len=1024,
                              batch_invariant=invariant),
            cache=CacheConfig(max_num_seqs=max(a.batches), prefix_cache=False)))
        prompts = chat_prompts(llm.tokenizer, 1, max(a.batches))
        for bs in a.batches:
            params = [SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, seed=i,
                                     ignore_eos=True, logprobs=True) for i in range(bs)]
            gen = llm.generate(prompts[:bs], params)
            seqs = [p + r.samples[0].token_ids for p, r in zip(prompts, gen, strict=False)]
            scored = llm.generate(seqs, [SamplingParams(max_new_tokens=0, prompt_logprobs=0,
                                                        prompt_logprobs_start=len(p))
                                         for p in prompts[:bs]])
            diffs = [abs(x - y) for s, g in zip(scored, gen, strict=True)
                     for x, y in zip(s.samples[0].prompt_logprobs.logprobs,  # type: ignore[union-attr]
                                     g.samples[0].logprobs, strict=True)]
            rows.append({"engine": label, "batch": bs, "tokens": len(diffs),
                         "mean_abs_diff": statistics.mean(diffs), "max_abs_diff": max(diffs),
                         "equal_share": sum(d == 0 for d in diffs) / len(diffs)})
            r = rows[-1]
            print(f"{label:16s} batch {bs:3d}: {r['tokens']} tokens, mean |diff| "
                  f"{r['mean_abs_diff']:.5f}, largest {r['max_abs_diff']:.4f}, "
                  f"bit for bit {r['equal_share']:.3f}")
            bar.update()
        del llm
    bar.close()
    return report(a, {"rows": rows}, plot_consistency)


def plot_consistency(result: dict[str, Any], png: Path) -> None:
    rows = result["rows"]
    groups = [f"batch {b}" for b in dict.fromkeys(r["batch"] for r in rows)]
    series = {f"{e}, {k}": {f"batch {r['batch']}": r[key] for r in rows if r["engine"] == e}
              for e in MODELS for k, key in (("mean", "mean_abs_diff"),
                                             ("largest", "max_abs_diff"))}
    _bars(result, png, groups, series, "|scored - generated logprob| (nats)",
          "logprobs scored vs generated, bf16")


def _consistency_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=ints, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "scoring", {"run": (_arguments, run),
                                     "consistency": (_consistency_arguments, consistency)}, argv)


if __name__ == "__main__":
    main()
