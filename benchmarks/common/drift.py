"""The drifting target versions: the default model fine-tuned stage after stage on the
arithmetic task, each stage in a new answer style, so that what the target writes changes
from version to version as it does between RL steps."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.prompts import tokenizer


@dataclass(frozen=True)
class DriftConfig:
    """Version 0 is the base model; version k is version k-1 after ``steps`` supervised steps
    on the arithmetic task (``clients/tasks.py``) in solution style k-1 (fp32, AdamW, response
    tokens only, the tied embedding frozen). Like successive RL steps, every version changes
    what the target writes, here on purpose enough that a drafter fitted to the previous
    version falls behind."""

    model: str = "smollm2-135m"
    versions: int = 4  # including version 0, the base model
    steps: int = 24  # supervised steps per stage
    batch: int = 8
    lr: float = 1e-4
    seed: int = 0
    out: str = ""  # default: <cache>/drift/<model>


def version_dirs(cfg: DriftConfig) -> list[Path]:
    """Version 0 .. versions-1, building the missing ones (cached, a directory per version
    with ``drift.json``, rebuilt only when their settings change); their directories."""
    from tlt_serve.models.provision import default_cache_dir, resolve_model_path

    base = resolve_model_path(cfg.model)
    root = Path(cfg.out) if cfg.out else default_cache_dir() / "drift" / cfg.model
    dirs = [base]
    for k in range(1, cfg.versions):
        out = root / f"v{k}"
        # A version depends on the settings and on the versions before it, not on how many
        # come after it.
        key = {**asdict(cfg), "version": k, "out": "", "versions": None}
        meta = out / "drift.json"
        if not (meta.is_file() and json.loads(meta.read_text()).get("key") == key):
            _drift_stage(cfg, dirs[-1], base, out, k, key)
        dirs.append(out)
    return dirs


def _drift_stage(cfg: DriftConfig, prev: Path, base: Path, out: Path, k: int,
                 key: dict[str, Any]) -> None:
    import torch
    from tqdm import tqdm

    from clients.policy import load_policy, make_batch, response_logprobs, save_policy
    from clients.tasks import make_problems, prompt_ids, solution

    tok = tokenizer(str(base))
    model = load_policy(prev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    problems = make_problems(cfg.steps * cfg.batch, seed=1000 * k + cfg.seed)
    random.Random(cfg.seed + k).shuffle(problems)
    eos = tok.hf.eos_token_id
    losses = []
    t0 = time.perf_counter()
    # AdamW's second moments start as tiny squares of gradients: denormal floats, which
    # x86 computes ~5x slower (measured: 50 s vs 10 s a step on 2 cores). Flushed to zero.
    torch.set_flush_denormal(True)
    bar = tqdm(range(cfg.steps), desc=f"drift v{k} (style {k - 1})")
    for step in bar:
        chunk = problems[step * cfg.batch : (step + 1) * cfg.batch]
        answers = [tok.encode(solution(p, k - 1)) + [eos] for p in chunk]
        loss = -response_logprobs(model, make_batch(prompt_ids(tok, chunk), answers, eos)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    save_policy(model, base, out)
    report_ = {"key": key, "losses": losses, "seconds": time.perf_counter() - t0}
    (out / "drift.json").write_text(json.dumps(report_, indent=2))
