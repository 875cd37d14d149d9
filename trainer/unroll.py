"""Chained drafter forwards over packed rows, as drafting runs them at inference.

Block 0 is the ordinary teacher-forced pass: slot s holds pair s (true feature f_s, token
x_{s+1}) and predicts f_{s+1}. Block j >= 1 continues the chain that started at slot s one
step further: its input feature is block j-1's output at s (the drafter's OWN prediction),
its rotary position is ``positions[s] + j``, and it attends to the true pairs 0..s of its
segment (block 0's keys) plus its own chain's earlier blocks — exactly the keys a drafted
position sees in ``DrafterProposer`` (catch-up pairs, then the chain's drafted pairs).

Block j runs on a scratch KV tensor [2, B, kvH, (j+1) * Q, D]: the previous block's tensor
with Q empty columns appended (a new tensor, so the K/V earlier blocks saved for backward are
never modified in place), into which it writes columns ``j*Q .. j*Q + Q - 1``. The drafter
layer writes K/V with ``index_copy_`` and reads them back; that is differentiable because the
first scratch tensor itself needs no grad.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tlt_serve.models.batch import ForwardBatch, flat_write_index
from tlt_serve.speculative.drafter import DrafterModel

# (block j >= 1, block j-1's output [B, Q, H]) → input tokens of block j [B, Q]
NextTokens = Callable[[int, torch.Tensor], torch.Tensor]


def chain_forward(
    drafter: DrafterModel,
    tokens: torch.Tensor,
    features: torch.Tensor,
    seg: torch.Tensor,
    positions: torch.Tensor,
    depth: int,
    next_tokens: NextTokens,
) -> list[torch.Tensor]:
    """tokens [B, Q], features [B, Q, H], seg/positions [B, Q] → ``depth`` outputs [B, Q, H]."""
    B, Q = tokens.shape
    cfg = drafter.cfg
    kvH, D = cfg.num_kv_heads, cfg.head_dim
    device = features.device
    shape = (2, B, kvH, Q, D)
    cache = torch.zeros(shape, dtype=features.dtype, device=device)
    slot = torch.arange(Q, device=device)
    same = seg.unsqueeze(2) == seg.unsqueeze(1)  # [B, Q, Q]
    causal = same & (slot.view(1, 1, Q) <= slot.view(1, Q, 1))  # [B, Q(query), Q(key)]
    own = torch.eye(Q, dtype=torch.bool, device=device).expand(B, Q, Q)  # chain's own column
    outs: list[torch.Tensor] = []
    ids, feats = tokens, features
    for j in range(depth):
        if j > 0:
            fresh = torch.zeros(shape, dtype=features.dtype, device=device)
            cache = torch.cat([cache, fresh], dim=3)  # [2, B, kvH, (j+1)Q, D]
        mask = torch.cat([causal] + [own] * j, dim=-1).unsqueeze(1)  # [B, 1, Q, (j+1)Q]
        cols = (j * Q + slot).expand(B, Q)  # [B, Q]
        batch = ForwardBatch(
            row_lo=0,
            positions=positions + j,
            write_index=flat_write_index(0, cols.cpu(), kvH, (j + 1) * Q).to(device),
            mask=mask,
            kv_len=(j + 1) * Q,
        )
        out = drafter(ids, feats, batch, (cache[0], cache[1]), fused=j > 0)  # [B, Q, H]
        outs.append(out)
        if j + 1 < depth:
            ids, feats = next_tokens(j + 1, out), out
    return outs


def shift(x: torch.Tensor, j: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x [B, Q, ...] → y with y[:, s] = x[:, s + j] (``fill`` past the end)."""
    if j == 0:
        return x
    pad = torch.full_like(x[:, :j], fill)
    return torch.cat([x[:, j:], pad], dim=1)


def chain_valid(seg: torch.Tensor, j: int) -> torch.Tensor:
    """[B, Q] bool: slot s + j exists and lies in the same segment as slot s."""
    return (shift(seg, j, -1) == seg) & (seg >= 0)
