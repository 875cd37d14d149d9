"""Drifting target versions: the default model fine-tuned, stage after stage, on the
arithmetic task (``clients/tasks.py``), each stage in a different solution style.

Version 0 is the base model; version k is version k-1 after ``steps`` supervised steps on
style k-1 answers (fp32, AdamW, response tokens only, the tied embedding frozen). Like
successive RL steps, every version changes what the target writes — here on purpose enough
that a drafter fitted to the previous version falls behind. Versions are cached (a directory
per version with ``drift.json``) and rebuilt only when their settings change.

    python -m benchmarks.drift --versions 4
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import report
from clients.policy import load_policy, make_batch, response_logprobs, save_policy
from clients.tasks import make_problems, prompt_ids, solution
from tlt_serve.models.provision import default_cache_dir, resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer


@dataclass(frozen=True)
class DriftConfig:
    model: str = "smollm2-135m"
    versions: int = 4  # including version 0, the base model
    steps: int = 24  # supervised steps per stage
    batch: int = 8
    lr: float = 1e-4
    seed: int = 0
    out: str = ""  # default: <cache>/drift/<model>


def version_dirs(cfg: DriftConfig) -> list[Path]:
    """Version 0 .. versions-1, building the missing ones; returns their directories."""
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
            _stage(cfg, dirs[-1], base, out, k, key)
        dirs.append(out)
    return dirs


def _stage(cfg: DriftConfig, prev: Path, base: Path, out: Path, k: int, key: dict) -> None:
    tok = load_tokenizer(base)
    model = load_policy(prev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    problems = make_problems(cfg.steps * cfg.batch, seed=1000 * k + cfg.seed)
    rng = random.Random(cfg.seed + k)
    rng.shuffle(problems)
    eos = tok.hf.eos_token_id
    losses = []
    t0 = time.perf_counter()
    # AdamW's second moments start as tiny squares of gradients: denormal floats, which
    # x86 computes ~5x slower (measured: 50 s vs 10 s a step on 2 cores). Flushed to zero.
    torch.set_flush_denormal(True)
    bar = tqdm(range(cfg.steps), desc=f"drift v{k} (style {k - 1})")
    for step in bar:
        chunk = problems[step * cfg.batch : (step + 1) * cfg.batch]
        prompts = prompt_ids(tok, chunk)
        answers = [tok.encode(solution(p, k - 1)) + [eos] for p in chunk]
        loss = -response_logprobs(model, make_batch(prompts, answers, eos)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    save_policy(model, base, out)
    report = {"key": key, "losses": losses, "seconds": time.perf_counter() - t0}
    (out / "drift.json").write_text(json.dumps(report, indent=2))


def main() -> None:
    ap = report.parser(__doc__)
    d = DriftConfig()
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--versions", type=int, default=d.versions)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cfg = DriftConfig(model=a.model, versions=a.versions, steps=a.steps, lr=a.lr, out=a.out)
    for k, path in enumerate(version_dirs(cfg)):
        print(f"v{k}: {path}")


if __name__ == "__main__":
    main()
