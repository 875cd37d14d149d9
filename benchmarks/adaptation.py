"""Online drafter adaptation: does the drafter keep up with a target that keeps changing, what
does adapting cost serving, and how good are drafters on prompts none trained on.

  drift   build the drifting target versions (the default model fine-tuned stage after stage
          on the arithmetic task, each stage in a new answer style)
  run     one server with ``--train-drafter`` serving the versions in order, as an RL run
          would: accept length per rollout phase of the static, the adaptive and a converged
          reference drafter
  cost    capture and the idle trainer under full load: tokens/s against the same server
          without them
  yield   how fast the trainer gets out of the way when a request arrives
  accept  offline accept of drafters on the benchmark prompts (chat / reasoning / code)

Accept length: accepted drafts per chain of ``--depth`` greedy drafts, bonus token excluded.

    python -m benchmarks.adaptation drift --versions 4
    python -m benchmarks.adaptation run --drafter ~/.cache/tlt-serve/drafters/smollm2-135m
    python -m benchmarks.adaptation cost --drafter D [--backend vllm --tag vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import load
from benchmarks.common.drift import DriftConfig, version_dirs
from benchmarks.common.load import Endpoint
from benchmarks.common.prompts import KINDS, chat_prompts, kind_of, tokenizer, varied_requests
from benchmarks.common.results import grouped_bars, names, pyplot, report, save, tool
from benchmarks.common.servers import running_server
from benchmarks.common.timing import pct
from clients.results import spec_verifies

DEPTH = 4
MAX_POSITIONS = 4096


def _default_dir(*parts: str) -> str:
    from tlt_serve.models.provision import default_cache_dir

    return str(default_cache_dir().joinpath(*parts))


# ---- offline accept and the converged references ------------------------------------------


def version_stub(model_dir: Path) -> Any:
    """The fp32 embedding / norm / head of a target version (bf16-rounded, as served)."""
    import torch

    from tlt_serve.models.loader import build_model
    from trainer.target import head_target

    model = build_model(model_dir, torch.bfloat16, 1, cpu_kernels=False)
    return head_target(model, MAX_POSITIONS)


def accept_on(drafter_dir: Path, stub: Any, samples: Sequence[Any], depth: int = DEPTH) -> Any:
    """Offline accept (``AcceptStats``) of a drafter on token sequences with their target
    features: greedy chains of ``depth`` drafts from every response position (the engine's
    ``num_accepted``; on greedily generated sequences exactly what greedy verification with
    that drafter accepts), and the walk greedy serving takes."""
    from tlt_serve.speculative.checkpoint import load_drafter
    from trainer.evaluate import offline_accept, prepare_heldout
    from trainer.packing import batches

    drafter = load_drafter(drafter_dir, stub)
    held = prepare_heldout(drafter, batches(samples, 512, 2, None))
    return offline_accept(drafter, held, depth)


def answered(model_dir: Path, prompts: list[list[int]], max_new: int,
             dtype: str = "bfloat16") -> tuple[list[Any], list[list[int]], Any]:
    """The target's greedy answers to ``prompts`` as training samples (with their
    teacher-forced features), the answers, and the target."""
    from tlt_serve import LLM, SamplingParams
    from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig
    from trainer.data import make_samples, target_features

    max_len = max(len(p) for p in prompts) + max_new + 1
    llm = LLM(config=EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=max_len),
        cache=CacheConfig(max_num_seqs=min(len(prompts), 64))))
    res = llm.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0),
                       use_tqdm=True)
    responses = [r.samples[0].token_ids for r in res]
    target = llm.engine.model
    del llm
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    return make_samples(prompts, responses, target_features(target, seqs, 4096)), responses, target


def reference_drafter(model_dir: Path, warm: Path, out: Path, prompts: list[list[int]],
                      max_new: int, steps: int, seed: int) -> dict[str, Any]:
    """(c) for one target version: the warm-up drafter trained offline until its held-out
    accept stops rising, on that version's own greedy answers to task prompts the rollout
    phases never use (the best a drafter of this size does on that version). Cached in
    ``out``; returns its report."""
    from tlt_serve.speculative.checkpoint import load_drafter, save_drafter
    from trainer.evaluate import offline_accept, prepare_heldout
    from trainer.packing import batches
    from trainer.target import head_target
    from trainer.train import TrainConfig, train

    report_path = out / "reference.json"
    cfg = TrainConfig(steps=steps, batch_tokens=1024, row_len=512, eval_every=50)
    key = {"model": str(model_dir), "warm": str(warm), "prompts": len(prompts),
           "max_new": max_new, "steps": cfg.steps, "lr": cfg.lr, "seed": seed}
    if report_path.is_file() and (cached := json.loads(report_path.read_text()))["key"] == key:
        return dict(cached)
    t0 = time.perf_counter()
    heldout_n = max(len(prompts) // 8, 4)
    samples, responses, target = answered(model_dir, prompts, max_new)
    stub = head_target(target, MAX_POSITIONS)
    del target
    n_train = len(samples) - heldout_n
    drafter = load_drafter(warm, stub).train().requires_grad_(True)  # head already refreshed
    held = prepare_heldout(drafter, batches(samples[n_train:], 512, 2, None))
    before = offline_accept(drafter, held, DEPTH)
    hist = train(drafter, samples[:n_train], held, cfg, seed)
    after = offline_accept(drafter, held, DEPTH)
    save_drafter(drafter, out, json.loads((model_dir / "config.json").read_text()),
                 drafter.spec)
    made = {
        "key": key,
        "seconds": round(time.perf_counter() - t0, 1),
        "train_response_tokens": sum(len(r) for r in responses[:n_train]),
        "heldout_accept_before": before.as_dict(),
        "heldout_accept_after": after.as_dict(),
        "heldout_top1_curve": [[s, round(a, 4)] for s, a in hist.evals],
        "final_loss": round(sum(hist.loss[-20:]) / min(len(hist.loss), 20), 4),
    }
    report_path.write_text(json.dumps(made, indent=2))
    return made


# ---- drift --------------------------------------------------------------------------------


def drift(a: argparse.Namespace) -> list[Path]:
    """Build the drifting target versions (cached; prints their directories, writes no result).
    Version 0 is the base model, version k is version k-1 after ``--steps`` supervised steps on
    the arithmetic task in solution style k-1. Like successive RL steps, every version changes
    what the target writes, here on purpose enough that a drafter fitted to the previous
    version falls behind."""
    cfg = DriftConfig(model=a.model, versions=a.versions, steps=a.steps, lr=a.lr,
                      out=a.drift_dir)
    dirs = version_dirs(cfg)
    for k, path in enumerate(dirs):
        print(f"v{k}: {path}")
    return dirs


def _drift_arguments(p: argparse.ArgumentParser) -> None:
    d = DriftConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--versions", type=int, default=d.versions)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--drift-dir", default="", help="where the versions go (default: "
                   "<cache>/drift/<model>)")


# ---- run ----------------------------------------------------------------------------------


def phase_prompts(tok: Any, version: int, phase: int, n: int) -> tuple[list, list[list[int]]]:
    from clients.tasks import make_problems, prompt_ids

    problems = make_problems(n, seed=100_000 + 100 * version + phase)
    return problems, prompt_ids(tok, problems)


async def pull(http: httpx.AsyncClient, after: int) -> tuple[bytes, int, int]:
    """Every sample captured after ``after``: (blob, count, new cursor)."""
    from tlt_serve.engine.capture import decode_samples, encode_samples

    samples: list[Any] = []
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


async def idle_gap(http: httpx.AsyncClient, seconds: float) -> dict[str, Any]:
    """Stay idle for ``seconds`` (the policy update), then report what the trainer did."""
    t0 = time.monotonic()
    start, _, _ = await trainer_step(http)
    await asyncio.sleep(seconds)
    step, version, state = await trainer_step(http)
    return {"seconds": round(time.monotonic() - t0, 1), "trainer_steps": step - start,
            "drafter_version": version, "trainer_state": state}


async def adaptive_phases(a: argparse.Namespace, dirs: list[Path], url: str) -> list[dict]:
    """Every version's rollout phases against the adaptive server, each phase's captured
    samples saved under ``<work>/phases``."""
    from clients.tasks import reward

    tok = tokenizer(str(dirs[0]))
    phases: list[dict[str, Any]] = []
    cursor = 0
    (a.work / "phases").mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(dirs) * a.phases, desc="rollout phases")
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        for k, d in enumerate(dirs):
            if k:
                body = {"model_path": str(d), "weight_version": f"v{k}"}
                (await http.post("/update_weights_from_disk", json=body)).raise_for_status()
            for i in range(a.phases):
                problems, prompts = phase_prompts(tok, k, i, a.prompts)
                t0 = time.monotonic()
                params = {"max_new_tokens": a.max_new, "temperature": 0}
                outs = await load.generate_all(url, [(p, params) for p in prompts], f"v{k}.{i}")
                seconds = time.monotonic() - t0
                blob, count, cursor = await pull(http, cursor)
                name = f"v{k}-p{i}.safetensors"
                (a.work / "phases" / name).write_bytes(blob)
                metas = [o["meta_info"] for o in outs]
                counts = [spec_verifies(m) for m in metas]
                verify = sum(steps for steps, _ in counts)
                accepted = sum(took for _, took in counts)
                versions = sorted({v for m in metas for v in m.get("drafter_versions", [])})
                phases.append({
                    "version": k, "phase": i, "samples": name, "captured": count,
                    "seconds": round(seconds, 1),
                    "tokens": sum(m["completion_tokens"] for m in metas),
                    "reward": statistics.fmean(reward(p, o["text"])
                                               for p, o in zip(problems, outs, strict=True)),
                    "online_accept": accepted / max(verify, 1), "verify_steps": verify,
                    "drafter_versions": versions,
                    "gap": await idle_gap(http, a.gap_seconds),
                })
                bar.update(1)
                bar.write(f"v{k} phase {i}: online accept {accepted / max(verify, 1):.3f} with "
                          f"drafter {versions}, gap {phases[-1]['gap']}")
    bar.close()
    return phases


def evaluate(a: argparse.Namespace, dirs: list[Path], phases: list[dict]) -> list[dict]:
    """Offline accept of (a) static, (b) adaptive (the published checkpoint that served the
    phase) and (c) reference on every phase's own served sequences."""
    from tlt_serve.engine.capture import decode_samples
    from trainer.data import Sample

    rows = []
    # The drafter serving a phase: what drafted in it, else (a phase that never speculated)
    # what the previous gap left serving.
    serving = [p["drafter_versions"][-1] if p["drafter_versions"]
               else (phases[i - 1]["gap"]["drafter_version"] if i else None)
               for i, p in enumerate(phases)]
    for k, d in enumerate(tqdm(dirs, desc="offline accept")):
        stub = version_stub(d)
        for p, served in zip(phases, serving, strict=True):
            if p["version"] != k:
                continue
            blob = (a.work / "phases" / p["samples"]).read_bytes()
            samples = [Sample(s.tokens, s.features, s.prompt_len) for s in decode_samples(blob)]
            pub = a.work / "trainer" / "published" / f"v{served}"
            rows.append({**p, "serving_drafter": served,
                         "static": accept_on(a.drafter, stub, samples).accept_length,
                         "reference": accept_on(a.work / "ref" / f"v{k}", stub,
                                                samples).accept_length,
                         "adaptive_offline": accept_on(pub if pub.is_dir() else a.drafter, stub,
                                                       samples).accept_length})
    return rows


