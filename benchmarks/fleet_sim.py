"""Sizing a fleet by simulation: rollout makespan with and without tail speculation, and
the replica-seconds left idle for a drafter trainer, for N = 1 ... 64 replicas.

A rollout step sends G sequences at once through a round-robin router to N replicas. Each
replica batches continuously (at most ``max_seqs`` rows); a step at batch b takes t(b), and
while at most ``spec_max_batch`` sequences run it speculates: a step then costs r(b) x t(b)
and moves each sequence 1 + a tokens (a: accepted drafts per verify; fluid model, expected
tokens). Output lengths are drawn from a measured long-tailed rollout. Idle replica-seconds:
the time replicas that finished wait for the last one (what TLT's spot trainer gets).

Two profiles: ``cpu`` takes t(b), a and r(b) from a ``spec_decode`` result measured on this
machine kind (default model, bf16, 2 cores); ``h100`` is a stated assumption for a 7B-class
target on one H100 after the TLT paper (memory-bound decode: t(b) = 20 ms x (1 + b / 256);
tree speculation accepting 3.6 drafts per verify at 1.3x a step's cost, i.e. about 3.5x at
batch 1, in the paper's range; speculation at batch <= 32).

    python -m benchmarks.fleet_sim
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import report

RESULTS = Path(__file__).resolve().parent / "results"


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
    """t(b) = b / plain tokens/s; r(b) from the method's tokens/s and accept length there:
    speculative tokens/s = b (1 + a) / (r t(b))."""
    d = json.loads(path.read_text())
    plain, spec = d["results"]["plain"], d["results"][method]
    step = {int(b): int(b) / v["tokens_per_s"] for b, v in plain.items()}
    accept = {int(b): max(v["accept_length"], 1e-3) for b, v in spec.items()}
    cost = {int(b): int(b) * (1 + spec[b]["accept_length"]) / spec[b]["tokens_per_s"]
            / step[int(b)] for b in spec}
    return Profile("cpu", loglog(step), loglog(accept), loglog(cost), spec_max_batch, 64,
                   f"{path.name} ({method}; {d.get('machine', 'host not recorded')})")


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


def rollout(lengths: list[int], n: int, p: Profile, speculate: bool) -> tuple[float, float]:
    """(makespan, idle replica-seconds) of one rollout round-robin over ``n`` replicas."""
    times = [replica_time(lengths[i::n], p, speculate) for i in range(n)]
    end = max(times)
    return end, sum(end - t for t in times)


def simulate(p: Profile, pool: list[int], sequences: int, ns: list[int], trials: int,
             seed: int) -> list[dict[str, Any]]:
    rows = []
    for n in tqdm(ns, desc=f"fleet_sim ({p.name})"):
        rng = random.Random(seed)
        acc = {"off": [0.0, 0.0], "tail": [0.0, 0.0]}
        for _ in range(trials):
            lengths = [rng.choice(pool) for _ in range(sequences)]
            rng.shuffle(lengths)
            for name, spec in (("off", False), ("tail", True)):
                span, idle = rollout(lengths, n, p, spec)
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


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--sequences", type=int, default=512, help="sequences per rollout step")
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    ap.add_argument("--lengths", default=str(RESULTS / "rollout_ceiling.json"),
                    help="a rollout_load result whose output lengths are drawn from")
    ap.add_argument("--measured", default=str(RESULTS / "spec_decode.json"),
                    help="a spec_decode result: the cpu profile's step times and accept")
    ap.add_argument("--method", default="drafter", help="its speculation method")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "fleet_sim.json"))
    a = ap.parse_args()
    pool = [int(x) for x in json.loads(Path(a.lengths).read_text())["results"]["off"]["lengths"]]
    ns = [int(x) for x in a.replicas.split(",")]
    profiles = [cpu_profile(Path(a.measured), a.method, 8), h100_profile()]
    result: dict[str, Any] = {"benchmark": "fleet_sim", "args": vars(a), "profiles": {}}
    for p in profiles:
        rows = simulate(p, pool, a.sequences, ns, a.trials, a.seed)
        result["profiles"][p.name] = {
            "source": p.source, "spec_max_batch": p.spec_max_batch, "max_seqs": p.max_seqs,
            "step_ms": {b: round(1000 * p.step_s(b), 2) for b in (1, 8, 64)},
            "accept": {b: round(p.accept(b), 3) for b in (1, 8)},
            "verify_cost": {b: round(p.verify_cost(b), 3) for b in (1, 8)},
            "rows": rows,
        }
        print(f"\n{p.name}: {p.source}")
        print(f"{'N':>4} {'off s':>9} {'tail-spec s':>12} {'speedup':>8} {'idle rep-s':>11} "
              f"{'idle %':>7}")
        for r in rows:
            print(f"{r['replicas']:>4} {r['makespan_off_s']:>9.1f} "
                  f"{r['makespan_tail_spec_s']:>12.1f} {r['speedup']:>8.2f} "
                  f"{r['idle_replica_s_off']:>11.1f} {100 * r['idle_fraction_off']:>6.1f}%")
    report.write(result, a.out, plot)


def plot(result: dict[str, Any], png: Path) -> None:
    plt = report.pyplot()
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
    report.save(fig, png)


if __name__ == "__main__":
    main()
