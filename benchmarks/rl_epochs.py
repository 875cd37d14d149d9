"""RL-shaped rollouts over several epochs: the same prompts every epoch, n samples each, the
target's weights changing between epochs; speculation configurations side by side.

Per configuration one server lives through every epoch (its history of the prompts is what
suffix drafting feeds on). Epoch e (from 0) first loads drift version e (``benchmarks/drift.py``:
the default model fine-tuned stage after stage, each stage writing differently, as RL steps
do) through ``/update_weights_from_disk``, then sends all ``--prompts`` x ``--n`` samples at
once (arithmetic problems, T = 1, EOS-terminated: long-tailed lengths),
one request per sample as RL frameworks send them. Per epoch: makespan, the small-batch phase
(at most ``--spec-max-batch`` running, where the engine speculates) and the makespan speedup
it caps if it took no time (``ceiling_free``), accept length (accepted drafts per verify step;
verify steps run only in that phase) and each configuration's makespan speedup over ``off``.

Configurations: off | ngram | suffix | suffix-tree | auto (suffix drafts, plus the drafter
when ``--drafter`` is given, chosen per step) on the native engine, all servers up at once and
each epoch run config after config in a rotating order; ``NAME@vllm`` the same on the vLLM
backend (run with the python of an environment with vLLM; ``suffix@vllm`` is vLLM's suffix
decoding, arctic-inference), each alone after them.

    python -m benchmarks.rl_epochs --configs off,ngram,suffix,auto
    /path/to/vllm-env/bin/python -m benchmarks.rl_epochs \\
        --configs off,ngram,suffix,auto,off@vllm,ngram@vllm
"""

from __future__ import annotations

import argparse
import asyncio
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks import report
from benchmarks.drift import DriftConfig, version_dirs
from benchmarks.rollout_load import rollout_mode, split_config
from benchmarks.serverproc import running_server
from clients.tasks import make_problems, prompt_ids
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer

