"""A drafter for the real default model, fitted in seconds to the target's own answers.

Exactness does not depend on draft quality, but only accepted drafts exercise what a
rejected one never reaches (the accepted path's KV, the bonus token, the drafter advancing
along the path); an untrained drafter accepts almost nothing on the real model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tlt_serve import LLM
from tlt_serve.speculative.checkpoint import save_drafter
from tlt_serve.speculative.drafter import DrafterSpec, new_drafter
from trainer.data import build_draft_vocab, make_samples, target_features
from trainer.target import head_target
from trainer.train import TrainConfig, train


def fit_drafter(
    llm: LLM, prompts: list[list[int]], answers: list[list[int]], out: Path,
    draft_vocab_size: int = 2048, steps: int = 60,
) -> Path:
    """Train a drafter on ``answers`` (the target's, to ``prompts``) for ``steps`` steps
    (0: an untrained one) and save it to ``out``. ``draft_vocab_size`` 0 keeps the full head
    (as vLLM's EAGLE drafts)."""
    model = llm.engine.model
    seqs = [p + r for p, r in zip(prompts, answers, strict=True)]
    samples = make_samples(prompts, answers, target_features(model, seqs, 4096))
    stub = head_target(model, max(len(s) for s in seqs) + 16)
    spec = DrafterSpec(draft_vocab_size=draft_vocab_size)
    d = new_drafter(stub, spec, seed=0)
    if draft_vocab_size:
        with torch.no_grad():
            d.draft_vocab.copy_(build_draft_vocab(answers, prompts, draft_vocab_size,
                                                  model.cfg.vocab_size))
    d.refresh_head()
    if steps:
        cfg = TrainConfig(steps=steps, batch_tokens=512, row_len=128, lr=3e-3,
                          warmup_steps=5, eval_every=0)
        train(d, samples, [], cfg, seed=0)
    hf = json.loads((llm.engine.model_path / "config.json").read_text())
    return save_drafter(d, out, hf, spec)
