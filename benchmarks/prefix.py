"""What reusing cached prefixes buys on the request shapes that repeat them, server
configurations side by side, all through the OpenAI routes (so vLLM's own server is a peer):

  agentic  conversations of several turns sharing a long system prompt, each turn re-sending
           the whole history (``/v1/chat/completions``), the conversations concurrent;
  slime    the n samples of each prompt sent as n separate requests, all at once
           (``/v1/completions`` with token ids), as slime sends a GRPO group.

Configurations (``--configs``): ``native`` (the native engine, prefix cache on, its default),
``native-nocache`` (``--no-prefix-cache``), ``native-nomix`` (``--no-mixed-steps``: admitted
prompts prefill in steps of their own), ``native-auto`` / ``native-auto-drafter``
(``--speculative auto``, the second with ``--drafter``), ``native-capture`` /
``native-capture-nocache`` (the same capturing drafter training samples, ``--capture``: the
cache keeps every position's features beside the KV), ``vllm`` / ``vllm-nocache`` (the same
server on ``--backend vllm``) and ``vllm-cpu`` (vLLM's own OpenAI server, its defaults,
``--vllm-python`` its interpreter). Each round starts every server in turn, runs both shapes on
it and stops it; the figures are medians over ``--rounds``. Requests carry no seed: vLLM-CPU
0.32's engine dies on a seeded prompt it chunks ("CPU Generator does not use offset"), and with
its defaults it chunks long prompts.

    python -m benchmarks.prefix run
    python -m benchmarks.prefix run --configs native,native-nocache,vllm-cpu --rounds 2
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
from benchmarks.common.results import grouped_bars, names, pyplot, report, save, tool
from benchmarks.common.servers import VLLM_SERVED_NAME, running_server, running_vllm

CONFIGS = {"native": [], "native-nocache": ["--no-prefix-cache"],
           "native-nomix": ["--no-mixed-steps"],
           "native-auto": ["--speculative", "auto"],
           "native-auto-drafter": ["--speculative", "auto"],  # + --drafter
           "native-capture": ["--capture"],
           "native-capture-nocache": ["--capture", "--no-prefix-cache"],
           "vllm": ["--backend", "vllm"], "vllm-nocache": ["--backend", "vllm",
                                                            "--no-prefix-cache"]}
SHAPES = ("agentic", "slime")


def system_prompt(tok: Any, tokens: int) -> str:
    """Guidelines of about ``tokens`` tokens: the benchmark prompts joined."""
    lines, n = [], 0
    for text in ALL:
        lines.append(f"- {text}")
        n += len(tok.encode(text)) + 2
        if n >= tokens:
            break
    return "Answer as an assistant who follows these worked examples:\n" + "\n".join(lines)


async def agentic(http: httpx.AsyncClient, model: str, a: argparse.Namespace,
                  system: str, first: int = 0, seed: int | None = None) -> dict[str, Any]:
    """``--conversations`` conversations of ``--turns`` turns, concurrent; each turn sends
    the system prompt, every earlier turn and the new question (the benchmark texts from
    ``first`` on); with ``seed``, turn t of conversation c carries seed + c * turns + t, so
    that servers compared sample the same answers (as far as their rounding agrees)."""
    cached = prompt = completion = 0

    async def conversation(c: int) -> None:
        nonlocal cached, prompt, completion
        messages = [{"role": "system", "content": system}]
        for t in range(a.turns):
            messages.append({"role": "user",
                             "content": ALL[(first + c * a.turns + t) % len(ALL)]})
            body: dict[str, Any] = {"model": model, "messages": messages,
                                    "max_tokens": a.max_tokens, "temperature": 0.7}
            if seed is not None:
                body["seed"] = seed + c * a.turns + t
            resp = await http.post("/v1/chat/completions", json=body)
            resp.raise_for_status()
            out = resp.json()
            messages.append({"role": "assistant",
                             "content": out["choices"][0]["message"]["content"]})
            usage = out["usage"]
            details = usage.get("prompt_tokens_details") or {}
            cached += int(details.get("cached_tokens") or 0)
            prompt += usage["prompt_tokens"]
            completion += usage["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(a.conversations)))
    return _figures(time.perf_counter() - t0, prompt, completion, cached)


async def slime(http: httpx.AsyncClient, model: str, a: argparse.Namespace,
                prompts: list[list[int]], seed: int | None = None) -> dict[str, Any]:
    """``--prompts`` prompts x ``--samples`` separate requests each, at T = 1, all at once;
    with ``seed``, request i carries seed + i."""
    cached = prompt = completion = 0

    async def one(p: list[int], i: int) -> None:
        nonlocal cached, prompt, completion
        body: dict[str, Any] = {"model": model, "prompt": p, "max_tokens": a.max_tokens,
                                "temperature": 1.0}
        if seed is not None:
            body["seed"] = seed + i
        resp = await http.post("/v1/completions", json=body)
        resp.raise_for_status()
        usage = resp.json()["usage"]
        details = usage.get("prompt_tokens_details") or {}
        cached += int(details.get("cached_tokens") or 0)
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, i * a.samples + j) for i, p in enumerate(prompts)
                           for j in range(a.samples)))
    return _figures(time.perf_counter() - t0, prompt, completion, cached)


def _figures(seconds: float, prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"seconds": round(seconds, 3), "prompt_tokens": prompt,
            "completion_tokens": completion, "cached_tokens": cached,
            "cached_share": round(cached / prompt, 4) if prompt else 0.0,
            "completion_tok_s": round(completion / seconds, 2)}


@contextmanager
def server(a: argparse.Namespace, config: str) -> Iterator[tuple[str, str]]:
    """The configuration's server for the ``with`` block: (URL, model name)."""
    if config == "vllm-cpu":
        from tlt_serve.models.provision import resolve_model_path

        path = str(resolve_model_path(a.model))
        peer = ["--dtype", "bfloat16", "--max-model-len", str(a.max_model_len),
                "--enable-prompt-tokens-details"]
        with running_vllm(a.vllm_python, path, peer) as url:
            yield url, VLLM_SERVED_NAME
        return
    args = ["--model", a.model, "--max-model-len", str(a.max_model_len), *CONFIGS[config]]
    if config.endswith("-drafter"):
        if not a.drafter:
            raise SystemExit(f"{config} needs --drafter")
        args += ["--drafter", a.drafter]
    with running_server(args) as url:
        yield url, a.model


