"""The EAGLE training loop: fp32 drafter over the frozen target's embedding and head.

Loss per response position (as EAGLE / TLT): ``feature_weight * SmoothL1(f̂_{i+1}, f_{i+1})``
(mean over the hidden axis) ``+ ce_weight * CE(softmax(head(f_{i+1})), log_softmax(head(f̂)))``
over the draft vocabulary, the target's distribution computed without grad. With ``unroll``
> 1 the chain is unrolled (block j feeds the drafter's own block j-1 prediction, as drafting
does) and the blocks' losses are averaged. Input features get uniform noise (EAGLE-1).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tlt_serve.speculative.drafter import DrafterModel
from trainer.data import Sample
from trainer.evaluate import AcceptStats, HeldOut, offline_accept
from trainer.packing import PackedBatch, batches
from trainer.unroll import chain_forward, chain_valid, shift


@dataclass(frozen=True)
class TrainConfig:
    # Measured on smollm2-135m (416 answers, offline accept at depth 4; see trainer/README.md):
    # at equal compute, unroll 2 beat unroll 1 and 3, batch 1024 beat 2048, lr 2e-3 beat
    # 1e-3 and 3e-4; 600 steps beat 300 by ~0.2 accepted tokens. With 2x the data (864
    # answers, templates + the target's own prompts) 1200 steps beat 600 on unseen prompts.
    steps: int = 1200
    batch_tokens: int = 1024  # pair slots per step (rows of ``row_len``)
    row_len: int = 512
    lr: float = 2e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    noise: float = 0.05  # half-width of the uniform input-feature noise, in feature stds
    unroll: int = 2  # chain steps trained per position (1 = teacher forcing only)
    eval_every: int = 50  # steps between held-out top-1 evaluations (0: only at the end)

    def validate(self) -> None:
        checks = [
            ("steps", self.steps >= 1, ">= 1"),
            ("row_len", self.row_len >= 2, ">= 2"),
            ("batch_tokens", self.batch_tokens >= self.row_len, f">= row_len ({self.row_len})"),
            ("lr", self.lr > 0, "> 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("noise", self.noise >= 0, ">= 0"),
            ("unroll", 1 <= self.unroll <= 8, "in [1, 8]"),
            ("eval_every", self.eval_every >= 0, ">= 0"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name}: must be {want}, got {getattr(self, name)}")


@dataclass
class History:
    """Per-step losses and the held-out evaluations made while training."""

    loss: list[float] = field(default_factory=list)
    feature_loss: list[float] = field(default_factory=list)
    ce: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, top-1)
    epochs: int = 0


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine from 1 down to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine


def feature_std(samples: Sequence[Sample]) -> float:
    """Standard deviation of all feature entries (the noise scale)."""
    total, sq, n = 0.0, 0.0, 0
    for s in samples:
        f = s.features.float()
        total += float(f.sum())
        sq += float((f * f).sum())
        n += f.numel()
    mean = total / max(n, 1)
    return math.sqrt(max(sq / max(n, 1) - mean * mean, 0.0))


def step_loss(
    drafter: DrafterModel, b: PackedBatch, cfg: TrainConfig, noise: torch.Tensor
) -> tuple[torch.Tensor, float, float]:
    """The loss of one packed batch (averaged over unrolled blocks) and its two parts."""
    B, Q, H = b.targets.shape
    with torch.no_grad():
        target_p = F.softmax(drafter.draft_logits(b.targets.reshape(B * Q, H)), dim=-1)
        target_p = target_p.view(B, Q, -1)  # [B, Q, Vd]
    outs = chain_forward(
        drafter,
        b.tokens,
        b.features + noise,
        b.seg,
        b.positions,
        cfg.unroll,
        lambda j, _out: shift(b.tokens, j),  # teacher-forced tokens x_{s+1+j}
    )
    total = torch.zeros(())
    f_sum, ce_sum = 0.0, 0.0
    for j, out in enumerate(outs):
        mask = shift(b.loss_mask, j, False) & chain_valid(b.seg, j)  # [B, Q]
        if not bool(mask.any()):
            continue
        pred = out[mask]  # [N, H]
        f_loss = F.smooth_l1_loss(pred, shift(b.targets, j)[mask], reduction="none").mean()
        logp = F.log_softmax(drafter.draft_logits(pred), dim=-1)  # [N, Vd]
        ce = -(shift(target_p, j)[mask] * logp).sum(-1).mean()
        total = total + cfg.feature_weight * f_loss + cfg.ce_weight * ce
        f_sum, ce_sum = f_sum + float(f_loss.detach()), ce_sum + float(ce.detach())
    n = len(outs)
    return total / n, f_sum / n, ce_sum / n


def make_optimizer(drafter: DrafterModel, cfg: TrainConfig, lr: float) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable weights; no weight decay on norms and biases."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(cfg.beta1, cfg.beta2),
    )


def feature_noise(
    shape: torch.Size, cfg: TrainConfig, std: float, gen: torch.Generator
) -> torch.Tensor:
    """Uniform noise of half-width ``cfg.noise * std`` for the input features (EAGLE-1)."""
    return (torch.rand(shape, generator=gen) * 2 - 1) * (cfg.noise * std)


def train(
    drafter: DrafterModel,
    train_samples: Sequence[Sample],
    heldout: Sequence[HeldOut],
    cfg: TrainConfig,
    seed: int,
) -> History:
    """Train ``drafter`` in place for ``cfg.steps`` optimizer steps; returns the history."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = make_optimizer(drafter, cfg, cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    std = feature_std(train_samples)
    rows_per_batch = max(cfg.batch_tokens // cfg.row_len, 1)
    hist = History()
    queue: list[PackedBatch] = []
    top1 = float("nan")
    drafter.train()
    bar = tqdm(range(cfg.steps), desc="train", unit="step")
    for step in bar:
        if not queue:
            queue = batches(train_samples, cfg.row_len, rows_per_batch, rng)
            hist.epochs += 1
        b = queue.pop(0)
        noise = feature_noise(b.features.shape, cfg, std, gen)
        loss, f_loss, ce = step_loss(drafter, b, cfg, noise)
        opt.zero_grad(set_to_none=True)
        if loss.requires_grad:  # False only for a batch without response positions
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
        sched.step()
        hist.loss.append(float(loss.detach()))
        hist.feature_loss.append(f_loss)
        hist.ce.append(ce)
        last = step + 1 == cfg.steps
        if heldout and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last):
            top1 = evaluate_top1(drafter, heldout)
            hist.evals.append((step + 1, top1))
        bar.set_postfix(
            loss=f"{hist.loss[-1]:.3f}", feat=f"{f_loss:.3f}", ce=f"{ce:.3f}", top1=f"{top1:.3f}"
        )
    bar.close()
    drafter.eval()
    return hist


def evaluate_top1(drafter: DrafterModel, heldout: Sequence[HeldOut]) -> float:
    stats: AcceptStats = offline_accept(drafter, heldout, depth=1)
    return stats.top1
