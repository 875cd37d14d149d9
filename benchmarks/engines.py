"""Both own engines and vLLM-CPU side by side on every rollout shape, in one run.

Configurations (``--configs``), each a fresh server per round (or, ``--together``, all up for
the whole run):

  native               the native engine, speculation off (prefix cache on: its default)
  native-nocache       the same with ``--no-prefix-cache`` (what the cache buys, with
                       ``--together`` on seeded requests seconds apart)
  native-auto          the same with ``--speculative auto`` (no drafter: history drafts only)
  native-auto-drafter  ``--speculative auto --drafter D``
  vllm                 ``tlt-serve serve --backend vllm`` (on a CPU: vLLM's compiled path)
  vllm-eager           the same with ``--enforce-eager``
  vllm-cpu             vLLM's own OpenAI server with its defaults (``--vllm-python``)

Shapes, all through the OpenAI routes (the same requests for every server; slime's and the
agentic shape's requests carry seeds under ``--together`` only, the others none: vLLM-CPU
0.32's engine dies on a seeded prompt it chunks):

  batch B   B completions of ``--new-tokens`` tokens at once, EOS ignored, T = 0, one per
            B in ``--batches``: completion tokens per second
  longtail  ``--tail-prompts`` prompts x ``--tail-n`` samples at T = 0, lengths log-normal
            up to ``--tail-max`` tokens, EOS ignored, all at once: makespan
  slime     16 prompts x 8 separate requests at T = 1, all at once (as slime sends a group)
  agentic   8 conversations x 4 turns over a ~600-token system prompt, every turn re-sending
            the history
  epochs    an RL-epoch rollout: ``--epochs`` epochs of ``--epoch-prompts`` arithmetic
            problems x ``--epoch-n`` samples at T = 1 (EOS-terminated, long-tailed), the
            target's weights drifting between epochs (``benchmarks/common/drift.py``): our
            servers load each version by ``/update_weights_from_disk``; vLLM-CPU, which has
            no such route, runs each epoch on a fresh server on its version (its start
            untimed, no other server up): the sum of makespans

Each round runs the configurations in an order rotated by one (the host's speed drifts); a
figure is the median over ``--rounds``, its ratio to the first configuration's beside it.
Fresh servers run one after another, minutes apart, and the host drifts by 10-20% over
minutes: ``--together`` (native configurations only; vLLM's idle engine busy-polls) keeps
every server up and runs each shape on each configuration back to back, so a ratio compares
runs seconds apart. Each server's prefix cache is flushed before each shape, each round sends
prompts of its own (a server drafts from what it served), and the epochs (one round only)
restore the weights after them.

    python -m benchmarks.engines run --drafter D
    python -m benchmarks.engines run --configs native,vllm,vllm-eager --shapes batch --rounds 3
    python -m benchmarks.engines run --configs native,native-auto,native-auto-drafter \
        --drafter D --together --rounds 3
    python -m benchmarks.engines run --configs native,native-nocache --together --rounds 3 \
        --shapes agentic,slime
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks import prefix
from benchmarks.common import load
from benchmarks.common.load import Endpoint, Requests
from benchmarks.common.prompts import chat_prompts, tokenizer
from benchmarks.common.results import ints, names, pyplot, report, save, tool
from benchmarks.common.servers import VLLM_SERVED_NAME, running_server, running_vllm
from benchmarks.rollout import epoch_requests, epoch_workload, load_epoch_weights

CONFIGS = {"native": [], "native-nocache": ["--no-prefix-cache"],
           "native-auto": ["--speculative", "auto"],
           "native-auto-drafter": ["--speculative", "auto"],  # + --drafter
           "vllm": ["--backend", "vllm"], "vllm-eager": ["--backend", "vllm", "--enforce-eager"],
           "vllm-cpu": []}
SHAPES = ("batch", "longtail", "slime", "agentic", "epochs")
# slime's and the agentic shape's sizes (benchmarks/prefix.py's defaults)
PREFIX_SHAPES = argparse.Namespace(conversations=8, turns=4, system_tokens=600, prompts=16,
                                   samples=8, max_tokens=96)


@contextmanager
def server(a: argparse.Namespace, config: str, weights: Path | None = None
           ) -> Iterator[Endpoint]:
    """``config``'s server (vLLM-CPU: on ``weights``, default the model's own)."""
    if config == "vllm-cpu":
        from tlt_serve.models.provision import resolve_model_path

        path = str(weights or resolve_model_path(a.model))
        peer = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
                "--max-num-seqs", str(a.rows), "--enable-prompt-tokens-details"]
        with running_vllm(a.vllm_python, path, peer) as url:
            yield Endpoint(url, "openai", VLLM_SERVED_NAME)
        return
    args = ["--model", a.model, "--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
            "--max-num-seqs", str(a.rows), *CONFIGS[config]]
    if config.endswith("-drafter"):
        args += ["--drafter", a.drafter]
    with running_server(args) as url:
        yield Endpoint(url, "openai", a.model)


def unseeded(reqs: Requests) -> Requests:
    return [(ids, {k: v for k, v in p.items() if k != "sampling_seed"}) for ids, p in reqs]


def rollout(ep: Endpoint, reqs: Requests, label: str) -> dict[str, Any]:
    # (the small-batch phase and timeline load.rollout also returns are not kept)
    stats = asyncio.run(load.rollout(ep, unseeded(reqs), label, 8, 2.0))
    if stats["errors"]:
        raise RuntimeError(f"{label}: {stats['errors']} requests failed")
    return {"seconds": round(stats["makespan_s"], 3), "tokens": stats["tokens"],
            "tok_s": round(stats["tokens"] / stats["makespan_s"], 2)}


def batch(ep: Endpoint, a: argparse.Namespace, config: str, b: int,
          first: int) -> dict[str, Any]:
    """``b`` completions at once, on prompts ``first``.. (each batch size its own)."""
    reqs: Requests = [(ids, {"max_new_tokens": a.new_tokens, "temperature": 0.0,
                             "ignore_eos": True}) for ids in chat_prompts(tokenizer(a.model),
                                                                          first, b)]
    return {f"batch {b}": rollout(ep, reqs, f"{config} batch {b}")}


def longtail(ep: Endpoint, a: argparse.Namespace, config: str, first: int = 1000
             ) -> dict[str, Any]:
    rng = random.Random(a.seed)
    mu = math.log(a.tail_mean) - 0.9**2 / 2
    reqs: Requests = [
        (ids, {"max_new_tokens": int(min(max(rng.lognormvariate(mu, 0.9), 8), a.tail_max)),
               "temperature": 0.0, "ignore_eos": True})
        for ids in chat_prompts(tokenizer(a.model), first, a.tail_prompts)
        for _ in range(a.tail_n)]
    return {"longtail": rollout(ep, reqs, f"{config} long tail")}


def prefix_shapes(ep: Endpoint, a: argparse.Namespace, shapes: list[str],
                  round_: int = 0) -> dict[str, Any]:
    """slime and agentic, as ``benchmarks.prefix`` sends them (round ``round_``'s prompts and
    questions); seeded under ``--together``: unseeded, each server samples answers of other
    lengths at T = 0.7-1, and a turn's length sets how much of it is decoding (servers'
    completion tokens in one round of the agentic shape differed by up to 14%)."""
    tok = tokenizer(a.model)
    system = prefix.system_prompt(tok, PREFIX_SHAPES.system_tokens)
    prompts = chat_prompts(tok, round_ * PREFIX_SHAPES.prompts, PREFIX_SHAPES.prompts)
    questions = round_ * PREFIX_SHAPES.conversations * PREFIX_SHAPES.turns
    seed = a.seed + 10_000 * round_ if a.together else None

    async def both() -> dict[str, Any]:
        out = {}
        async with httpx.AsyncClient(base_url=ep.url, timeout=3600) as http:
            if "slime" in shapes:
                out["slime"] = await prefix.slime(http, ep.model, PREFIX_SHAPES, prompts, seed)
            if "agentic" in shapes:
                out["agentic"] = await prefix.agentic(http, ep.model, PREFIX_SHAPES, system,
                                                      questions, seed)
        return out

    return {s: {"seconds": f["seconds"], "tokens": f["completion_tokens"],
                "tok_s": f["completion_tok_s"], "cached_share": f["cached_share"]}
            for s, f in asyncio.run(both()).items()}


def epochs(ep: Endpoint | None, a: argparse.Namespace, config: str,
           restore: bool = False) -> dict[str, Any]:
    """The epochs' rollouts on drifting weights: ``ep``'s server loads each version (and with
    ``restore`` the model's own after the last); without one (vLLM-CPU: no route to load
    weights) each epoch runs on a fresh server on its version, started after the last one
    stopped (vLLM's idle CPU worker busy-polls: it would slow a server measured beside it)."""
    shape = argparse.Namespace(model=a.model, prompts=a.epoch_prompts, n=a.epoch_n,
                               max_len=a.epoch_max, seed=a.seed, epochs=a.epochs)
    prompts, versions = epoch_workload(shape)
    rows = []
    for e, weights in enumerate(versions):
        reqs = epoch_requests(shape, prompts, e)
        if ep is None:
            with server(a, config, weights) as fresh:
                rows.append(rollout(fresh, reqs, f"{config} epoch {e}"))
            continue
        load_epoch_weights(ep.url, versions, e)
        rows.append(rollout(ep, reqs, f"{config} epoch {e}"))
    if ep is not None and restore:
        httpx.post(f"{ep.url}/update_weights_from_disk", timeout=600, json={
            "model_path": str(versions[0]), "weight_version": "0"}).raise_for_status()
    seconds = sum(r["seconds"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"epochs": {"seconds": round(seconds, 3), "tokens": tokens,
                       "tok_s": round(tokens / seconds, 2),
                       "per_epoch_s": [r["seconds"] for r in rows]}}


# A shape's measurement on a running server: (server, configuration) → {row name: figures}
Measure = Callable[[Endpoint, str], dict[str, Any]]


def measures(a: argparse.Namespace, restore: bool = False, round_: int = 0) -> list[Measure]:
    """The shapes ``a`` asks for, in order, each batch size its own, on round ``round_``'s
    prompts (a server that stays up drafts from its history: a round must not find its
    prompts' answers there); the epochs last (they change the weights; with ``restore`` they
    put the model's own back)."""
    out: list[Measure] = []
    if "batch" in a.shapes:
        def of_size(b: int, first: int) -> Measure:
            return lambda ep, c: batch(ep, a, c, b, first)

        base = round_ * sum(a.batches)
        firsts = [base + sum(a.batches[:i]) for i in range(len(a.batches))]
        out += [of_size(b, f) for b, f in zip(a.batches, firsts, strict=True)]
    if "longtail" in a.shapes:
        out.append(lambda ep, c: longtail(ep, a, c, 1000 + round_ * a.tail_prompts))
    kinds = [s for s in ("slime", "agentic") if s in a.shapes]
    if kinds:
        out.append(lambda ep, c: prefix_shapes(ep, a, kinds, round_))
    if "epochs" in a.shapes:
        out.append(lambda ep, c: epochs(ep, a, c, restore))
    return out


def one_server(a: argparse.Namespace, config: str) -> dict[str, dict[str, Any]]:
    """Every shape on a fresh ``config`` server: {row name: figures}."""
    out: dict[str, dict[str, Any]] = {}
    shapes = measures(a)
    if config == "vllm-cpu" and "epochs" in a.shapes:  # its epochs run on fresh servers
        shapes = shapes[:-1]
    with server(a, config) as ep:
        for measure in shapes:
            out.update(measure(ep, config))
    if config == "vllm-cpu" and "epochs" in a.shapes:
        out.update(epochs(None, a, config))
    return out


def together(a: argparse.Namespace) -> dict[str, list[dict[str, dict[str, Any]]]]:
    """Every configuration's server up for the whole run; each round runs each shape on
    every configuration back to back, in an order rotated per shape and round, each
    server's prefix cache flushed first, each round on prompts of its own (the epochs, in a
    single round only, excepted): {configuration: [round: {row name: figures}]}."""
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {c: [] for c in a.configs}
    with ExitStack() as stack:
        eps = {c: stack.enter_context(server(a, c)) for c in a.configs}
        bar = tqdm(total=a.rounds * len(measures(a)) * len(a.configs), desc="shapes")
        for r in range(a.rounds):
            rnd: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in a.configs}
            for i, measure in enumerate(measures(a, restore=True, round_=r)):
                turn = (r + i) % len(a.configs)
                for config in a.configs[turn:] + a.configs[:turn]:
                    httpx.post(f"{eps[config].url}/flush_cache", timeout=60).raise_for_status()
                    rnd[config].update(measure(eps[config], config))
                    bar.update()
            for config in a.configs:
                runs[config].append(rnd[config])
        bar.close()
    return runs


def check(a: argparse.Namespace) -> None:
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad} (from {', '.join(CONFIGS)})")
    bad = [s for s in a.shapes if s not in SHAPES]
    if bad:
        raise SystemExit(f"--shapes: unknown {bad} (from {', '.join(SHAPES)})")
    if "native-auto-drafter" in a.configs and not a.drafter:
        raise SystemExit("--configs native-auto-drafter: needs --drafter (tlt-train warmup)")
    if a.together and a.rounds > 1 and "epochs" in a.shapes:
        raise SystemExit("--together: the epochs in one round only (their prompts come back, "
                         "and a server that stays up would draft from the last round's)")
    if a.together and any(not c.startswith("native") for c in a.configs):
        raise SystemExit("--together: native configurations only (an idle vLLM engine "
                         "busy-polls and would slow the server measured beside it)")
    if any(c.startswith("vllm") for c in a.configs):
        from tlt_serve.backends import missing

        if why := missing("vllm"):
            raise SystemExit(why)


