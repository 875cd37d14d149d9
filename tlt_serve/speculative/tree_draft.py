"""Tree drafting with the drafter (EAGLE-2 style dynamic trees), batched over requests.

From the drafter's feature at the root (the last committed token), the top-k tokens become
depth-1 nodes. At each further depth the drafter runs ONE forward over the current frontier
(the k best nodes of the previous depth by cumulative draft log-probability; each attends to
its own ancestors in the drafter's KV), and each frontier node proposes its top-k children.
Finally the ``budget`` best nodes overall by cumulative log-probability form the tree: a
child's score never exceeds its parent's, so the choice is closed under ancestors (enforced
anyway). Siblings carry distinct tokens (top-k of one distribution), as tree verification
requires.

Drafter KV: frontier slot s at depth d writes column ``root + (d - 1) * k + s`` (root = the
request's num_tokens - 1); those columns lie past everything committed and the next catch-up
overwrites them before anything reads them. Columns past the row's end go to the scratch
column (only draft quality can suffer there, never exactness).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_serve.engine.draft_tree import DraftTree
from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.request import Request
from tlt_serve.models.batch import ForwardBatch, flat_write_index
from tlt_serve.speculative.drafter import DrafterModel


@dataclass(frozen=True)
class _Node:
    token: int
    parent: int  # index into the row's node list (0 = root)
    score: float  # cumulative draft log-probability
    depth: int


def expand_tree(
    drafter: DrafterModel,
    kv: KVCache,
    reqs: Sequence[Request],
    root_feature: torch.Tensor,
    depth: int,
    topk: int,
    budgets: Sequence[int],
) -> list[DraftTree]:
    """root_feature [B, H]: drafter output at each request's last committed token.

    ``budgets[b]`` caps row b's nodes and its depth (0: no tree)."""
    B, k = len(reqs), topk
    roots = [r.num_tokens - 1 for r in reqs]
    nodes: list[list[_Node]] = [[_Node(-1, -1, 0.0, 0)] for _ in range(B)]
    logq = torch.log_softmax(drafter.draft_logits(root_feature), dim=-1)  # [B, Vd]
    scores, index = logq.topk(k, dim=-1)  # [B, k]
    tokens, scores_l = drafter.to_token_ids(index).tolist(), scores.tolist()  # [B][k] each
    frontier = []  # [B][k] node ids
    for b in range(B):
        ids = []
        for s in range(k):
            nodes[b].append(_Node(tokens[b][s], 0, scores_l[b][s], 1))
            ids.append(len(nodes[b]) - 1)
        frontier.append(ids)
    feats = root_feature.unsqueeze(1).expand(B, k, -1)  # [B, k, H] parent features
    cols: list[dict[int, int]] = [{} for _ in range(B)]  # node id -> drafter KV column
    for d in range(1, min(depth, max(budgets, default=0))):
        out = _forward_frontier(drafter, kv, reqs, roots, nodes, frontier, feats, cols, d, k)
        logq = torch.log_softmax(drafter.draft_logits(out.reshape(B * k, -1)), dim=-1)
        child_sc, child_ix = logq.view(B, k, -1).topk(k, dim=-1)  # [B, k, k]
        child_tok = drafter.to_token_ids(child_ix).tolist()
        child_sc_l = child_sc.tolist()
        new_frontier, parent_slots = [], []
        for b in range(B):
            cands = []
            for s, parent in enumerate(frontier[b]):
                base = nodes[b][parent].score
                for j in range(k):
                    score = base + child_sc_l[b][s][j]
                    nodes[b].append(_Node(child_tok[b][s][j], parent, score, d + 1))
                    cands.append((nodes[b][-1].score, len(nodes[b]) - 1, s))
            best = sorted(cands, reverse=True)[:k]
            new_frontier.append([c[1] for c in best])
            parent_slots.append([c[2] for c in best])
        slots = torch.tensor(parent_slots, device=out.device)  # [B, k]
        feats = out.gather(1, slots.unsqueeze(2).expand(B, k, out.shape[2]))  # [B, k, H]
        frontier = new_frontier
    return [_select(nodes[b], budgets[b]) for b in range(B)]


def _forward_frontier(
    drafter: DrafterModel,
    kv: KVCache,
    reqs: Sequence[Request],
    roots: list[int],
    nodes: list[list[_Node]],
    frontier: list[list[int]],
    feats: torch.Tensor,
    cols: list[dict[int, int]],
    d: int,
    k: int,
) -> torch.Tensor:
    """Run the depth-d frontier (k nodes per row) through the drafter: [B, k, H]."""
    B = len(reqs)
    scratch = kv.scratch_col
    write = torch.empty(B, k, dtype=torch.long)  # [B, k]
    for b in range(B):
        for s, node in enumerate(frontier[b]):
            col = roots[b] + (d - 1) * k + s
            cols[b][node] = col if col < scratch else scratch
            write[b, s] = cols[b][node]
    kv_len = int(write.max()) + 1
    mask = torch.zeros(B, k, kv_len, dtype=torch.bool)  # [B, k, Kv]
    # The same as tree bits over columns root.. (ForwardBatch.tree_bits), for the own kernels:
    # only while every column is a real one and within 63 of the root.
    bits = torch.zeros(B, k, dtype=torch.long)  # [B, k]
    use_bits = d * k <= 63 and int(write.max()) < scratch
    for b in range(B):
        mask[b, :, : roots[b]] = True  # the committed prefix (pairs 0..root-1)
        for s, node in enumerate(frontier[b]):
            n, row = node, 0
            while n > 0:  # the node itself and its ancestors (all expanded earlier)
                mask[b, s, cols[b][n]] = True
                row |= 1 << (cols[b][n] - roots[b]) if use_bits else 0
                n = nodes[b][n].parent
            bits[b, s] = row
    lens = torch.tensor(roots).unsqueeze(1).repeat(1, k) + d  # [B, k]: prefix + d tree cols
    positions = torch.tensor(roots).unsqueeze(1).expand(B, k) + (d - 1)  # [B, k]
    positions = positions.clamp(max=kv.max_len - 1)
    heads, row_len = kv.storage.shape[3], kv.storage.shape[4]
    device = kv.storage.device
    fb = ForwardBatch(
        reqs[0].row,
        positions.to(device),
        flat_write_index(reqs[0].row, write, heads, row_len).to(device),
        mask.unsqueeze(1).to(device),
        kv_len,
        lens.to(device) if use_bits else None,
        tree_bits=bits.to(device) if use_bits else None,
    )
    ids = torch.tensor([[nodes[b][n].token for n in frontier[b]] for b in range(B)], device=device)
    return drafter(ids, feats.contiguous(), fb, kv.layers[0], fused=True)  # [B, k, H]


def _select(nodes: list[_Node], budget: int) -> DraftTree:
    """The ``budget`` best nodes (depth <= budget), closed under ancestors, as a tree."""
    order = sorted(range(1, len(nodes)), key=lambda i: -nodes[i].score)
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        if nodes[i].depth > budget:
            continue
        chain, n = [], i
        while n > 0 and n not in keep:
            chain.append(n)
            n = nodes[n].parent
        if len(keep) + len(chain) <= budget:
            keep.update(chain)
    ranked = sorted(keep, key=lambda i: (nodes[i].depth, -nodes[i].score))
    new_id = {old: j + 1 for j, old in enumerate(ranked)}
    new_id[0] = 0
    return DraftTree(
        tuple(nodes[i].token for i in ranked), tuple(new_id[nodes[i].parent] for i in ranked)
    )
