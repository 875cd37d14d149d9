"""Draft trees and their lossless verification.

A ``DraftTree`` holds N draft tokens below a root (the request's last committed token, node
0). Nodes are numbered 1..N in topological order (every parent before its children);
``parents[i - 1]`` is node i's parent (0 = the root). Siblings carry distinct tokens. A chain of
k drafts is the tree with parents 0, 1, .., k-1.

The target scores all N + 1 nodes in one forward: node i sits at position ``start + depth(i)``
and attends to the cached prefix plus its own ancestors (``ancestor_mask``). Its KV lands in
column ``start + i``; after acceptance the accepted path's columns are moved to be contiguous.

Acceptance walks down from the root: at each node the target's token is chosen as plain
decoding would choose it there (greedy: the argmax; sampled: a draw from the node's
distribution after temperature / top-k / top-p / min-p, by the sampler's ``inverse_cdf`` with
the row's next uniform), emitted, and the walk follows the child that drafted that token; the
first token no child drafted is the correction (or the bonus at a leaf). Every emitted token
is the target's own draw, so the output is plain decoding's given the same uniforms (drafts
are deterministic: tokens, not distributions). A child is followed with probability p(its
token), as with recursive rejection sampling (SpecInfer / EAGLE) against one-hot drafts. A
chain is the one-child case, where this is the chain verifier's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tlt_serve.engine.draft_tree import DraftTree
from tlt_serve.engine.sampler import greedy_tokens
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative.verify import VerifyResult, drawer, row_generator, target_logprobs


def verify_tree(
    logits: torch.Tensor,
    trees: Sequence[DraftTree],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    shared: torch.Generator | None = None,
) -> tuple[VerifyResult, list[list[int]]]:
    """Accept a root-to-node path of each row's tree.

    logits [B, Q, V] fp32: row b's node i at index i (Q >= size + 1; the rest is padding).
    Returns the VerifyResult (accepted drafts, emitted tokens = path tokens + correction /
    bonus, target logprobs) and each row's accepted path as node indices, root first
    (``path[b][j]`` is the node whose logits produced emitted token j). Full-vocabulary work
    is done only at the nodes the walk reaches.
    """
    greedy = [b for b, p in enumerate(params) if p.greedy]
    argmax = dict(zip(greedy, greedy_tokens(logits[greedy]).tolist(), strict=True)) if greedy \
        else {}
    paths, tokens = [], []
    for b, tree in enumerate(trees):
        if b in argmax:
            choose: Callable[[int], int] = argmax[b].__getitem__
        else:
            choose = drawer(logits[b], params[b], row_generator(generators, shared, b))
        path, emitted = _walk(tree, choose)
        paths.append(path)
        tokens.append(emitted)
    logprobs, tops = target_logprobs(logits, params, paths, tokens)
    counts = [len(path) - 1 for path in paths]
    return VerifyResult(counts, tokens, logprobs, tops), paths


def _walk(tree: DraftTree, choose: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """From the root: emit the target's token at the node (``choose``), follow the child that
    drafted it, stop where none did. Returns the path (node indices) and the emitted tokens."""
    kids = tree.children()
    node, path, emitted = 0, [0], []
    while True:
        want = choose(node)
        emitted.append(want)
        nxt = next((c for c in kids[node] if tree.tokens[c - 1] == want), None)
        if nxt is None:
            return path, emitted
        node = nxt
        path.append(node)
