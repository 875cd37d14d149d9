"""Fleets: replicas behind sglang-router on this machine, one drafter trainer for all of them,
and sizing a fleet by simulation.

  rollout  one replica on all cores vs ``tlt-serve fleet --replicas R`` (the cores split)
           on the same task rollout; a weight update through ``clients.Fleet``; a replica
           SIGKILLed mid-rollout
  adapt    ``tlt-train online --fleet`` trains a fresh drafter on what the replicas captured
           and publishes it to all of them: accept length before and after
  sim      rollout makespan with and without tail speculation, and the replica-seconds
           left idle, for N = 1 ... 64 replicas (a model fed with measured profiles)

The task rollout: ``--prompts`` arithmetic problems x ``--n`` samples at T = 1, long-tailed
by EOS, one request per prompt, all at once.

    python -m benchmarks.fleet rollout --replicas 2
    python -m benchmarks.fleet adapt --replicas 2
    python -m benchmarks.fleet sim
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common.drift import DriftConfig, version_dirs
from benchmarks.common.prompts import tokenizer
from benchmarks.common.results import RESULTS, grouped_bars, ints, pyplot, report, save, tool
from benchmarks.common.servers import START_TIMEOUT_S, free_port, running_server

# ---- a fleet on this machine --------------------------------------------------------------


def task_prompts(a: argparse.Namespace) -> list[list[int]]:
    from clients.tasks import make_problems, prompt_ids

    return prompt_ids(tokenizer(a.model), make_problems(a.prompts, a.seed))


def timed_rollout(send: Callable[..., Any], prompts: list[list[int]], n: int, max_len: int,
                  seed: int) -> tuple[float, list[list[Any]]]:
    """Every prompt's group of ``n`` samples through ``send`` (``Client.generate`` or
    ``Fleet.generate``), all prompts at once: (seconds, groups)."""
    params = {"max_new_tokens": max_len, "temperature": 1.0}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        groups = list(pool.map(
            lambda ip: send([ip[1]], n, sampling_seed=seed * 1000 + ip[0] * n, **params)[0],
            enumerate(prompts)))
    return time.perf_counter() - t0, groups


def summary(seconds: float, groups: list[list[Any]]) -> dict[str, Any]:
    tokens = sum(len(s.token_ids) for g in groups for s in g)
    return {"seconds": round(seconds, 2), "samples": sum(len(g) for g in groups),
            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


@contextmanager
def running_fleet(replicas: int, flags: list[str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """``tlt-serve fleet --replicas R *flags`` until the ``with`` block ends: the launcher
    process and the router's URL, once the fleet reports ready."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tlt_serve", "fleet", "--replicas", str(replicas), "--port",
         str(port), *flags], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("tlt-serve fleet ready"):
                # Drain the rest: the router logs to this pipe, and blocks once it is full.
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                break
        else:
            raise RuntimeError(f"tlt-serve fleet exited with {proc.wait()}")
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)


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


def rejoined(fleet: Any, victim: str, replicas: int) -> bool:
    """Whether the fleet has ``replicas`` again and ``victim`` among them answers (the router
    may list a killed replica until its health check fails)."""
    if len(fleet.replicas()) < replicas or victim not in fleet.replicas():
        return False
    try:
        from clients.results import ServerError

        fleet.client(victim).weight_version()
    except (httpx.HTTPError, ServerError):
        return False
    return True


def kill_one(proc: subprocess.Popen, fleet: Any, a: argparse.Namespace,
             prompts: list[list[int]]) -> dict[str, Any]:
    """The rollout again, one replica SIGKILLed while it has requests: every prompt must come
    back once, whole, and the replica rejoin on the fleet's weight version."""
    victim = fleet.replicas()[0]
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(timed_rollout, fleet.generate, prompts, a.n, a.max_len, a.seed + 1)
        while running(victim) == 0 and not job.done():
            time.sleep(0.01)
        killed_with = running(victim)
        os.kill(replica_pid(proc.pid, victim), signal.SIGKILL)
        seconds, groups = job.result()
    t0 = time.perf_counter()
    while not rejoined(fleet, victim, a.replicas):
        if time.perf_counter() - t0 > START_TIMEOUT_S:
            raise RuntimeError(f"{victim} did not rejoin")
        time.sleep(0.5)
    return {**summary(seconds, groups), "victim": victim, "running_when_killed": killed_with,
            "groups": len(groups), "groups_of_n": sum(len(g) == a.n for g in groups),
            "rejoined_after_s": round(time.perf_counter() - t0, 1),
            "versions_after": {u: fleet.client(u).weight_version() for u in fleet.replicas()}}