def run(a: argparse.Namespace) -> Path:
    """Every shape on every configuration, ``--rounds`` rounds: per row (batch size or
    shape) seconds and completion tokens per second, medians over rounds, and each
    configuration's speed over the first's."""
    check(a)
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {c: [] for c in a.configs}
    if a.together:
        runs = together(a)
    else:
        bar = tqdm(total=a.rounds * len(a.configs), desc="servers")
        for r in range(a.rounds):
            turn = r % len(a.configs)
            for config in a.configs[turn:] + a.configs[:turn]:
                runs[config].append(one_server(a, config))
                bar.update()
        bar.close()
    base = a.configs[0]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for config, rounds in runs.items():
        table[config] = {}
        for row in rounds[0]:
            figs = [rnd[row] for rnd in rounds]
            table[config][row] = {"tok_s": statistics.median(f["tok_s"] for f in figs),
                                  "seconds": statistics.median(f["seconds"] for f in figs),
                                  "rounds": figs}
    for rows in table.values():
        for row, fig in rows.items():
            fig["vs_" + base] = round(fig["tok_s"] / table[base][row]["tok_s"], 3)
    header = f"{'':14s}" + "".join(f"{c:>22s}" for c in a.configs)
    print(header)
    for row in table[base]:
        print(f"{row:14s}" + "".join(
            f"{table[c][row]['tok_s']:10.1f} tok/s x{table[c][row]['vs_' + base]:<5.2f}"
            for c in a.configs))
    return report(a, {"base": base, "table": table}, plot)