def run(a: argparse.Namespace) -> Path:
    """Each shape on each configuration, ``--rounds`` rounds (each server fresh per round):
    seconds, completion tokens per second and the share of prompt tokens served from
    cache, and each configuration's time over the first's."""
    bad = [c for c in a.configs if c not in CONFIGS and c != "vllm-cpu"]
    if bad:
        raise SystemExit(f"unknown configurations {bad}: {', '.join([*CONFIGS, 'vllm-cpu'])}")
    tok = tokenizer(a.model)
    system = system_prompt(tok, a.system_tokens)
    prompts = chat_prompts(tok, 0, a.prompts)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {s: [] for s in SHAPES} for c in a.configs}
    bar = tqdm(total=a.rounds * len(a.configs), desc="servers")
    for _ in range(a.rounds):
        for config in a.configs:
            with server(a, config) as (url, model):
                async def both(url: str = url, model: str = model) -> dict[str, Any]:
                    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
                        warm = {"model": model, "prompt": prompts[0], "max_tokens": 2}
                        (await http.post("/v1/completions", json=warm)).raise_for_status()
                        return {"agentic": await agentic(http, model, a, system),
                                "slime": await slime(http, model, a, prompts)}

                for shape, fig in asyncio.run(both()).items():
                    runs[config][shape].append(fig)
            bar.update()
    bar.close()
    rows = []
    for config in a.configs:
        for shape in SHAPES:
            figs = runs[config][shape]
            row = {"config": config, "shape": shape, "runs": figs,
                   "seconds": statistics.median(f["seconds"] for f in figs),
                   "cached_share": statistics.median(f["cached_share"] for f in figs),
                   "completion_tok_s": statistics.median(f["completion_tok_s"] for f in figs)}
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["shape"] == row["shape"])
        row["speedup_vs_" + base["config"]] = round(base["seconds"] / row["seconds"], 3)
        print(f"{row['shape']:8s} {row['config']:15s} {row['seconds']:8.2f} s  "
              f"{row['completion_tok_s']:7.1f} tok/s  cached {row['cached_share']:.0%}  "
              f"x{row['speedup_vs_' + base['config']]} vs {base['config']}")
    shapes = {"agentic": f"{a.conversations} conversations x {a.turns} turns, system prompt "
                         f"~{a.system_tokens} tokens, {a.max_tokens} new tokens a turn",
              "slime": f"{a.prompts} prompts x {a.samples} separate requests, T = 1, "
                       f"{a.max_tokens} new tokens"}
    return report(a, {"shapes": shapes, "rows": rows}, plot)


def plot(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    configs = list(dict.fromkeys(r["config"] for r in result["rows"]))
    series = {c: {r["shape"]: r["seconds"] for r in result["rows"] if r["config"] == c}
              for c in configs}
    grouped_bars(ax, list(SHAPES), series)
    ax.set_ylabel("seconds (lower is better)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"prefix reuse, {result['machine']} ({result['date']}, {result['commit']})",
                 fontsize=9)
    save(fig, png)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", type=names, default=["native", "native-nocache"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens per request")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (native-auto-drafter)")
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the interpreter of an environment with vLLM (configuration vllm-cpu)")


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "prefix", {"run": (_arguments, run)}, argv)


if __name__ == "__main__":
    main()
