"""End-to-end RL comparison: the same GRPO run (clients/grpo.py, same seeds) against three
rollout servers, one after another in one run:

  (a) off     no speculation;
  (b) static  adaptive speculation with the warm-up drafter, never retrained;
  (c) tlt     adaptive speculation + online drafter training (--train-drafter).

Per step: rollout / train / weight-sync seconds, reward, response lengths, accept length,
drafter versions. Lossless means the reward curves overlap within sampling noise (the
sampled tokens differ between runs — speculation consumes random numbers differently — but
their distribution is the target's). JSON + PNG.

    python -m benchmarks.rl_e2e --drafter ~/.cache/tlt-serve/drafters/smollm2-135m --steps 4
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from benchmarks import report
from benchmarks.serverproc import running_server
from clients.grpo import GrpoConfig, GrpoLoop

CONFIGS = {
    "off": ["--speculative", "off"],
    "static": ["--speculative", "auto"],
    "tlt": ["--speculative", "auto", "--train-drafter"],
}


def run_config(a: argparse.Namespace, name: str) -> list[dict]:
    rows = a.prompts * a.group
    flags = ["--model", a.model, "--dtype", "bfloat16", "--max-num-seqs", str(rows),
             "--max-model-len", "1024", *CONFIGS[name]]
    if name != "off":
        flags += ["--drafter", a.drafter]
    work = Path(a.work) / name
    shutil.rmtree(work, ignore_errors=True)
    if name == "tlt":
        flags += ["--trainer-state-dir", str(work / "trainer"),
                  "--train-max-running", str(a.train_max_running)]
    with running_server(flags) as url:
        cfg = GrpoConfig(server=url, model=a.model, out=str(work), steps=a.steps,
                         prompts=a.prompts, group=a.group, max_new_tokens=a.max_new,
                         lr=a.lr, seed=a.seed, pause_drafter=a.pause_drafter)
        return GrpoLoop(cfg).run()


def plot(results: dict[str, list[dict]], path: Path) -> None:
    plt = report.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, recs in results.items():
        ax.plot([r["step"] for r in recs], [r["reward"] for r in recs], "o-", label=name)
    ax.set(xlabel="RL step", ylabel="mean reward", title="reward (lossless: curves overlap)")
    ax.legend()
    names = list(results)
    bottom = [0.0] * len(names)
    for part in ("rollout_s", "train_s", "sync_s"):
        vals = [statistics.fmean(r[part] for r in results[n]) for n in names]
        ax2.bar(names, vals, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set(ylabel="seconds per RL step (mean)", title="where an RL step's time goes")
    ax2.legend()
    report.save(fig, path)


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--configs", default="off,static,tlt")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-max-running", type=int, default=0,
                    help="tlt: the drafter trains while at most this many requests run")
    ap.add_argument("--pause-drafter", action="store_true",
                    help="the RL loop pauses drafter training during its policy update")
    ap.add_argument("--work", default="/tmp/tlt-rl-e2e")
    ap.add_argument("--out", default="benchmarks/results/rl_e2e.json")
    a = ap.parse_args()
    results = {name: run_config(a, name) for name in a.configs.split(",")}
    summary = {}
    for name, recs in results.items():
        summary[name] = {
            part: round(statistics.fmean(r[part] for r in recs), 2)
            for part in ("rollout_s", "train_s", "sync_s", "reward", "len_mean")
        }
        summary[name]["step_s"] = round(sum(summary[name][p] for p in
                                            ("rollout_s", "train_s", "sync_s")), 2)
        print(name, summary[name])
    base = summary.get("off")
    if base:
        for s in summary.values():
            s["rollout_speedup"] = round(base["rollout_s"] / s["rollout_s"], 3)
            s["step_speedup"] = round(base["step_s"] / s["step_s"], 3)
        print({n: (s["rollout_speedup"], s["step_speedup"]) for n, s in summary.items()})
    out = {"benchmark": "rl_e2e", "args": vars(a), "summary": summary,
           "steps": {n: [{k: v for k, v in r.items() if k != "lengths"} for r in recs]
                     for n, recs in results.items()}}
    report.write(out, a.out, lambda _, png: plot(results, png))


if __name__ == "__main__":
    main()
