"""Offline accept length: greedy chain drafting on held-out sequences, no target forward.

For every response position t of a held-out sequence, the drafter has seen the true pairs up
to t-1 and drafts ``depth`` tokens in a chain, feeding back its own predicted features
(``unroll.chain_forward``). Draft j is compared with the target's argmax at position t + j
(its head over the stored true feature f_{t+j}); the accept length of the chain is the number
of leading matches (0..depth, the bonus token not counted — the engine's ``num_accepted``).
Held-out responses are greedy, so the target argmax is the continuation and the chain is the
one greedy verification would see.

The mean over every start position counts the easy positions inside long accepted runs that
serving never drafts from. ``walk_accept_length`` is what greedy serving measures: chains
only from where serving starts one (the first response position, then one past the previous
chain's accepted drafts and bonus token), with no confidence cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_serve.speculative.drafter import DrafterModel
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
    walk_accept_length: float = 0.0  # mean over the chains greedy serving would draft
    walk_chains: int = 0

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
            "walk_accept_length": round(self.walk_accept_length, 4),
            "walk_chains": self.walk_chains,
        }


@torch.no_grad()
def prepare_heldout(
    drafter: DrafterModel, batches: Sequence[PackedBatch], chunk: int = 512
) -> list[HeldOut]:
    """Target argmax (full vocabulary) of every held-out slot, computed once."""
    out = []
    device = drafter.fc.weight.device
    for b in batches:
        b = b.to(device)  # held on the trainer's device while it is evaluated
        B, Q, H = b.targets.shape
        flat = b.targets.reshape(B * Q, H)  # [BQ, H]
        arg = torch.cat(
            [drafter.target.logits(flat[i : i + chunk]).argmax(-1) for i in range(0, B * Q, chunk)]
        )
        out.append(HeldOut(b, arg.view(B, Q)))
    return out


def chain_drafts(drafter: DrafterModel, b: PackedBatch, depth: int) -> list[torch.Tensor]:
    """Greedy chain drafts from every slot: ``depth`` token tensors [B, Q]."""
    B, Q = b.tokens.shape
    drafts: list[torch.Tensor] = []

    def draft(out: torch.Tensor) -> torch.Tensor:  # out [B, Q, H]
        index = drafter.draft_logits(out.reshape(B * Q, -1)).argmax(-1)  # [BQ]
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
    total, chains, walked = 0.0, 0, []
    for h in heldout:
        b = h.batch
        drafts = chain_drafts(drafter, b, depth)  # depth x [B, Q]
        start = b.eval_mask  # [B, Q] chains that start at a response position
        alive = start.clone()
        lengths = torch.zeros(b.seg.shape, dtype=torch.long, device=b.seg.device)  # [B, Q]
        for j in range(depth):
            ok = (
                (drafts[j] == shift(h.target_argmax, j))
                & shift(b.eval_mask, j, False)
                & chain_valid(b.seg, j)
            )
            alive = alive & ok  # [B, Q]
            lengths += alive
            hits[j] += float(alive.sum())
            total += float(alive.sum())
        chains += int(start.sum())
        walked += walk(lengths, start, b.seg)
    drafter.train(was_training)
    n = max(chains, 1)
    per_depth = tuple(float(h) / n for h in hits)
    walk_mean = sum(walked) / max(len(walked), 1)
    return AcceptStats(total / n, per_depth, chains, walk_mean, len(walked))


def walk(lengths: torch.Tensor, start: torch.Tensor, seg: torch.Tensor) -> list[int]:
    """Accept lengths of the chains greedy serving drafts, segment by segment, in order.

    lengths [B, Q] accepted drafts of the chain from each slot; start [B, Q] bool: slots a
    chain may start from; seg [B, Q] segment ids. The first chain of a segment starts at its
    first start slot, each next one ``length + 1`` slots after the previous one."""
    out: list[int] = []
    rows = zip(lengths.tolist(), start.tolist(), seg.tolist(), strict=True)
    for row_len, row_start, row_seg in rows:
        next_at: dict[int, int] = {}  # segment → first slot the next chain may start at
        for q, (a, ok, sid) in enumerate(zip(row_len, row_start, row_seg, strict=True)):
            if ok and q >= next_at.get(sid, q):
                out.append(a)
                next_at[sid] = q + a + 1
    return out
