"""The value object a model forward consumes: which cache rows, which positions, which mask."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

KVLayer = tuple[torch.Tensor, torch.Tensor]  # a layer's K and V caches, each [S, kvH, L+1, D]


@dataclass(frozen=True)
class ForwardBatch:
    """One forward over B cache rows, Q query tokens each (right-padded).

    The KV cache keeps running requests in contiguous rows, so a batch is the row range
    ``[row_lo, row_lo + B)`` and attention reads a view of it, never a gathered copy.

    - ``positions`` [B, Q] long: rotary position of each query token.
    - ``write_index`` [B * kvH * Q] long: flat index into a layer's K (or V) cache viewed as
      [rows * kvH * (max_len + 1), D] for each new (row, kv head, token), in that order.
      Padding tokens point at the scratch column (``max_len``) so they never clobber real
      entries. One ``index_copy_`` per layer writes the step's K/V (advanced-index
      assignment was several times slower on CPU).
    - ``mask`` [B, 1, Q, Kv] bool: True where query may attend key column; every row has at
      least one True so softmax never sees an empty row. None: every query attends all
      ``kv_len`` columns (a decode batch whose sequences have equal length, e.g. batch 1),
      which lets attention skip the mask.
    - ``kv_len``: key columns ``[0, Kv)`` attention reads.
    - ``kv_lens`` [B, Q] long or None: how many keys query j of row b sees (0 for padding
      queries), what the own attention kernel reads instead of the mask. Causal batches
      (decode, chain verification, prefill, drafter catch-up): exactly key columns
      ``[0, kv_lens[b, j])``.
    - ``tree_bits`` [B, Q] long or None: set with ``kv_lens`` for draft trees (tree
      verification, tree drafting). A query with bits != 0 is a tree node: it sees the
      first ``n0 = kv_lens - popcount(bits)`` columns (the committed prefix), then column
      ``n0 + i`` for each set bit i (its ancestors and itself, ascending); its own K/V go to
      the column of its highest bit. The keys a node sees are the keys its token would see
      in plain decoding, in the same order, so the kernel gives it the same bits.
    - ``packed`` [R] long or None: flat indices into the B * Q tokens of the R real ones, set
      when the batch has padding and its maker asked for packing. The model then runs every
      per-token op (embedding, norms, projections, MLP) on the R real tokens only and pads
      just around attention; padding positions of its outputs are zeros. A verify step whose
      rows drafted 4, 1 and 0 tokens computes 8 rows, not 15.
    """

    row_lo: int
    positions: torch.Tensor
    write_index: torch.Tensor
    mask: torch.Tensor | None
    kv_len: int
    kv_lens: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None

    @cached_property
    def kernel_bits(self) -> torch.Tensor:
        """``tree_bits`` flat [B * Q] as the own kernels take them (empty: no tree)."""
        if self.tree_bits is None:
            return torch.empty(0, dtype=torch.long, device=self.positions.device)
        return self.tree_bits.reshape(-1)

    @cached_property
    def slots(self) -> torch.Tensor:
        """[R] long: the slot (b * Q + j) of each token a model computes — the real ones when
        packed, else all B * Q."""
        if self.packed is not None:
            return self.packed
        B, Q = self.positions.shape
        return torch.arange(B * Q, device=self.positions.device)

    @cached_property
    def _sdpa_masks(self) -> dict[tuple[int, torch.dtype], torch.Tensor]:
        return {}

    def sdpa_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as torch's attention takes it when the ``group`` query heads of a KV head
        are folded into the query axis: additive (0 visible, -inf hidden) in the queries'
        dtype, [B, 1, group * Q, Kv] (row g * Q + j: head g's query j), with its rows' stride
        padded to 16 elements. Made once per forward and shared by every layer: a bool mask
        given per call is expanded, converted and (Kv not a multiple of 16) padded again in
        each layer's attention on CUDA."""
        if self.mask is None:
            return None
        key = (group, dtype)
        if key not in self._sdpa_masks:
            B, _, Q, Kv = self.mask.shape
            padded = -(-Kv // 16) * 16
            out = torch.zeros(B, 1, group, Q, padded, dtype=dtype, device=self.mask.device)
            out[..., :Kv].masked_fill_(~self.mask.unsqueeze(2), float("-inf"))  # [B,1,G,Q,Kv]
            self._sdpa_masks[key] = out.view(B, 1, group * Q, padded)[..., :Kv]
        return self._sdpa_masks[key]

    @property
    def batch_size(self) -> int:
        return int(self.positions.shape[0])

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[R, ...] per real token → [B, Q, ...] with zeros at padding (identity if unpacked)."""
        B, Q = self.positions.shape
        return unpack(x, self.packed, B, Q)


def unpack(x: torch.Tensor, packed: torch.Tensor | None, B: int, Q: int) -> torch.Tensor:
    """[R, ...] per real token (``packed`` [R]: their slots among B * Q) → [B, Q, ...] with
    zeros at padding; x itself when ``packed`` is None."""
    if packed is None:
        return x
    full = x.new_zeros(B * Q, *x.shape[1:])  # [B * Q, ...]
    return full.index_copy_(0, packed, x).view(B, Q, *x.shape[1:])


def flat_write_index(
    row_lo: int, write_pos: torch.Tensor, num_kv_heads: int, row_len: int
) -> torch.Tensor:
    """write_pos [B, Q] cache columns → flat indices [B * kvH * Q] (see ForwardBatch)."""
    B, Q = write_pos.shape
    rows = torch.arange(row_lo, row_lo + B).view(B, 1, 1)  # [B, 1, 1]
    heads = torch.arange(num_kv_heads).view(1, num_kv_heads, 1)  # [1, kvH, 1]
    index = (rows * num_kv_heads + heads) * row_len + write_pos.view(B, 1, Q)  # [B, kvH, Q]
    return index.reshape(-1)
