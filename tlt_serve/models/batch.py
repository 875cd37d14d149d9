"""The value object a model forward consumes: which cache rows, which positions, which mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """One forward over B cache rows, Q query tokens each (right-padded).

    The KV cache keeps running requests in contiguous rows, so a batch is the row range
    ``[row_lo, row_lo + B)`` and attention reads a view of it, never a gathered copy.

    - ``positions`` [B, Q] long: rotary position of each query token.
    - ``write_pos`` [B, Q] long: cache column each new K/V is written to; padding tokens
      point at the scratch column (index ``max_len``) so they never clobber real entries.
    - ``mask`` [B, 1, Q, Kv] bool: True where query may attend key column; every row has at
      least one True (padding rows attend column 0) so softmax never sees an empty row.
    """

    row_lo: int
    positions: torch.Tensor
    write_pos: torch.Tensor
    mask: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.positions.shape[0])

    @property
    def kv_len(self) -> int:
        return int(self.mask.shape[-1])
