"""Adaptation benchmark: does the online drafter keep up with a target that keeps changing?

Target versions v0..v{K-1} really drift (``benchmarks/drift.py``: the default model
fine-tuned stage after stage on the arithmetic task, each stage in a new answer style).
One real server (``--train-drafter``, speculating with a drafter at every batch size) serves
them in order, as an RL run would: for each version ``--phases`` rollout phases (``--prompts``
fresh task prompts, greedy, all at once); between phases an idle gap of ``--gap-seconds`` (the
RL policy update; ``benchmarks/grpo_step.py`` measures one on this machine) in which the
co-located trainer trains as much as it can; a new version arrives by
``/update_weights_from_disk``.

Accept length per phase, three drafters, on the phase's own served sequences:
  (a) static: the warm-up drafter, never updated;
  (b) adaptive: what the server served (online figure from the responses, plus the offline
      measure of the published checkpoint that served the phase);
  (c) reference: a drafter trained offline to convergence on that version
      (``adaptation_reference.py``).

    python -m benchmarks.adaptation --drafter ~/.cache/tlt-serve/drafters/smollm2-135m

Stages cache their results under ``--work``; ``--stage report`` redraws from them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks import report
from benchmarks.adaptation_reference import (
    accept_on,
    as_samples,
    reference_drafter,
    version_stub,
)
from benchmarks.drift import DriftConfig, version_dirs
from benchmarks.serverproc import running_server
from clients.tasks import make_problems, prompt_ids, reward
from tlt_serve.engine.capture import decode_samples, encode_samples
from tlt_serve.models.provision import default_cache_dir
from tlt_serve.models.tokenizer import load_tokenizer
from trainer.train import TrainConfig

DEPTH = 4


@dataclass(frozen=True)
class Args:
    drafter: Path
    work: Path
    versions: int
    phases: int
    prompts: int
    max_new: int
    gap_seconds: float
    ref_prompts: int
    ref_steps: int
    spec_max_batch: int
    out: Path


def phase_prompts(tok: Any, version: int, phase: int, n: int) -> tuple[list, list[list[int]]]:
    problems = make_problems(n, seed=100_000 + 100 * version + phase)
    return problems, prompt_ids(tok, problems)


# ---- (c): offline references -------------------------------------------------------------
def references(a: Args, dirs: list[Path]) -> list[dict]:
    tok = load_tokenizer(dirs[0])
    out = []
    for k, d in enumerate(dirs):
        prompts = prompt_ids(tok, make_problems(a.ref_prompts, seed=200_000 + k))
        cfg = TrainConfig(steps=a.ref_steps, batch_tokens=1024, row_len=512, eval_every=50)
        print(f"reference drafter for v{k}")
        out.append(reference_drafter(d, a.drafter, a.work / "ref" / f"v{k}", prompts,
                                     a.max_new, cfg, DEPTH, seed=k))
    return out


# ---- (b): the adaptive server ------------------------------------------------------------
async def rollout(http: httpx.AsyncClient, prompts: list[list[int]], max_new: int) -> list[dict]:
    params = {"max_new_tokens": max_new, "temperature": 0}

    async def one(ids: list[int]) -> dict:
        resp = await http.post("/generate", json={"input_ids": ids, "sampling_params": params})
        resp.raise_for_status()
        return dict(resp.json())

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def pull(http: httpx.AsyncClient, after: int) -> tuple[bytes, int, int]:
    """Every sample captured after ``after``: (blob, count, new cursor)."""
    samples = []
    while True:
        resp = await http.get("/drafter/samples", params={"after": after, "max_bytes": 64 << 20})
        resp.raise_for_status()
        page = decode_samples(resp.content)
        if not page:
            return encode_samples(samples), len(samples), after
        samples += page
        after = page[-1].seq


async def trainer_step(http: httpx.AsyncClient) -> tuple[int, int | None, str]:
    info = (await http.get("/get_drafter_info")).json()
    rep = info["training"]["trainer"] or {}
    return int(rep.get("step", 0)), info["drafter_version"], str(rep.get("state", "none"))


async def idle_gap(http: httpx.AsyncClient, seconds: float) -> dict:
    """Stay idle for ``seconds`` (the policy update), then report what the trainer did."""
    t0 = time.monotonic()
    start, _, _ = await trainer_step(http)
    await asyncio.sleep(seconds)
    step, version, state = await trainer_step(http)
    return {"seconds": round(time.monotonic() - t0, 1), "trainer_steps": step - start,
            "drafter_version": version, "trainer_state": state}


async def adaptive(a: Args, dirs: list[Path], url: str) -> list[dict]:
    tok = load_tokenizer(dirs[0])
    phases: list[dict] = []
    cursor = 0
    bar = tqdm(total=len(dirs) * a.phases, desc="rollout phases")
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        for k, d in enumerate(dirs):
            if k:
                body = {"model_path": str(d), "weight_version": f"v{k}"}
                (await http.post("/update_weights_from_disk", json=body)).raise_for_status()
            for i in range(a.phases):
                problems, prompts = phase_prompts(tok, k, i, a.prompts)
                t0 = time.monotonic()
                outs = await rollout(http, prompts, a.max_new)
                seconds = time.monotonic() - t0
                blob, count, cursor = await pull(http, cursor)
                name = f"v{k}-p{i}.safetensors"
                (a.work / "phases").mkdir(parents=True, exist_ok=True)
                (a.work / "phases" / name).write_bytes(blob)
                metas = [o["meta_info"] for o in outs]
                verify = sum(m.get("spec_verify_ct", 0) for m in metas)
                accepted = sum(m.get("spec_accept_length", 0) * m.get("spec_verify_ct", 0)
                               for m in metas)
                versions = sorted({v for m in metas for v in m.get("drafter_versions", [])})
                phases.append({
                    "version": k, "phase": i, "samples": name, "captured": count,
                    "seconds": round(seconds, 1),
                    "tokens": sum(m["completion_tokens"] for m in metas),
                    "reward": sum(reward(p, o["text"]) for p, o in zip(problems, outs,
                                                                       strict=True)) / len(outs),
                    "online_accept": accepted / max(verify, 1), "verify_steps": verify,
                    "drafter_versions": versions,
                    "gap": await idle_gap(http, a.gap_seconds),
                })
                bar.update(1)
                p = phases[-1]
                bar.write(f"v{k} phase {i}: online accept {p['online_accept']:.3f} with drafter "
                          f"{versions}, reward {p['reward']:.2f}, gap {p['gap']}")
    bar.close()
    return phases


def run_adaptive(a: Args, dirs: list[Path]) -> list[dict]:
    state = a.work / "trainer"
    shutil.rmtree(state, ignore_errors=True)  # a fresh trainer (it would resume a checkpoint)
    server = ["--model", str(dirs[0]), "--dtype", "bfloat16", "--max-model-len", "1024",
              "--max-num-seqs", str(a.prompts), "--spec-max-batch", str(a.spec_max_batch),
              "--speculative", "drafter", "--drafter", str(a.drafter),
              "--num-draft-tokens", str(DEPTH), "--train-drafter",
              "--trainer-state-dir", str(state), "--capture-sample-rate", "1.0"]
    with running_server(server) as url:
        return asyncio.run(adaptive(a, dirs, url))


# ---- evaluation + report -----------------------------------------------------------------
def evaluate(a: Args, dirs: list[Path], phases: list[dict]) -> list[dict]:
    rows = []
    # The drafter serving a phase: what drafted in it, else (a phase that never speculated)
    # what the previous gap left serving.
    serving = {id(p): p["drafter_versions"][-1] if p["drafter_versions"]
               else (phases[i - 1]["gap"]["drafter_version"] if i else None)
               for i, p in enumerate(phases)}
    for k, d in enumerate(tqdm(dirs, desc="offline accept")):
        stub = version_stub(d)
        for p in (p for p in phases if p["version"] == k):
            samples = as_samples(decode_samples((a.work / "phases" / p["samples"]).read_bytes()))
            served = serving[id(p)]
            pub = a.work / "trainer" / "published" / f"v{served}"
            row = {**p,
                   "static": accept_on(a.drafter, stub, samples, DEPTH).accept_length,
                   "reference": accept_on(a.work / "ref" / f"v{k}", stub, samples,
                                          DEPTH).accept_length}
            drafter = pub if pub.is_dir() else a.drafter
            row["adaptive_offline"] = accept_on(drafter, stub, samples, DEPTH).accept_length
            row["serving_drafter"] = served
            rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = report.pyplot()
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(x, [r["static"] for r in rows], "o-", label="(a) static warm-up drafter")
    served = [r["online_accept"] if r["verify_steps"] else float("nan") for r in rows]
    ax.plot(x, served, "s-", label="(b) adaptive, served (tail steps only)")
    ax.plot(x, [r["adaptive_offline"] for r in rows], "s:", alpha=0.6,
            label="(b) adaptive, offline measure")
    ax.plot(x, [r["reference"] for r in rows], "^--", label="(c) offline-converged per version")
    for r_i, r in enumerate(rows):
        if r["phase"] == 0:
            ax.axvline(r_i - 0.5, color="grey", lw=0.6)
            ax.text(r_i - 0.4, ax.get_ylim()[1] * 0.02, f"v{r['version']}", color="grey")
    ax.set_xticks(x, [f"v{r['version']}.{r['phase']}" for r in rows], fontsize=7)
    ax.set_xlabel("rollout phase (target version . phase)")
    ax.set_ylabel(f"accept length (depth {DEPTH}, excl. bonus)")
    ax.set_title("Drafter accept length across drifting target versions")
    ax.legend(fontsize=8)
    report.save(fig, path)


def summary(rows: list[dict]) -> dict:
    """Adaptive vs reference and vs static accept, on the offline measure (the same for all
    three drafters; the served figure averages over the chains the engine happened to start,
    see docs/PERFORMANCE.md)."""
    second = [r for r in rows if r["phase"] == 1]
    last = [r for r in rows if r["version"] == rows[-1]["version"]]

    def ratio(num: str, den: str, rs: list[dict]) -> float:
        return round(sum(r[num] for r in rs) / max(sum(r[den] for r in rs), 1e-9), 3)

    return {
        "second_phase_adaptive_over_reference": [
            ratio("adaptive_offline", "reference", [r]) for r in second],
        "last_version_adaptive_over_static": ratio("adaptive_offline", "static", last),
        "last_version_adaptive_over_static_served": ratio("online_accept", "static", last),
    }


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--drafter", default=str(default_cache_dir() / "drafters" / "smollm2-135m"))
    ap.add_argument("--work", default=str(default_cache_dir() / "adaptation"))
    ap.add_argument("--stage", default="all",
                    choices=["all", "reference", "adaptive", "report", "plot"])
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--phases", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=96, help="sequences per rollout phase")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--gap-seconds", type=float, default=100.0,
                    help="idle gap after each phase, the RL policy update: one GRPO update of "
                         "96 sequences x 50 tokens took 107-109 s here "
                         "(python -m benchmarks.grpo_step --seqs 96 --tokens 50)")
    ap.add_argument("--ref-prompts", type=int, default=96)
    ap.add_argument("--ref-steps", type=int, default=200)
    ap.add_argument("--spec-max-batch", type=int, default=8,
                    help="the server speculates (and reports accept length) in the tail only")
    ap.add_argument("--out", default="benchmarks/results/adaptation.json")
    n = ap.parse_args()
    a = Args(Path(n.drafter).expanduser(), Path(n.work).expanduser(), n.versions, n.phases,
             n.prompts, n.max_new, n.gap_seconds, n.ref_prompts, n.ref_steps,
             n.spec_max_batch, Path(n.out))
    a.work.mkdir(parents=True, exist_ok=True)
    dirs = version_dirs(DriftConfig(versions=a.versions))
    if n.stage in ("all", "reference"):
        refs = references(a, dirs)
        (a.work / "references.json").write_text(json.dumps(refs, indent=2))
    if n.stage in ("all", "adaptive"):
        phases = run_adaptive(a, dirs)
        (a.work / "phases.json").write_text(json.dumps(phases, indent=2))
    if n.stage == "plot":  # redraw from the result JSON
        plot(json.loads(a.out.read_text())["phases"], a.out.with_suffix(".png"))
    if n.stage in ("all", "report"):
        phases = json.loads((a.work / "phases.json").read_text())
        rows = evaluate(a, dirs, phases)
        result = {"benchmark": "adaptation", "args": {k: str(v) for k, v in vars(n).items()},
                  "references": json.loads((a.work / "references.json").read_text()),
                  "phases": rows, "summary": summary(rows)}
        for r in rows:
            print(f"v{r['version']}.{r['phase']}: static {r['static']:.3f}  adaptive "
                  f"{r['adaptive_offline']:.3f} (served {r['online_accept']:.3f} over "
                  f"{r['verify_steps']} verify steps)  reference {r['reference']:.3f}  "
                  f"drafter v{r['serving_drafter']}")
        print(json.dumps(result["summary"]))
        report.write(result, a.out, lambda res, png: plot(res["phases"], png))


if __name__ == "__main__":
    main()
