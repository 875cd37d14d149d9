"""A real rollout through a fleet on this machine: one replica on all cores vs replicas
behind sglang-router, a weight update through ``clients.Fleet``, and a replica SIGKILLed
mid-rollout.

The same task rollout (``--prompts`` arithmetic problems x ``--n`` samples at T = 1,
long-tailed by EOS, one request per prompt, all at once) runs on:

1. ``tlt-serve serve`` on every core this process may use (one replica);
2. ``tlt-serve fleet --replicas R`` (the cores split between them) through the router.

On the fleet it then updates the weights to the next drift version (``benchmarks/drift.py``)
through ``Fleet`` and checks every replica serves it; then runs the rollout again and kills
one replica with SIGKILL while it has requests: every prompt must come back once, whole,
and the replica must rejoin on the fleet's weight version.

    python -m benchmarks.fleet_rollout --replicas 2
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks import report
from benchmarks.drift import DriftConfig, version_dirs
from benchmarks.serverproc import running_server
from clients.client import Client
from clients.fleet import Fleet
from clients.results import Sample
from clients.tasks import make_problems, prompt_ids
from tlt_serve.fleet.router_proc import free_port
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer


def rollout(send: Any, prompts: list[list[int]], n: int, max_len: int,
            seed: int) -> tuple[float, list[list[Sample]]]:
    params = {"max_new_tokens": max_len, "temperature": 1.0}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        groups = list(pool.map(
            lambda ip: send([ip[1]], n, sampling_seed=seed * 1000 + ip[0] * n, **params)[0],
            enumerate(prompts)))
    return time.perf_counter() - t0, groups


def summary(seconds: float, groups: list[list[Sample]]) -> dict[str, Any]:
    tokens = sum(len(s.token_ids) for g in groups for s in g)
    return {"seconds": round(seconds, 2), "samples": sum(len(g) for g in groups),
            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def start_fleet(replicas: int, flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_serve", "fleet", "--replicas", str(replicas), "--port",
         str(port), *flags], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("tlt-serve fleet ready"):
            # Drain the rest: the router logs to this pipe, and blocks once it is full.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"tlt-serve fleet exited with {proc.wait()}")


def replica_pid(launcher: int, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if f"--port {port}" in cmd:
            return int(pid)
    raise RuntimeError(f"no replica process for {url}")


def running(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/v1/loads", timeout=2).json()["loads"][0]["num_reqs"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def on_fleet(a: Any, prompts: list[list[int]], flags: list[str],
             new_weights: Path) -> dict[str, Any]:
    proc, url = start_fleet(a.replicas, flags)
    out: dict[str, Any] = {}
    try:
        with Fleet(url) as fleet:
            rollout(fleet.generate, prompts[:2], a.n, 16, a.seed)  # warm-up
            out["rollout"] = summary(*rollout(fleet.generate, prompts, a.n, a.max_len, a.seed))
            t0 = time.perf_counter()
            version = fleet.update_weights_from_disk(str(new_weights), weight_version="1")
            out["weight_update"] = {
                "seconds": round(time.perf_counter() - t0, 2), "version": version,
                "replicas": {u: fleet.client(u).weight_version() for u in fleet.replicas()}}
            victim = fleet.replicas()[0]
            with ThreadPoolExecutor(1) as pool:
                job = pool.submit(rollout, fleet.generate, prompts, a.n, a.max_len, a.seed + 1)
                while running(victim) == 0 and not job.done():
                    time.sleep(0.01)
                killed_with = running(victim)
                os.kill(replica_pid(proc.pid, victim), signal.SIGKILL)
                seconds, groups = job.result()
            t0 = time.perf_counter()
            while len(fleet.replicas()) < a.replicas:
                time.sleep(0.5)
            out["kill"] = {
                **summary(seconds, groups), "victim": victim, "running_when_killed": killed_with,
                "groups": len(groups), "groups_of_n": sum(len(g) == a.n for g in groups),
                "rejoined_after_s": round(time.perf_counter() - t0, 1),
                "versions_after": {u: fleet.client(u).weight_version()
                                   for u in fleet.replicas()}}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    return out


def plot(result: dict[str, Any], png: Path) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [f"1 replica x {result['cores']} cores",
             f"{result['replicas']} replicas x {result['cores'] // result['replicas']} core(s)"]
    tps = [result["one"]["tokens_per_s"], result["fleet"]["rollout"]["tokens_per_s"]]
    ax.bar(names, tps, color=["#888", "#2a7"])
    ax.set_ylabel("tokens / s (rollout)")
    ax.set_title(f"{result['samples']} samples, T=1, max {result['max_len']} tokens")
    report.save(fig, png)


def rollout_parser(doc: str | None, out: str) -> argparse.ArgumentParser:
    """The fleet benchmarks' rollout: replicas, prompts x n samples, length, seed, output."""
    p = report.parser(doc)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out)
    return p


def main() -> None:
    p = rollout_parser(__doc__, "benchmarks/results/fleet_rollout.json")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    tok = load_tokenizer(resolve_model_path("smollm2-135m"))
    prompts = prompt_ids(tok, make_problems(a.prompts, a.seed))
    new_weights = version_dirs(DriftConfig(versions=2))[1]
    cores = len(os.sched_getaffinity(0))
    flags = ["--dtype", a.dtype, "--max-num-seqs", str(a.prompts * a.n)]
    with running_server(flags) as url, Client(url) as one:
        rollout(one.generate, prompts[:2], a.n, 16, a.seed)  # warm-up
        single = summary(*rollout(one.generate, prompts, a.n, a.max_len, a.seed))
    fleet = on_fleet(a, prompts, flags, new_weights)
    result = {"replicas": a.replicas, "cores": cores, "samples": a.prompts * a.n,
              "max_len": a.max_len, "dtype": a.dtype, "one": single, "fleet": fleet,
              "fleet_over_one": round(fleet["rollout"]["tokens_per_s"]
                                      / single["tokens_per_s"], 3)}
    print(f"1 x {cores} cores: {single['tokens_per_s']} tok/s; {a.replicas} replicas: "
          f"{fleet['rollout']['tokens_per_s']} tok/s (x{result['fleet_over_one']})")
    print(f"weight update: {fleet['weight_update']}")
    print(f"kill: {fleet['kill']}")
    report.write(result, a.out, plot)


if __name__ == "__main__":
    main()