def summary(rows: list[dict]) -> dict[str, Any]:
    """Adaptive vs reference and vs static accept, on the offline measure (the same for all
    three drafters; the served figure averages over the chains the engine happened to
    start)."""
    last = [r for r in rows if r["version"] == rows[-1]["version"]]

    def ratio(num: str, den: str, rs: list[dict]) -> float:
        return round(sum(r[num] for r in rs) / max(sum(r[den] for r in rs), 1e-9), 3)

    return {
        "second_phase_adaptive_over_reference": [
            ratio("adaptive_offline", "reference", [r]) for r in rows if r["phase"] == 1],
        "last_version_adaptive_over_static": ratio("adaptive_offline", "static", last),
        "last_version_adaptive_over_static_served": ratio("online_accept", "static", last),
    }


def run(a: argparse.Namespace) -> Path | None:
    """Does the online drafter keep up with a target that keeps changing? The drift
    versions v0..v{K-1} really drift. One real server (``--train-drafter``, speculating with
    a drafter while at most ``--spec-max-batch`` sequences run) serves them in order, as an
    RL run would: per version ``--phases`` rollout phases (``--prompts`` fresh task prompts,
    greedy, all at once); after each phase an idle gap of ``--gap-seconds`` (the RL policy
    update; ``rollout grpo-step`` measures one here) in which the co-located trainer trains
    as much as it can; a new version arrives by ``/update_weights_from_disk``. Accept length
    per phase, on the phase's own served sequences, of (a) static: the warm-up drafter,
    never updated; (b) adaptive: what the server served (online, from the responses, and
    the offline measure of the published checkpoint that served the phase); (c) reference:
    a drafter trained offline to convergence on that version. Stages cache their results
    under ``--work``; ``--stage report`` evaluates from them, ``--stage plot`` redraws."""
    a.drafter, a.work = Path(a.drafter).expanduser(), Path(a.work).expanduser()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.stage == "plot":
        plot_run(json.loads(a.out.read_text()), a.out.with_suffix(".png"))
        return a.out
    dirs = version_dirs(DriftConfig(model=a.model, versions=a.versions))
    if a.stage in ("all", "reference"):
        tok = tokenizer(str(dirs[0]))
        refs = [reference_drafter(d, a.drafter, a.work / "ref" / f"v{k}",
                                  _ref_prompts(tok, k, a.ref_prompts),
                                  a.max_new, a.ref_steps, seed=k)
                for k, d in enumerate(dirs)]
        (a.work / "references.json").write_text(json.dumps(refs, indent=2))
    if a.stage in ("all", "adaptive"):
        state = a.work / "trainer"
        shutil.rmtree(state, ignore_errors=True)  # a fresh trainer (it would resume)
        flags = ["--model", str(dirs[0]), "--dtype", "bfloat16", "--max-model-len", "1024",
                 "--max-num-seqs", str(a.prompts), "--spec-max-batch", str(a.spec_max_batch),
                 "--speculative", "drafter", "--drafter", str(a.drafter),
                 "--num-draft-tokens", str(DEPTH), "--train-drafter",
                 "--trainer-state-dir", str(state), "--capture-sample-rate", "1.0"]
        with running_server(flags) as url:
            phases = asyncio.run(adaptive_phases(a, dirs, url))
        (a.work / "phases.json").write_text(json.dumps(phases, indent=2))
    if a.stage not in ("all", "report"):
        return None
    rows = evaluate(a, dirs, json.loads((a.work / "phases.json").read_text()))
    for r in rows:
        print(f"v{r['version']}.{r['phase']}: static {r['static']:.3f}  adaptive "
              f"{r['adaptive_offline']:.3f} (served {r['online_accept']:.3f} over "
              f"{r['verify_steps']} verify steps)  reference {r['reference']:.3f}  "
              f"drafter v{r['serving_drafter']}")
    return report(a, {"references": json.loads((a.work / "references.json").read_text()),
                      "phases": rows, "summary": summary(rows)}, plot_run)