def plot(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    table, base = result["table"], result["base"]
    rows = list(table[base])
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(rows)), 4.2))
    width = 0.8 / len(table)
    for i, (config, figs) in enumerate(table.items()):
        ax.bar([x + i * width for x in range(len(rows))],
               [figs[r]["vs_" + base] for r in rows], width, label=config)
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], rows, fontsize=8)
    ax.set_ylabel(f"completion tokens/s over {base}'s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"engines side by side (higher is faster)\n{result['machine']} "
                 f"({result['date']}, {result['commit']})", fontsize=9)
    save(fig, png)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", type=names,
                   default=["native", "native-auto", "vllm", "vllm-eager", "vllm-cpu"])
    p.add_argument("--shapes", type=names, default=list(SHAPES))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (native-auto-drafter)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=128, help="sequences resident at once")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--together", action="store_true",
                   help="every server up for the whole run, each shape on each "
                        "configuration back to back (native configurations only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 64, 128])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--tail-prompts", type=int, default=8)
    p.add_argument("--tail-n", type=int, default=8)
    p.add_argument("--tail-mean", type=float, default=160)
    p.add_argument("--tail-max", type=int, default=384)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--epoch-prompts", type=int, default=16)
    p.add_argument("--epoch-n", type=int, default=8)
    p.add_argument("--epoch-max", type=int, default=384, help="most tokens per sample")
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the interpreter of an environment with vLLM (configuration vllm-cpu)")


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "engines", {"run": (_arguments, run)}, argv)


if __name__ == "__main__":
    main()
