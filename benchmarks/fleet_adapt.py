"""One drafter trainer for a fleet, on the default model: replicas behind sglang-router
capture what they serve, ``tlt-train online --fleet`` trains while they are idle and
publishes to all of them, and the next rollout is drafted by the published drafter.

1. ``tlt-serve fleet --replicas R --capture --speculative drafter --drafter D`` where D is a
   freshly initialised drafter (it drafts nothing useful);
2. a task rollout through the router (``--prompts`` x ``--n`` samples at T = 1);
3. ``tlt-train online --fleet ROUTER --init D`` until every replica serves drafter version 1
   (or ``--publish-timeout``), the replicas idle meanwhile;
4. the same rollout again: accept length per replica and the drafter versions the
   responses report, before and after.

    python -m benchmarks.fleet_adapt --replicas 2
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from benchmarks.fleet_rollout import rollout, rollout_parser, start_fleet
from clients.fleet import Fleet
from clients.tasks import make_problems, prompt_ids
from tlt_serve.models.loader import build_model
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer
from tlt_serve.speculative.checkpoint import save_drafter
from tlt_serve.speculative.drafter import DrafterSpec, new_drafter


def fresh_drafter(model_dir: Path, out: Path) -> Path:
    target = build_model(model_dir, torch.float32, 4096, cpu_kernels=False)
    spec = DrafterSpec(draft_vocab_size=0)
    hf = json.loads((model_dir / "config.json").read_text())
    return save_drafter(new_drafter(target, spec, seed=0), out, hf, spec)


def served(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """Per replica: the drafter it serves and its recent accept length."""
    out = {}
    for url in fleet.replicas():
        info = fleet.client(url).drafter_info()
        out[url] = {k: info[k] for k in ("drafter_version", "recent_accept_length",
                                         "recent_verify_steps")}
    return out


def phase(fleet: Fleet, prompts: list[list[int]], a: Any, seed: int) -> dict[str, Any]:
    seconds, groups = rollout(fleet.generate, prompts, a.n, a.max_len, seed)
    versions = sorted({v for g in groups for s in g if s.spec for v in s.spec.drafter_versions})
    return {"seconds": round(seconds, 2), "samples": sum(len(g) for g in groups),
            "drafter_versions_in_responses": versions, "replicas": served(fleet)}


def plot(result: dict[str, Any], png: Path) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    urls = sorted(result["before"]["replicas"])
    x = range(len(urls))
    for off, name in ((-0.2, "before"), (0.2, "after")):
        ax.bar([i + off for i in x],
               [result[name]["replicas"][u]["recent_accept_length"] for u in urls], 0.4,
               label=f"{name} (drafter v{result[name]['drafter_versions_in_responses']})")
    ax.set_xticks(list(x), [f"replica {i}" for i in x])
    ax.set_ylabel("accepted drafts / verify")
    ax.set_title(f"fleet trainer: first publish after {result['publish_s']} s")
    ax.legend()
    report.save(fig, png)


def main() -> None:
    p = rollout_parser(__doc__, "benchmarks/results/fleet_adapt.json")
    p.add_argument("--publish-timeout", type=float, default=900.0)
    a = p.parse_args()
    model_dir = resolve_model_path("smollm2-135m")
    prompts = prompt_ids(load_tokenizer(model_dir), make_problems(a.prompts, a.seed))
    with tempfile.TemporaryDirectory(prefix="fleet-adapt-") as tmp:
        drafter = fresh_drafter(model_dir, Path(tmp) / "init")
        flags = ["--dtype", "bfloat16", "--max-num-seqs", str(a.prompts * a.n), "--capture",
                 "--speculative", "drafter", "--drafter", str(drafter)]
        proc, url = start_fleet(a.replicas, flags)
        trainer = None
        try:
            with Fleet(url) as fleet:
                before = phase(fleet, prompts, a, a.seed)
                print(f"before: {before}", flush=True)
                log = open(Path(tmp) / "trainer.log", "w")  # noqa: SIM115 - closed below
                trainer = subprocess.Popen(
                    [sys.executable, "-m", "trainer", "online", "--fleet", url, "--state-dir",
                     str(Path(tmp) / "state"), "--init", str(drafter)],
                    stdout=log, stderr=subprocess.STDOUT)
                t0 = time.perf_counter()
                while any(r["drafter_version"] != 1 for r in served(fleet).values()):
                    if time.perf_counter() - t0 > a.publish_timeout or trainer.poll() is not None:
                        raise RuntimeError("no drafter published: "
                                           + (Path(tmp) / "trainer.log").read_text()[-2000:])
                    time.sleep(1.0)
                publish_s = round(time.perf_counter() - t0, 1)
                trainer.send_signal(signal.SIGTERM)
                trainer.wait(120)
                log.close()
                lent = [line.split("training on cores ", 1)[1].strip()
                        for line in (Path(tmp) / "trainer.log").read_text().splitlines()
                        if "training on cores" in line]
                after = phase(fleet, prompts, a, a.seed)
                print(f"after ({publish_s} s to publish): {after}", flush=True)
        finally:
            if trainer is not None and trainer.poll() is None:
                trainer.kill()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
    result = {"replicas": a.replicas, "samples": a.prompts * a.n, "max_len": a.max_len,
              "publish_s": publish_s, "cores_lent": lent, "before": before, "after": after}
    report.write(result, a.out, plot)


if __name__ == "__main__":
    main()
