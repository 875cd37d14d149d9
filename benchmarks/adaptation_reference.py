"""The adaptation benchmark's two fixed references and the offline accept measure.

- (c) per target version: a drafter trained offline until its held-out accept stops rising,
  on that version's own greedy answers to task prompts the rollout phases never use, starting
  from the warm-up drafter (the best a drafter of this size does on that version).
- ``accept_on``: offline accept length (greedy chains of ``depth`` drafts, the engine's
  ``num_accepted``) of any drafter on captured served sequences. Phases are generated
  greedily, so this is exactly what greedy verification with that drafter would accept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tlt_serve.engine.capture import TrainingSample
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig
from tlt_serve.llm import LLM
from tlt_serve.models.llama import LlamaModel
from tlt_serve.models.loader import build_model
from tlt_serve.speculative.checkpoint import load_drafter, save_drafter
from trainer.data import DataConfig, Sample, generate, make_samples, target_features
from trainer.evaluate import AcceptStats, offline_accept, prepare_heldout
from trainer.packing import batches
from trainer.target import head_target
from trainer.train import TrainConfig, train

MAX_POSITIONS = 4096


def version_stub(model_dir: Path) -> LlamaModel:
    """The fp32 embedding / norm / head of a target version (bf16-rounded, as served)."""
    model = build_model(model_dir, torch.bfloat16, 1, cpu_kernels=False)
    return head_target(model, MAX_POSITIONS)


def as_samples(captured: Sequence[TrainingSample]) -> list[Sample]:
    return [Sample(s.tokens, s.features, s.prompt_len) for s in captured]


def accept_on(
    drafter_dir: Path, stub: LlamaModel, samples: Sequence[Sample], depth: int
) -> AcceptStats:
    drafter = load_drafter(drafter_dir, stub)
    held = prepare_heldout(drafter, batches(samples, 512, 2, None))
    return offline_accept(drafter, held, depth)


def reference_drafter(
    model_dir: Path,
    warm: Path,
    out: Path,
    prompts: list[list[int]],
    max_new: int,
    train_cfg: TrainConfig,
    depth: int,
    seed: int,
) -> dict:
    """Train (c) for one target version (cached in ``out``); returns its report."""
    report_path = out / "reference.json"
    key = {"model": str(model_dir), "warm": str(warm), "prompts": len(prompts),
           "max_new": max_new, "steps": train_cfg.steps, "lr": train_cfg.lr, "seed": seed}
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        if report.get("key") == key:
            return dict(report)
    t0 = time.perf_counter()
    heldout_n = max(len(prompts) // 8, 4)
    data = DataConfig(num_prompts=len(prompts), heldout_prompts=heldout_n,
                      max_new_tokens=max_new, temperature=0.0, max_num_seqs=64)
    max_len = max(len(p) for p in prompts) + max_new + 1
    llm = LLM(config=EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="bfloat16", max_model_len=max_len),
        cache=CacheConfig(max_num_seqs=data.max_num_seqs), seed=seed))
    responses = generate(llm, prompts, data, seed)
    target = llm.engine.model
    del llm
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    samples = make_samples(prompts, responses, target_features(target, seqs, 4096))
    stub = head_target(target, MAX_POSITIONS)
    del target
    n_train = len(samples) - heldout_n
    drafter = load_drafter(warm, stub).train().requires_grad_(True)  # head already refreshed
    held = prepare_heldout(drafter, batches(samples[n_train:], 512, 2, None))
    before = offline_accept(drafter, held, depth)
    hist = train(drafter, samples[:n_train], held, train_cfg, seed)
    after = offline_accept(drafter, held, depth)
    target_hf = json.loads((model_dir / "config.json").read_text())
    save_drafter(drafter, out, target_hf, drafter.spec)
    report = {
        "key": key,
        "seconds": round(time.perf_counter() - t0, 1),
        "train_response_tokens": sum(len(r) for r in responses[:n_train]),
        "heldout_accept_before": before.as_dict(),
        "heldout_accept_after": after.as_dict(),
        "heldout_top1_curve": [[s, round(a, 4)] for s, a in hist.evals],
        "final_loss": round(sum(hist.loss[-20:]) / min(len(hist.loss), 20), 4),
    }
    report_path.write_text(json.dumps(report, indent=2))
    return report