def _ref_prompts(tok: Any, k: int, n: int) -> list[list[int]]:
    """Task prompts for version k's reference drafter, none of them a rollout phase's."""
    from clients.tasks import make_problems, prompt_ids

    return prompt_ids(tok, make_problems(n, seed=200_000 + k))


def plot_run(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["phases"]
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(x, [r["static"] for r in rows], "o-", label="(a) static warm-up drafter")
    served = [r["online_accept"] if r["verify_steps"] else float("nan") for r in rows]
    ax.plot(x, served, "s-", label="(b) adaptive, served (tail steps only)")
    ax.plot(x, [r["adaptive_offline"] for r in rows], "s:", alpha=0.6,
            label="(b) adaptive, offline measure")
    ax.plot(x, [r["reference"] for r in rows], "^--", label="(c) offline-converged per version")
    for i, r in enumerate(rows):
        if r["phase"] == 0:
            ax.axvline(i - 0.5, color="grey", lw=0.6)
            ax.text(i - 0.4, ax.get_ylim()[1] * 0.02, f"v{r['version']}", color="grey")
    ax.set_xticks(x, [f"v{r['version']}.{r['phase']}" for r in rows], fontsize=7)
    ax.set(xlabel="rollout phase (target version . phase)",
           ylabel=f"accept length (depth {DEPTH}, excl. bonus)",
           title="Drafter accept length across drifting target versions")
    ax.legend(fontsize=8)
    save(fig, path)


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="version 0 of the drift")
    p.add_argument("--drafter", default=_default_dir("drafters", "smollm2-135m"))
    p.add_argument("--work", default=_default_dir("adaptation"))
    p.add_argument("--stage", default="all",
                   choices=["all", "reference", "adaptive", "report", "plot"])
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--phases", type=int, default=2)
    p.add_argument("--prompts", type=int, default=96, help="sequences per rollout phase")
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--gap-seconds", type=float, default=100.0,
                   help="idle gap after each phase, the RL policy update: one GRPO update of "
                   "96 sequences x 50 tokens took 107-109 s on an AVX2 host "
                   "(python -m benchmarks.rollout grpo-step --seqs 96 --tokens 50)")
    p.add_argument("--ref-prompts", type=int, default=96)
    p.add_argument("--ref-steps", type=int, default=200)
    p.add_argument("--spec-max-batch", type=int, default=8,
                   help="the server speculates (and reports accept length) in the tail only")


