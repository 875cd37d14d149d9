"""Sequence packing: pair windows of several samples share a row of at most ``row_len`` pairs.

A segment is pairs [a, b) of one sample; pair i is (f_i, x_{i+1}) → target f_{i+1}. Rows are
filled first-fit-decreasing, then shuffled. Attention never crosses segments (see
``unroll.chain_forward``), and rotary positions are the pairs' own positions in their sample.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from trainer.data import Sample


@dataclass(frozen=True)
class Segment:
    sample: int  # index into the sample list
    start: int  # first pair
    end: int  # one past the last pair


@dataclass(frozen=True)
class PackedBatch:
    """B rows of Q pair slots; padding slots have ``seg`` -1 and no loss."""

    tokens: torch.Tensor  # [B, Q] long: x_{i+1}
    features: torch.Tensor  # [B, Q, F] fp32: f_i (F = H, or k*H fused target layers)
    targets: torch.Tensor  # [B, Q, H] fp32: the target's final hidden state at i + 1
    seg: torch.Tensor  # [B, Q] long: segment id, -1 for padding
    positions: torch.Tensor  # [B, Q] long: i
    loss_mask: torch.Tensor  # [B, Q] bool: x_{i+1} is a response token (i >= prompt_len - 1)
    eval_mask: torch.Tensor  # [B, Q] bool: loss_mask and x_{i+2} exists (not the last pair)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch on ``device`` (itself when already there)."""
        if self.tokens.device == torch.device(device):
            return self
        return PackedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def segments(samples: Sequence[Sample], row_len: int) -> list[Segment]:
    """Every sample's pairs cut into windows of at most ``row_len``."""
    out = []
    for s, sample in enumerate(samples):
        for a in range(0, sample.num_pairs, row_len):
            out.append(Segment(s, a, min(a + row_len, sample.num_pairs)))
    return out


def pack_rows(
    segs: Sequence[Segment], row_len: int, rng: random.Random | None
) -> list[list[Segment]]:
    """First-fit-decreasing packing into rows of ``row_len`` pairs; rows shuffled when ``rng``
    (equal-length segments are shuffled before the stable sort, so rows vary by epoch)."""
    order = list(segs)
    if rng is not None:
        rng.shuffle(order)
    order.sort(key=lambda s: s.start - s.end)  # longest first
    rows: list[list[Segment]] = []
    free: list[int] = []
    for seg in order:
        n = seg.end - seg.start
        r = next((i for i, f in enumerate(free) if f >= n), None)
        if r is None:
            rows.append([])
            free.append(row_len)
            r = len(rows) - 1
        rows[r].append(seg)
        free[r] -= n
    if rng is not None:
        rng.shuffle(rows)
    return rows


def make_batch(rows: Sequence[Sequence[Segment]], samples: Sequence[Sample]) -> PackedBatch:
    """Tensors for a list of packed rows (right-padded to the fullest row). Features and
    targets are built where the samples keep theirs (a GPU store never goes through the
    host); the small index tensors on the CPU."""
    B = len(rows)
    Q = max(sum(s.end - s.start for s in row) for row in rows)
    first = samples[rows[0][0].sample]
    F, H = int(first.features.shape[-1]), int(first.hidden.shape[-1])
    where = first.features.device
    tokens = torch.zeros(B, Q, dtype=torch.long)
    features = torch.zeros(B, Q, F, device=where)
    targets = torch.zeros(B, Q, H, device=where)
    seg = torch.full((B, Q), -1, dtype=torch.long)
    positions = torch.zeros(B, Q, dtype=torch.long)
    loss_mask = torch.zeros(B, Q, dtype=torch.bool)
    eval_mask = torch.zeros(B, Q, dtype=torch.bool)
    sid = 0
    for b, row in enumerate(rows):
        q = 0
        for s in row:
            sample, n = samples[s.sample], s.end - s.start
            pairs = torch.arange(s.start, s.end)  # [n]
            tokens[b, q : q + n] = sample.tokens[s.start + 1 : s.end + 1]
            features[b, q : q + n] = sample.features[s.start : s.end].float()
            targets[b, q : q + n] = sample.hidden[s.start + 1 : s.end + 1].float()
            seg[b, q : q + n] = sid
            positions[b, q : q + n] = pairs
            loss_mask[b, q : q + n] = pairs >= sample.prompt_len - 1
            eval_mask[b, q : q + n] = (pairs >= sample.prompt_len - 1) & (
                pairs < sample.num_pairs - 1
            )
            q, sid = q + n, sid + 1
    return PackedBatch(tokens, features, targets, seg, positions, loss_mask, eval_mask)


def batches(
    samples: Sequence[Sample], row_len: int, rows_per_batch: int, rng: random.Random | None
) -> list[PackedBatch]:
    """One pass over all samples as packed batches (shuffled when ``rng``)."""
    rows = pack_rows(segments(samples, row_len), row_len, rng)
    return [
        make_batch(rows[i : i + rows_per_batch], samples)
        for i in range(0, len(rows), rows_per_batch)
    ]
