"""A tree of drafted tokens, as the target scores it in one verify forward.

It holds N draft tokens below a root (the request's last committed token, node 0). Nodes are
numbered 1..N in topological order (every parent before its children); ``parents[i - 1]`` is
node i's parent (0 = the root). Siblings carry distinct tokens. A chain of k drafts is the
tree with parents 0, 1, .., k-1. Node i sits at position ``start + depth(i)`` and attends to
the cached prefix plus its own ancestors (``ancestor_mask``); proposers build trees, the runner
scores them (``runner.extend_batch``), the verifier walks them (``speculative/tree.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [N] token of nodes 1..N
    parents: tuple[int, ...]  # [N] parent node of nodes 1..N (0 = root), parents[i-1] < i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents need one entry per node")
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must precede it")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(range(len(tokens))))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of nodes 0..N (root 0)."""
        d = [0]
        for p in self.parents:
            d.append(d[p] + 1)
        return d

    def children(self) -> list[list[int]]:
        """Children of nodes 0..N, in node order."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents, start=1):
            kids[p].append(i)
        return kids

    def ancestor_bits(self) -> list[int]:
        """Per node 0..N: bit j set when node j is that node or one of its ancestors."""
        bits = [1]  # the root: itself
        for i, p in enumerate(self.parents, start=1):
            bits.append(bits[p] | 1 << i)
        return bits

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool: entry (i, j) True when node j is node i or one of its ancestors."""
        n = self.size + 1
        return torch.tensor([[b >> j & 1 == 1 for j in range(n)] for b in self.ancestor_bits()])
