"""Offline accept length: greedy chain drafting on held-out sequences, no target forward.

For every response position t of a held-out sequence, the drafter has seen the true pairs up
to t-1 and drafts ``depth`` tokens in a chain, feeding back its own predicted features
(``unroll.chain_forward``). Draft j is compared with the target's argmax at position t + j
(its head over the stored true feature f_{t+j}); the accept length of the chain is the number
of leading matches (0..depth, the bonus token not counted — the engine's ``num_accepted``).
Held-out responses are greedy, so the target argmax is the continuation and the chain is the
one greedy verification would see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_serve.spec.drafter import DrafterModel
from trainer.packing import PackedBatch
from trainer.unroll import chain_forward, chain_valid, shift


@dataclass(frozen=True)
class HeldOut:
    batch: PackedBatch
    target_argmax: torch.Tensor  # [B, Q] long: argmax of the target head over f_{s+1}


@dataclass(frozen=True)
class AcceptStats:
    accept_length: float  # mean accepted drafts per chain (excludes the bonus token)
    per_depth: tuple[float, ...]  # [j]: fraction of chains whose first j+1 drafts are accepted
    chains: int

    @property
    def top1(self) -> float:
        """Fraction of positions where the drafter's first draft is the target's argmax."""
        return self.per_depth[0] if self.per_depth else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "accept_length": round(self.accept_length, 4),
            "per_depth": [round(p, 4) for p in self.per_depth],
            "top1": round(self.top1, 4),
            "chains": self.chains,
        }


@torch.no_grad()
def prepare_heldout(
    drafter: DrafterModel, batches: Sequence[PackedBatch], chunk: int = 512
) -> list[HeldOut]:
    """Target argmax (full vocabulary) of every held-out slot, computed once."""
    out = []
    for b in batches:
        B, Q, H = b.targets.shape
        flat = b.targets.reshape(B * Q, H)  # [BQ, H]
        arg = torch.cat(
            [drafter.target.logits(flat[i : i + chunk]).argmax(-1) for i in range(0, B * Q, chunk)]
        )
        out.append(HeldOut(b, arg.view(B, Q)))
    return out


def chain_drafts(drafter: DrafterModel, b: PackedBatch, depth: int) -> list[torch.Tensor]:
    """Greedy chain drafts from every slot: ``depth`` token tensors [B, Q]."""
    B, Q, H = b.features.shape
    drafts: list[torch.Tensor] = []

    def draft(out: torch.Tensor) -> torch.Tensor:
        index = drafter.draft_logits(out.reshape(B * Q, H)).argmax(-1)  # [BQ]
        return drafter.to_token_ids(index).view(B, Q)  # [B, Q]

    def next_tokens(j: int, out: torch.Tensor) -> torch.Tensor:
        drafts.append(draft(out))
        return drafts[-1]

    outs = chain_forward(drafter, b.tokens, b.features, b.seg, b.positions, depth, next_tokens)
    drafts.append(draft(outs[-1]))
    return drafts


@torch.no_grad()
def offline_accept(drafter: DrafterModel, heldout: Sequence[HeldOut], depth: int) -> AcceptStats:
    """Greedy chain drafting of ``depth`` tokens from every held-out response position."""
    was_training = drafter.training
    drafter.eval()
    hits = torch.zeros(depth, dtype=torch.float64)
    total, chains = 0.0, 0
    for h in heldout:
        b = h.batch
        drafts = chain_drafts(drafter, b, depth)  # depth x [B, Q]
        start = b.eval_mask  # [B, Q] chains that start at a response position
        alive = start.clone()
        for j in range(depth):
            ok = (
                (drafts[j] == shift(h.target_argmax, j))
                & shift(b.eval_mask, j, False)
                & chain_valid(b.seg, j)
            )
            alive = alive & ok  # [B, Q]
            hits[j] += float(alive.sum())
            total += float(alive.sum())
        chains += int(start.sum())
    drafter.train(was_training)
    n = max(chains, 1)
    return AcceptStats(total / n, tuple(float(h) / n for h in hits), chains)