# ---- cost ---------------------------------------------------------------------------------


def wait_for_trainer(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/get_drafter_info", timeout=30).json()["training"]["trainer"]:
            return
        time.sleep(1.0)
    raise RuntimeError("the trainer never reported")


def teacher_forced_tok_s(a: argparse.Namespace, seqs: list[list[int]]) -> float | None:
    """Tokens/s of the target's teacher-forced forward over ``seqs`` (features only)."""
    if not seqs:
        return None
    from tlt_serve import LLM
    from trainer.data import target_features

    llm = LLM(a.model, dtype=a.dtype, max_model_len=2048)
    target_features(llm.engine.model, seqs[:2], 4096)  # warm-up
    t0 = time.perf_counter()
    target_features(llm.engine.model, seqs, 4096)
    return sum(len(s) for s in seqs) / (time.perf_counter() - t0)


def cost(a: argparse.Namespace) -> Path:
    """What online adaptation costs serving under full load. The same closed-loop workload
    (``--concurrency`` clients, greedy, varied lengths) against three servers, interleaved
    over ``--rounds`` (this machine is shared and noisy): ``base`` (speculating with a
    drafter, as deployed), ``capture`` (+ ``--capture``) and ``trainer`` (+
    ``--train-drafter``: capture, and the trainer process polling its gate, which stays
    closed while requests are in flight). Medians and ratios to ``base``. Capture takes the
    features from the serving forwards (on vLLM: what vLLM hands its EAGLE drafter); the
    alternative, a teacher-forced target forward over the captured token ids in idle time,
    is timed too on the captured sequences (in this process, the own engine, same dtype):
    its tokens/s against the served tokens/s says what share of serving it would cost."""
    from tlt_serve.engine.capture import decode_samples

    reqs = varied_requests(tokenizer(a.model), a.requests, a.min_new, a.max_new)
    base = ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(a.concurrency),
            "--max-model-len", "1024", "--speculative", "auto", "--drafter",
            str(Path(a.drafter).expanduser().resolve()), "--backend", a.backend]
    configs = {"base": base, "capture": [*base, "--capture"],
               "trainer": [*base, "--train-drafter", "--trainer-state-dir",
                           tempfile.mkdtemp(prefix="tlt-trainer-")]}
    runs: dict[str, list[float]] = {name: [] for name in configs}
    captured: list[list[int]] = []
    for r in range(a.rounds):
        for name, flags in configs.items():
            with running_server(flags) as url:
                if name == "trainer":
                    wait_for_trainer(url)
                stats = asyncio.run(load.closed_loop(Endpoint(url), reqs, a.concurrency, name))
                if name == "capture":
                    blob = httpx.get(f"{url}/drafter/samples", timeout=300,
                                     params={"max_bytes": 1 << 30}).content
                    captured = [s.tokens.tolist() for s in decode_samples(blob)]
            runs[name].append(stats["tok_s"])
            print(f"round {r + 1} {name}: {stats['tok_s']:.1f} tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in runs.items()}
    forced = teacher_forced_tok_s(a, captured)
    ratios = {name: med[name] / med["base"] for name in med}
    print(json.dumps(ratios, indent=2))
    return report(a, {
        "tok_s": runs, "median_tok_s": med, "ratio_to_base": ratios,
        "captured_sequences": len(captured), "teacher_forced_tok_s": forced,
        # features by a teacher-forced forward instead of capture: seconds of it per second
        # of serving the same tokens
        "teacher_forced_share_of_serving": med["base"] / forced if forced else None,
    })


def _cost_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", choices=["native", "vllm"], default="native")


# ---- yield --------------------------------------------------------------------------------


def proc_state(pid: int) -> str:
    """The process state letter from /proc (R running, S sleeping, T stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def trainer_server(a: argparse.Namespace, *flags: str) -> list[str]:
    drafter = str(Path(a.drafter).expanduser().resolve())
    return ["--model", a.model, "--speculative", "auto", "--drafter", drafter,
            "--max-num-seqs", "32", *flags]


def give_data(http: httpx.Client, prompts: list[list[int]]) -> None:
    """One sampled rollout of every prompt, so that a trainer has data."""
    params = {"max_new_tokens": 96, "temperature": 1.0, "ignore_eos": True}
    http.post("/generate", json={"input_ids": prompts, "sampling_params": params})


SHORT = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}  # ~2 s here: noticed


def in_process(a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """The trainer in this process on a capturing server's idle gaps: when a request
    arrives, the time to its first tick that saw the gate closed (it trains no more after
    that); and the duration of training ticks (gate check + one micro-step), which bounds
    that latency."""
    from trainer.link import ServerLink
    from trainer.online import OnlineConfig, OnlineTrainer

    ticks: list[tuple[float, float, str]] = []
    latencies, missed = [], 0
    with running_server(trainer_server(a, "--capture")) as url, \
            httpx.Client(base_url=url, timeout=1800) as http:
        give_data(http, prompts)
        cfg = OnlineConfig(server=url, state_dir=tempfile.mkdtemp(), init=a.drafter,
                           row_len=a.row_len, min_train_tokens=1024, eval_every=10**9)
        trainer = OnlineTrainer(cfg, ServerLink(url))
        inner = trainer.tick

        def tick() -> str:  # every tick logged: (start, end, what it did)
            t0 = time.perf_counter()
            what = inner()
            ticks.append((t0, time.perf_counter(), what))
            return what

        trainer.tick = tick  # type: ignore[method-assign]
        thread = threading.Thread(target=trainer.run, daemon=True)
        thread.start()
        for _ in tqdm(range(a.trials), desc="yield (in process)"):
            time.sleep(2.0)  # let it train
            sent = time.perf_counter()
            http.post("/generate", json={"input_ids": prompts[0], "sampling_params": SHORT})
            waiting = [t0 for t0, _, what in ticks if what == "waiting" and t0 >= sent]
            if waiting:
                latencies.append(waiting[0] - sent)
            else:
                missed += 1
        trainer.stop.set()
        thread.join(30)
    train_ticks = [end - t0 for t0, end, what in ticks if what == "trained"]
    return {"train_tick_s": {"n": len(train_ticks), "p50": statistics.median(train_ticks),
                             "p99": pct(train_ticks, 0.99), "max": max(train_ticks)},
            "yield_latency_s": {"n": len(latencies), "missed": missed,
                                "p50": statistics.median(latencies), "max": max(latencies),
                                "all": [round(x, 4) for x in latencies]},
            "trainer_steps": trainer.step}


def post_then_set(http: httpx.Client, body: dict[str, Any], done: threading.Event) -> None:
    http.post("/generate", json=body)
    done.set()


def supervised(a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """``--train-drafter``: from sending a request until the trainer process is stopped
    (SIGSTOP from the server)."""
    latencies = []
    flags = trainer_server(a, "--train-drafter", "--trainer-state-dir", tempfile.mkdtemp())
    with running_server(flags) as url, httpx.Client(base_url=url, timeout=1800) as http:
        give_data(http, prompts)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until it trains
            trainer = http.get("/get_drafter_info").json()["training"]["trainer"]
            if trainer and trainer["step"] > 0:
                break
            time.sleep(0.5)
        for _ in tqdm(range(a.trials), desc="yield (supervised)"):
            time.sleep(2.0)
            pid = http.get("/get_drafter_info").json()["training"]["pid"]
            done = threading.Event()
            body = {"input_ids": prompts[0], "sampling_params": SHORT}
            t = threading.Thread(target=post_then_set, args=(http, body, done))
            sent = time.perf_counter()
            t.start()
            while proc_state(pid) != "T" and not done.is_set():
                time.sleep(0.0005)
            if not done.is_set():
                latencies.append(time.perf_counter() - sent)
            t.join()
    return {"n": len(latencies), "p50": statistics.median(latencies), "max": max(latencies),
            "all": [round(x, 4) for x in latencies]}


def yield_(a: argparse.Namespace) -> Path:
    """How fast the online trainer gets out of the way: ``--trials`` times a request
    arrives while it trains. In process (on a capturing server's idle gaps): the yield
    latency and the training ticks' durations; supervised by the server
    (``--train-drafter``, unless ``--skip-supervised``): the time until the trainer process
    is stopped."""
    from trainer.online import OnlineConfig

    a.drafter = str(Path(a.drafter).expanduser().resolve())
    a.row_len = a.row_len or OnlineConfig.row_len
    prompts = chat_prompts(tokenizer(a.model), 0, 32)
    out = in_process(a, prompts)
    if not a.skip_supervised:
        out["supervised_stop_latency_s"] = supervised(a, prompts)
    print(json.dumps(out, indent=2))
    return report(a, out)


def _yield_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", required=True)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--row-len", type=int, default=None,
                   help="the trainer's packed row length (default: OnlineConfig's)")
    p.add_argument("--skip-supervised", action="store_true")


# ---- accept -------------------------------------------------------------------------------


def accept(a: argparse.Namespace) -> Path:
    """Offline accept of drafters on prompts none of them trained on: the benchmark prompt
    set. The target answers the first ``--prompts`` prompts greedily (``--max-new-tokens``,
    ``--dtype``) once; every drafter then drafts greedy chains of ``--depth`` tokens over
    those answers (no target forward per drafter). Per drafter and per prompt kind (chat /
    reasoning / code): the mean accept over every answer position, the walk accept (the
    chains greedy serving drafts; what accepted drafts per verify step would be without the
    confidence cut) and top-1."""
    from tlt_serve.models.provision import resolve_model_path

    dirs = [Path(d).expanduser() for d in a.drafters]
    labels = a.names or [d.name for d in dirs]
    if len(labels) != len(dirs):
        raise SystemExit("--names: one label per drafter")
    model_dir = resolve_model_path(a.model)
    prompts = chat_prompts(tokenizer(str(model_dir)), 0, a.prompts)
    samples = answered(model_dir, prompts, a.max_new_tokens, a.dtype)[0]
    stub = version_stub(model_dir)
    groups = {"all": samples, **{k: [s for i, s in enumerate(samples) if kind_of(i) == k]
                                 for k in KINDS}}
    results = {name: {g: accept_on(d, stub, group, a.depth).as_dict()
                      for g, group in groups.items()}
               for name, d in zip(labels, dirs, strict=True)}
    for name, r in results.items():
        print(f"{name}: accept (all positions) {r['all']['accept_length']:.3f}, walk "
              f"{r['all']['walk_accept_length']:.3f}, top-1 {r['all']['top1']:.3f}; walk by "
              "kind " + ", ".join(f"{k} {r[k]['walk_accept_length']:.3f}" for k in KINDS))
    return report(a, {"results": results, "drafters": dict(zip(labels, map(str, dirs),
                                                               strict=True))},
                  plot_accept)


def plot_accept(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    results, args = result["results"], result["args"]
    groups = ["all", *KINDS]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    grouped_bars(ax, groups, {name: {g: r[g]["walk_accept_length"] for g in groups}
                              for name, r in results.items()})
    ax.set_ylabel(f"accepted drafts per chain (depth {args['depth']})")
    ax.set_title(f"walk accept on {args['prompts']} benchmark prompts, "
                 f"{args['max_new_tokens']} greedy tokens")
    ax.legend()
    save(fig, path, dpi=100)


def _accept_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafters", type=names, required=True,
                   help="comma-separated checkpoint directories")
    p.add_argument("--names", type=names, default=[],
                   help="comma-separated labels (default: the directories' names)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=DEPTH)
    p.add_argument("--dtype", default="bfloat16")


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "adaptation", {
        "drift": (_drift_arguments, drift),
        "run": (_run_arguments, run),
        "cost": (_cost_arguments, cost),
        "yield": (_yield_arguments, yield_),
        "accept": (_accept_arguments, accept),
    }, argv)


if __name__ == "__main__":
    main()
