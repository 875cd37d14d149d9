"""Slot-based KV cache, allocated once.

Storage is one tensor [layers, 2, rows, kvH, max_len + 1, D]. Each running sequence owns one
row; the scheduler keeps running sequences in rows 0..N-1 (compacted on finish), so a decode
batch reads a contiguous view and never gathers. Column ``max_len`` is a scratch column that
padding tokens write to. The cache never grows: capacity is ``rows`` sequences of up to
``max_len`` tokens each.

Where a drafter or capture needs the target's features of every position and the prefix cache
is on, ``keep_features`` adds a store [rows, max_len, F] beside the KV: the features of each
position whose KV a row holds, moved and copied with it, so a prompt that reuses a cached
prefix finds that prefix's features too.
"""

from __future__ import annotations

import torch

from tlt_serve.models.arch import ArchConfig


class KVCache:
    def __init__(
        self, cfg: ArchConfig, rows: int, max_len: int, dtype: torch.dtype, device: str = "cpu"
    ) -> None:
        self.rows = rows
        self.max_len = max_len
        shape = (cfg.num_layers, 2, rows, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer (K, V) views [rows, kvH, max_len + 1, D] handed to the model.
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(cfg.num_layers)]
        self.features: torch.Tensor | None = None  # [rows, max_len, F] (keep_features)

    def keep_features(self, dim: int) -> None:
        """Keep ``dim`` features per position beside the KV (see the module's docstring)."""
        s = self.storage
        self.features = torch.zeros(self.rows, self.max_len, dim, dtype=s.dtype, device=s.device)

    @property
    def scratch_col(self) -> int:
        return self.max_len

    def swap_rows(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` columns of rows ``a`` and ``b`` (all layers)."""
        if a != b and length > 0:
            s = self.storage
            s[:, :, [a, b], :, :length] = s[:, :, [b, a], :, :length]  # the right side a copy
            if self.features is not None:
                f = self.features
                f[[a, b], :length] = f[[b, a], :length]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` columns of row ``src`` into row ``dst`` (all layers)."""
        if src != dst and length > 0:
            self.storage[:, :, dst, :, :length] = self.storage[:, :, src, :, :length]
            if self.features is not None:
                self.features[dst, :length] = self.features[src, :length]