FLAGS = {
    "off": ["--speculative", "off"],
    "ngram": ["--speculative", "ngram"],
    "suffix": ["--speculative", "suffix", "--num-draft-tokens", "8"],
    "suffix-tree": ["--speculative", "suffix", "--num-draft-tokens", "8", "--tree-topk", "4",
                    "--verify-budget", "16"],
    "auto": ["--speculative", "auto"],
}


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """The rollouts' shape: model, prompts x n, epochs, sample length, seed."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512, help="most tokens per sample")
    p.add_argument("--seed", type=int, default=0)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    workload_arguments(p)
    p.add_argument("--configs", default="off,ngram,suffix,auto")
    p.add_argument("--drafter", default=None, help="drafter checkpoint for auto")
    p.add_argument("--spec-max-batch", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/rl_epochs.json")
    a = p.parse_args(argv)
    # What rollout_load's rollout mode reads.
    a.dialect, a.served_model, a.bin_s = "sglang", None, 1.0
    return a


def server_flags(a: argparse.Namespace, config: str) -> list[str]:
    name, backend = split_config(config)
    flags = [*FLAGS[name], "--model", a.model, "--dtype", a.dtype, "--backend", backend,
             "--max-num-seqs", str(a.prompts * a.n), "--spec-max-batch", str(a.spec_max_batch),
             "--max-model-len", str(a.max_len + 256)]
    if name == "auto" and a.drafter:
        flags += ["--drafter", a.drafter]
    return flags


def epoch_requests(a: argparse.Namespace, prompts: list[list[int]], epoch: int) -> list:
    """Every sample of an epoch, each with its own seed (new samples every epoch)."""
    return [(ids, {"max_new_tokens": a.max_len, "temperature": 1.0,
                   "sampling_seed": (a.seed + epoch * 7919) * 100_003 + i * a.n + j})
            for i, ids in enumerate(prompts) for j in range(a.n)]


def workload(a: argparse.Namespace) -> tuple[list[list[int]], list[Path]]:
    """The task prompts' token ids and each epoch's weights (drift versions)."""
    tok = load_tokenizer(resolve_model_path(a.model))
    prompts = [list(p) for p in prompt_ids(tok, make_problems(a.prompts, a.seed))]
    return prompts, version_dirs(DriftConfig(model=a.model, versions=a.epochs))


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
    stats = asyncio.run(rollout_mode(url, a, epoch_requests(a, prompts, e), f"{config} e{e}"))
    keep = ("makespan_s", "small_batch_s", "ceiling_free", "ceiling_2x", "tok_s", "tokens",
            "errors", "accept_length")
    row = {"epoch": e, **{k: stats.get(k) for k in keep}, "timeline": stats["timeline"]}
    print(f"{config} epoch {e}: makespan {row['makespan_s']} s, small-batch "
          f"{row['small_batch_s']} s, ceiling_free {row['ceiling_free']}, "
          f"accept {row['accept_length']}, errors {row['errors']}", flush=True)
    return row


def run_native(a: argparse.Namespace, configs: list[str], prompts: list[list[int]],
               versions: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Every native configuration's server up at once (idle ones take no CPU); each epoch
    runs them one after another, in an order rotated every epoch, so that a machine whose
    speed drifts does not favour one."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    if not configs:
        return runs
    with ExitStack() as stack:
        urls = {c: stack.enter_context(running_server(server_flags(a, c))) for c in configs}
        for e in range(a.epochs):
            for c in configs[e % len(configs):] + configs[: e % len(configs)]:
                runs[c].append(run_epoch(a, c, urls[c], prompts, versions, e))
    return runs


def run_alone(a: argparse.Namespace, config: str, prompts: list[list[int]],
              versions: list[Path]) -> list[dict[str, Any]]:
    """A vLLM-backed configuration, alone on the machine (vLLM's CPU worker busy-polls
    while idle: it would slow whatever runs beside it)."""
    with running_server(server_flags(a, config)) as url:
        return [run_epoch(a, config, url, prompts, versions, e) for e in range(a.epochs)]


def plot(result: dict[str, Any], png: Path) -> None:
    plt = report.pyplot()
    runs = result["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for config, epochs in runs.items():
        xs = [r["epoch"] for r in epochs]
        ax1.plot(xs, [r["makespan_s"] or float("nan") for r in epochs], marker="o",
                 label=config)
        ax2.plot(xs, [r["accept_length"] or 0 for r in epochs], marker="o", label=config)
    ax1.set(xlabel="epoch (weights drift between epochs)", ylabel="rollout makespan (s)",
            title="makespan per epoch")
    ax2.set(xlabel="epoch", ylabel="accepted drafts per verify",
            title="accept length (small-batch phase)")
    ax1.legend()
    fig.suptitle(f"{result['args']['prompts']} prompts x n={result['args']['n']}, "
                 f"{result['machine']}, {result['date']}", fontsize=8)
    report.save(fig, png)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    prompts, versions = workload(a)
    configs = a.configs.split(",")
    native = [c for c in configs if split_config(c)[1] == "native"]
    runs = run_native(a, native, prompts, versions)
    for c in configs:
        if c not in runs:
            runs[c] = run_alone(a, c, prompts, versions)
    table: dict[str, Any] = {}
    base = runs.get("off")
    for c, epochs in runs.items():
        table[c] = [{k: r[k] for k in r if k != "timeline"} for r in epochs]
        if base:
            for row, ref in zip(table[c], base, strict=True):
                if row["makespan_s"] and ref["makespan_s"]:
                    row["speedup_vs_off"] = round(ref["makespan_s"] / row["makespan_s"], 3)
    for c, rows in table.items():
        print(c, [(r["epoch"], r["makespan_s"] and round(r["makespan_s"], 1),
                   r.get("speedup_vs_off"), r["accept_length"] and round(r["accept_length"], 2))
                  for r in rows])
    args = {k: v for k, v in vars(a).items() if isinstance(v, (int, float, str, type(None)))}
    report.write({"benchmark": "rl_epochs", "args": args, "table": table, "runs": runs},
                 a.out, plot)


if __name__ == "__main__":
    main()