def rollout(a: argparse.Namespace) -> Path:
    """A real rollout through a fleet on this machine. The same task rollout runs on one
    ``tlt-serve serve`` on every core this process may use, then on ``tlt-serve fleet
    --replicas R`` (the cores split between them) through the router. On the fleet it then
    updates the weights to drift version 1 through ``Fleet`` and checks every replica serves
    it; then runs the rollout again and kills one replica with SIGKILL while it has
    requests: every prompt must come back once, whole, and the replica must rejoin on the
    fleet's weight version."""
    from clients.client import Client
    from clients.fleet import Fleet

    prompts = task_prompts(a)
    new_weights = version_dirs(DriftConfig(model=a.model, versions=2))[1]
    flags = ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(a.prompts * a.n)]
    with running_server(flags) as url, Client(url) as one:
        timed_rollout(one.generate, prompts[:2], a.n, 16, a.seed)  # warm-up
        single = summary(*timed_rollout(one.generate, prompts, a.n, a.max_len, a.seed))
    with running_fleet(a.replicas, flags) as (proc, url), Fleet(url) as fleet:
        timed_rollout(fleet.generate, prompts[:2], a.n, 16, a.seed)  # warm-up
        on_fleet = summary(*timed_rollout(fleet.generate, prompts, a.n, a.max_len, a.seed))
        t0 = time.perf_counter()
        version = fleet.update_weights_from_disk(str(new_weights), weight_version="1")
        update = {"seconds": round(time.perf_counter() - t0, 2), "version": version,
                  "replicas": {u: fleet.client(u).weight_version() for u in fleet.replicas()}}
        killed = kill_one(proc, fleet, a, prompts)
    ratio = round(on_fleet["tokens_per_s"] / single["tokens_per_s"], 3)
    print(f"1 replica: {single['tokens_per_s']} tok/s; {a.replicas} replicas: "
          f"{on_fleet['tokens_per_s']} tok/s (x{ratio})\nweight update: {update}\n"
          f"kill: {killed}")
    return report(a, {"cores": len(os.sched_getaffinity(0)), "one": single,
                      "fleet": {"rollout": on_fleet, "weight_update": update,
                                "kill": killed},
                      "fleet_over_one": ratio}, plot_rollout)


def plot_rollout(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    args, cores = result["args"], result["cores"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([f"1 replica x {cores} cores",
            f"{args['replicas']} replicas x {cores // args['replicas']} core(s)"],
           [result["one"]["tokens_per_s"], result["fleet"]["rollout"]["tokens_per_s"]],
           color=["#888", "#2a7"])
    ax.set_ylabel("tokens / s (rollout)")
    ax.set_title(f"{args['prompts'] * args['n']} samples, T=1, max {args['max_len']} tokens")
    save(fig, png)


def _fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The fleet's rollout: model, replicas, prompts x n samples, length, seed."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


# ---- adapt --------------------------------------------------------------------------------


def fresh_drafter(model_dir: Path, out: Path) -> Path:
    import torch

    from tlt_serve.models.loader import build_model
    from tlt_serve.speculative.checkpoint import save_drafter
    from tlt_serve.speculative.drafter import DrafterSpec, new_drafter

    target = build_model(model_dir, torch.float32, 4096, cpu_kernels=False)
    spec = DrafterSpec(draft_vocab_size=0)
    hf = json.loads((model_dir / "config.json").read_text())
    return save_drafter(new_drafter(target, spec, seed=0), out, hf, spec)


def served(fleet: Any) -> dict[str, dict[str, Any]]:
    """Per replica: the drafter it serves and its recent accept length."""
    out = {}
    for url in fleet.replicas():
        info = fleet.client(url).drafter_info()
        out[url] = {k: info[k] for k in ("drafter_version", "recent_accept_length",
                                         "recent_verify_steps")}
    return out


def phase(fleet: Any, prompts: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    seconds, groups = timed_rollout(fleet.generate, prompts, a.n, a.max_len, a.seed)
    versions = sorted({v for g in groups for s in g if s.spec for v in s.spec.drafter_versions})
    return {"seconds": round(seconds, 2), "samples": sum(len(g) for g in groups),
            "drafter_versions_in_responses": versions, "replicas": served(fleet)}


def publish(fleet: Any, url: str, drafter: Path, tmp: Path, timeout: float) -> dict[str, Any]:
    """``tlt-train online --fleet`` from ``drafter`` until every replica serves drafter
    version 1 (the replicas idle meanwhile): seconds until then, and the cores it was lent."""
    log_path = tmp / "trainer.log"
    with open(log_path, "w") as log:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "trainer", "online", "--fleet", url, "--state-dir",
             str(tmp / "state"), "--init", str(drafter)], stdout=log, stderr=subprocess.STDOUT)
        try:
            t0 = time.perf_counter()
            while any(r["drafter_version"] != 1 for r in served(fleet).values()):
                if time.perf_counter() - t0 > timeout or trainer.poll() is not None:
                    raise RuntimeError(f"no drafter published: {log_path.read_text()[-2000:]}")
                time.sleep(1.0)
            seconds = round(time.perf_counter() - t0, 1)
            trainer.send_signal(signal.SIGTERM)
            trainer.wait(120)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    lent = [line.split("training on cores ", 1)[1].strip()
            for line in log_path.read_text().splitlines() if "training on cores" in line]
    return {"publish_s": seconds, "cores_lent": lent}


def adapt(a: argparse.Namespace) -> Path:
    """One drafter trainer for a whole fleet: accept length before and after its first publish.
    ``tlt-serve fleet --replicas R --capture --speculative drafter --drafter D`` where D is a
    freshly initialised drafter (it drafts nothing useful); a task rollout through the router;
    ``tlt-train online --fleet ROUTER --init D`` until every replica serves drafter version 1
    (or ``--publish-timeout``), the replicas idle meanwhile; the same rollout again. Accept
    length per replica and the drafter versions the responses report, before and after."""
    from clients.fleet import Fleet
    from tlt_serve.models.provision import resolve_model_path

    prompts = task_prompts(a)
    with tempfile.TemporaryDirectory(prefix="fleet-adapt-") as tmp:
        drafter = fresh_drafter(resolve_model_path(a.model), Path(tmp) / "init")
        flags = ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs",
                 str(a.prompts * a.n), "--capture", "--speculative", "drafter", "--drafter",
                 str(drafter)]
        with running_fleet(a.replicas, flags) as (_, url), Fleet(url) as fleet:
            before = phase(fleet, prompts, a)
            print(f"before: {before}", flush=True)
            published = publish(fleet, url, drafter, Path(tmp), a.publish_timeout)
            after = phase(fleet, prompts, a)
            print(f"after ({published['publish_s']} s to publish): {after}", flush=True)
    return report(a, {**published, "before": before, "after": after}, plot_adapt)


def plot_adapt(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    urls = sorted(result["before"]["replicas"])
    grouped_bars(ax, urls, {
        f"{name} (drafter v{result[name]['drafter_versions_in_responses']})":
        {u: r["recent_accept_length"] for u, r in result[name]["replicas"].items()}
        for name in ("before", "after")}, [f"replica {i}" for i in range(len(urls))])
    ax.set_ylabel("accepted drafts / verify")
    ax.set_title(f"fleet trainer: first publish after {result['publish_s']} s")
    ax.legend()
    save(fig, png)


def _adapt_arguments(p: argparse.ArgumentParser) -> None:
    _fleet_arguments(p)
    p.add_argument("--publish-timeout", type=float, default=900.0)


# ---- sim ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    name: str
    step_s: Callable[[int], float]  # seconds of one decode step at batch b
    accept: Callable[[int], float]  # accepted drafts per verify at batch b
    verify_cost: Callable[[int], float]  # a verify step's time / a plain step's, at batch b
    spec_max_batch: int
    max_seqs: int
    source: str


def loglog(points: dict[int, float]) -> Callable[[int], float]:
    """Piecewise-linear interpolation in log-log space, flat beyond the ends."""
    xs = sorted(points)
    lx = [math.log(x) for x in xs]
    ly = [math.log(points[x]) for x in xs]

    def f(b: int) -> float:
        x = math.log(max(b, 1))
        if x <= lx[0]:
            return math.exp(ly[0])
        if x >= lx[-1]:
            return math.exp(ly[-1])
        i = bisect.bisect_right(lx, x) - 1
        w = (x - lx[i]) / (lx[i + 1] - lx[i])
        return math.exp(ly[i] + w * (ly[i + 1] - ly[i]))

    return f


def cpu_profile(path: Path, method: str, spec_max_batch: int) -> Profile:
    """From a ``decode offline`` result: t(b) = b / plain tokens/s; r(b) from the method's
    tokens/s and accept length there: speculative tokens/s = b (1 + a) / (r t(b))."""
    d = json.loads(path.read_text())
    plain, spec = d["results"]["off"], d["results"][method]
    step = {int(b): int(b) / v["tokens_per_s"] for b, v in plain.items()}
    accept = {int(b): max(v["accept_length"] or 0.0, 1e-3) for b, v in spec.items()}
    cost = {int(b): int(b) * (1 + accept[int(b)]) / spec[b]["tokens_per_s"] / step[int(b)]
            for b in spec}
    return Profile("cpu", loglog(step), loglog(accept), loglog(cost), spec_max_batch, 64,
                   f"{path.name} ({method}; {d.get('machine', 'host not recorded')})")


def device_profile(path: Path, shape: str, k: int, accept: float, spec_max_batch: int,
                   max_seqs: int) -> Profile:
    """From a ``profile steps`` result: t(b) = a plain step of ``shape`` at batch b (from its
    CUDA graph where measured), r(b) = a verify step of depth ``k`` / a plain step; the
    accepted drafts per verify are not measured there: ``accept`` is assumed."""
    d = json.loads(path.read_text())
    if shape not in d["shapes"]:
        raise SystemExit(f"{path}: no shape {shape!r} (it has {', '.join(d['shapes'])})")
    rows = d["shapes"][shape]["rows"]
    mode = "graph_ms" if all("graph_ms" in r for r in rows) else "eager_ms"
    plain = {r["batch"]: r[mode] / 1000 for r in rows if r["k"] == 0}
    cost = {r["batch"]: r[mode] / 1000 / plain[r["batch"]] for r in rows if r["k"] == k}
    if not cost:
        raise SystemExit(f"{path}: no verify steps of k = {k} for {shape}")
    return Profile(d["device"].replace(" ", "-").lower(), loglog(plain), lambda b: accept,
                   loglog(cost), spec_max_batch, max_seqs,
                   f"{path.name} ({shape}, k = {k}, {mode.split('_')[0]}; {d['device']}, "
                   f"{d['date']}; accept {accept} drafts per verify assumed)")


def h100_profile() -> Profile:
    return Profile("h100", lambda b: 0.020 * (1 + b / 256), lambda b: 3.6, lambda b: 1.3,
                   32, 256, "assumed after the TLT paper (7B-class target, one H100)")


def replica_time(lengths: list[int], p: Profile, speculate: bool) -> float:
    """Seconds for one replica to finish ``lengths`` (continuous batching, fluid tokens)."""
    queue = sorted(lengths, reverse=True)  # longest first, as they arrive together
    left: list[float] = []
    t = 0.0
    while queue or left:
        while queue and len(left) < p.max_seqs:
            left.append(float(queue.pop()))
        b = len(left)
        spec = speculate and b <= p.spec_max_batch
        per = 1 + p.accept(b) if spec else 1.0
        dt = p.step_s(b) * (p.verify_cost(b) if spec else 1.0)
        steps = max(1, math.ceil(min(left) / per - 1e-9))  # until the next one finishes
        t += steps * dt
        left = [x - steps * per for x in left if x - steps * per > 1e-9]
    return t


def simulated_rollout(lengths: list[int], n: int, p: Profile,
                      speculate: bool) -> tuple[float, float]:
    """(makespan, idle replica-seconds) of one rollout round-robin over ``n`` replicas."""
    times = [replica_time(lengths[i::n], p, speculate) for i in range(n)]
    end = max(times)
    return end, sum(end - t for t in times)


def simulate(p: Profile, pool: list[int], sequences: int, ns: list[int], trials: int,
             seed: int) -> list[dict[str, Any]]:
    rows = []
    for n in tqdm(ns, desc=f"fleet sim ({p.name})"):
        rng = random.Random(seed)
        acc = {"off": [0.0, 0.0], "tail": [0.0, 0.0]}
        for _ in range(trials):
            lengths = [rng.choice(pool) for _ in range(sequences)]
            rng.shuffle(lengths)
            for name, spec in (("off", False), ("tail", True)):
                span, idle = simulated_rollout(lengths, n, p, spec)
                acc[name][0] += span / trials
                acc[name][1] += idle / trials
        rows.append({
            "replicas": n,
            "makespan_off_s": round(acc["off"][0], 3),
            "makespan_tail_spec_s": round(acc["tail"][0], 3),
            "speedup": round(acc["off"][0] / acc["tail"][0], 3),
            "idle_replica_s_off": round(acc["off"][1], 3),
            "idle_fraction_off": round(acc["off"][1] / (n * acc["off"][0]), 3),
            "idle_replica_s_tail_spec": round(acc["tail"][1], 3),
        })
    return rows


def sim(a: argparse.Namespace) -> Path:
    """Sizing a fleet by simulation. A rollout step sends G sequences at once through a
    round-robin router to N replicas. Each replica batches continuously (at most
    ``max_seqs`` rows); a step at batch b takes t(b), and while at most ``spec_max_batch``
    sequences run it speculates: a step then costs r(b) x t(b) and moves each sequence
    1 + a tokens (a: accepted drafts per verify; fluid model, expected tokens). Output
    lengths are drawn from a measured long-tailed rollout (``--lengths``). Idle
    replica-seconds: the time replicas that finished wait for the last one (what TLT's spot
    trainer gets). Two profiles: ``cpu`` takes t(b), a and r(b) from a ``decode offline``
    result measured on this machine kind (``--measured``); ``h100`` is a stated assumption
    for a 7B-class target on one H100 after the TLT paper (memory-bound decode: t(b) = 20 ms
    x (1 + b / 256); tree speculation accepting 3.6 drafts per verify at 1.3x a step's cost,
    i.e. about 3.5x at batch 1, in the paper's range; speculation at batch <= 32). With
    ``--profile`` (a ``profile steps`` result measured on a GPU) the second profile takes
    t(b) and r(b) from it instead, for one model shape and verify depth; its accept length
    stays an assumption (``--profile-accept``)."""
    for path, how in ((a.lengths, "python -m benchmarks.rollout load"),
                      (a.measured, "python -m benchmarks.decode offline --drafter D")):
        if not Path(path).is_file():
            raise SystemExit(f"{path}: no such result; measure it first ({how})")
    pool = [int(x) for x in json.loads(Path(a.lengths).read_text())["results"]["off"]["lengths"]]
    profiles: dict[str, Any] = {}
    device = (device_profile(Path(a.profile), a.profile_shape, a.profile_k, a.profile_accept,
                             32, 256) if a.profile else h100_profile())
    for p in (cpu_profile(Path(a.measured), a.method, 8), device):
        rows = simulate(p, pool, a.sequences, a.replicas, a.trials, a.seed)
        profiles[p.name] = {
            "source": p.source, "spec_max_batch": p.spec_max_batch, "max_seqs": p.max_seqs,
            "step_ms": {b: round(1000 * p.step_s(b), 2) for b in (1, 8, 64)},
            "accept": {b: round(p.accept(b), 3) for b in (1, 8)},
            "verify_cost": {b: round(p.verify_cost(b), 3) for b in (1, 8)},
            "rows": rows,
        }
        print(f"\n{p.name}: {p.source}\n{'N':>4} {'off s':>9} {'tail-spec s':>12} "
              f"{'speedup':>8} {'idle rep-s':>11} {'idle %':>7}")
        for r in rows:
            print(f"{r['replicas']:>4} {r['makespan_off_s']:>9.1f} "
                  f"{r['makespan_tail_spec_s']:>12.1f} {r['speedup']:>8.2f} "
                  f"{r['idle_replica_s_off']:>11.1f} {100 * r['idle_fraction_off']:>6.1f}%")
    return report(a, {"profiles": profiles}, plot_sim)


def plot_sim(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, prof in result["profiles"].items():
        ns = [r["replicas"] for r in prof["rows"]]
        ax1.plot(ns, [r["speedup"] for r in prof["rows"]], marker="o", label=name)
        ax2.plot(ns, [100 * r["idle_fraction_off"] for r in prof["rows"]], marker="o",
                 label=name)
    for ax, title in ((ax1, "makespan speedup of tail speculation"),
                      (ax2, "idle replica time without it (% of N x makespan)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title, fontsize=10)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['args']['sequences']} sequences per rollout "
                 f"({result['machine']}, {result['date']})", fontsize=9)
    save(fig, png)


def _sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=int, default=512, help="sequences per rollout step")
    p.add_argument("--replicas", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--lengths", default=str(RESULTS / "rollout_load.json"),
                   help="a `rollout load` result whose output lengths (of off) are drawn from")
    p.add_argument("--measured", default=str(RESULTS / "decode_offline.json"),
                   help="a `decode offline` result: the cpu profile's step times and accept")
    p.add_argument("--method", default="drafter", help="its speculation method")
    p.add_argument("--profile", default=None, metavar="JSON",
                   help="a `profile steps` result measured on a GPU: its step and verify "
                   "costs replace the assumed H100 figures")
    p.add_argument("--profile-shape", default="8b", help="the profile's model shape")
    p.add_argument("--profile-k", type=int, default=4, help="the verify depth it takes")
    p.add_argument("--profile-accept", type=float, default=3.6,
                   help="accepted drafts per verify assumed with the profile")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "fleet", {
        "rollout": (_fleet_arguments, rollout),
        "adapt": (_adapt_arguments, adapt),
        "sim": (_sim_arguments, sim),
    }, argv)


if __name__ == "__main__":
    main()
