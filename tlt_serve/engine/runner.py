"""Turns scheduled work into tensors, runs the target, returns logits and hidden states."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_serve.engine.draft_tree import DraftTree
from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.request import Request
from tlt_serve.engine.scheduler import ScheduledBatch
from tlt_serve.engine.step_graphs import StepGraphs
from tlt_serve.models.batch import ForwardBatch, flat_write_index
from tlt_serve.models.llama import LlamaModel, ModelOutput


@dataclass(frozen=True, eq=False)
class RunOutput:
    """One target forward over F rows of Q query tokens (right-padded).

    ``logits`` [F, V] (plain step: each row's last real position) or [F, Q, V] (verify step:
    every position). ``hidden`` [F, Q, H] final-norm hidden states of all positions;
    ``aux`` the residual stream after each requested layer, [F, Q, H] each (for drafters).
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    aux: tuple[torch.Tensor, ...] = ()


class ModelRunner:
    """Owns the model and its KV cache; mutates only the cache rows a batch names."""

    def __init__(
        self, model: LlamaModel, kv: KVCache, device: str = "cpu", aux_layers: tuple[int, ...] = (),
        graphs: StepGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.aux_layers = aux_layers
        self.graphs = graphs  # decode and chain-verify steps at static shapes (CUDA graphs)

    def _forward(
        self, row_lo: int, starts: list[int], tokens: list[list[int]]
    ) -> tuple[ModelOutput, ForwardBatch | None]:
        """A decode or chain-verify forward: from a static step where one takes it (then no
        batch is returned: nothing is packed), else eagerly on a packed batch."""
        if self.graphs is not None:
            kv_len = max(s + len(t) for s, t in zip(starts, tokens, strict=True))
            shape = self.graphs.shape_of(row_lo, len(tokens), max(map(len, tokens)), kv_len)
            if shape is not None:
                real, ids = extend_batch(self.kv, row_lo, starts, tokens, "cpu")
                return self.graphs.run(shape, real, ids), None
        fb, input_ids = extend_batch(self.kv, row_lo, starts, tokens, self.device, pack=True)
        return self.model(input_ids, fb, self.kv.layers, self.aux_layers), fb

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunOutput:
        """A plain step (decode, prefill, or both in one forward): logits of each forward
        row's last position. A decoding row feeds its last token; a prefilling row its
        prompt from ``cached_tokens`` on (a prefix the prefix cache put in the row is not
        computed again)."""
        d = batch.decodes
        starts = [r.num_tokens - 1 for r in batch.forward[:d]]
        starts += [r.cached_tokens for r in batch.forward[d:]]
        tokens = [[r.last_token] for r in batch.forward[:d]]
        tokens += [r.prompt_ids[r.cached_tokens :] for r in batch.forward[d:]]
        if batch.is_prefill:
            fb, input_ids = extend_batch(
                self.kv, batch.forward[0].row, starts, tokens, self.device, pack=True
            )
            out = self.model(input_ids, fb, self.kv.layers, self.aux_layers)
        else:
            out, _ = self._forward(batch.forward[0].row, starts, tokens)
        for src, dst, length in batch.copies:
            self.kv.copy_row(src, dst, length)
        rows = torch.arange(len(tokens), device=self.device)
        last = torch.tensor([len(t) - 1 for t in tokens], device=self.device)
        logits = self.model.logits(out.hidden[rows, last])  # [F, V]
        return RunOutput(logits=logits, hidden=out.hidden, aux=out.aux)

    @torch.inference_mode()
    def verify_tree(self, reqs: list[Request], trees: list[DraftTree]) -> RunOutput:
        """Score each request's last token plus its draft tree in one forward: logits of
        every node [F, N+1, V] (N = largest tree). KV of node i lands in column
        ``num_tokens - 1 + i``; ``keep_path`` makes the accepted path contiguous."""
        starts = [r.num_tokens - 1 for r in reqs]
        tokens = [[r.last_token, *t.tokens] for r, t in zip(reqs, trees, strict=True)]
        fb, input_ids = extend_batch(
            self.kv, reqs[0].row, starts, tokens, self.device, trees=trees, pack=True
        )
        out = self.model(input_ids, fb, self.kv.layers, self.aux_layers)
        return RunOutput(logits=self._all_logits(out.hidden, fb), hidden=out.hidden, aux=out.aux)

    def _all_logits(self, hidden: torch.Tensor, fb: ForwardBatch | None) -> torch.Tensor:
        """hidden [F, Q, H] → logits [F, Q, V] of every real position (padding: zeros, or
        computed and meaningless when the batch was not packed)."""
        F, Q, H = hidden.shape
        flat = hidden.reshape(F * Q, H)
        if fb is None or fb.packed is None:
            return self.model.logits(flat).view(F, Q, -1)
        return fb.unpack(self.model.logits(flat.index_select(0, fb.packed)))  # [F, Q, V]

    def keep_path(self, req: Request, start: int, path: list[int]) -> None:
        """Move the KV of an accepted tree path (node indices, root first) to the columns
        right after the root: column ``start + j`` gets node ``path[j]``'s entry."""
        if path != list(range(len(path))):
            src = torch.tensor([start + n for n in path[1:]], device=self.kv.storage.device)
            row = self.kv.storage[:, :, req.row]  # [L, 2, kvH, max_len + 1, D] (view)
            row[:, :, :, start + 1 : start + len(path)] = row.index_select(3, src)

    @torch.inference_mode()
    def verify(self, reqs: list[Request], drafts: list[list[int]]) -> RunOutput:
        """Score each request's last token plus its drafts in one forward.

        Row b holds ``[last_token] + drafts[b]`` at positions ``num_tokens - 1 ..``; returns
        logits of every position [F, K+1, V] (K = longest draft; padding positions are
        computed and meaningless). The KV of all positions is written; columns past what
        the caller accepts are simply overwritten later (attention never reads past a
        row's end).
        """
        starts = [r.num_tokens - 1 for r in reqs]
        tokens = [[r.last_token, *d] for r, d in zip(reqs, drafts, strict=True)]
        out, fb = self._forward(reqs[0].row, starts, tokens)
        return RunOutput(logits=self._all_logits(out.hidden, fb), hidden=out.hidden, aux=out.aux)


def extend_batch(
    kv: KVCache,
    row_lo: int,
    starts: list[int],
    tokens: list[list[int]],
    device: str = "cpu",
    trees: list[DraftTree] | None = None,
    pack: bool = False,
) -> tuple[ForwardBatch, torch.Tensor]:
    """Rows ``row_lo..`` of ``kv`` get ``tokens[b]`` in columns ``starts[b]..``, attending
    to their first ``starts[b]`` cached columns and causally to each other.

    One form for prefill (start 0), decode (one token), verification (last token plus
    drafts) and drafter catch-up. With ``trees`` (tree verification: ``tokens[b]`` = root +
    the tree's nodes) token i sits at position ``start + depth(i)`` and attends to its
    ancestors instead of to every earlier token. Returns the batch and input ids [B, Q],
    right-padded. ``pack``: a batch with padding names its real tokens (``packed``), so a
    model computes only those (the caller must then read only real positions).
    """
    B = len(tokens)
    lens = torch.tensor([len(t) for t in tokens])  # [B]
    start = torch.tensor(starts).unsqueeze(1)  # [B, 1]
    Q = int(lens.max())
    ids = torch.zeros(B, Q, dtype=torch.long)  # [B, Q]
    for b, t in enumerate(tokens):
        ids[b, : len(t)] = torch.tensor(t)
    cols = torch.arange(Q).unsqueeze(0)  # [1, Q]
    real = cols < lens.unsqueeze(1)  # [B, Q]
    offsets = cols.expand(B, Q) if trees is None else _depths(trees, Q)  # [B, Q]
    positions = (start + offsets).clamp(max=kv.max_len - 1)  # [B, Q]
    write_pos = torch.where(real, (start + cols).clamp(max=kv.max_len - 1), kv.scratch_col)
    end = start.squeeze(1) + lens  # [B] one past each row's last real column
    kv_len = int(end.max())
    mask = None
    if Q > 1 or int(end.min()) != kv_len:
        # Key c is visible to query j of row b when c <= start_b + j and c < end_b (padding
        # columns hidden). Padding queries still see the real keys, so no softmax row is empty.
        key = torch.arange(kv_len).view(1, 1, kv_len)  # [1, 1, Kv]
        causal = key <= (start + cols).unsqueeze(2)  # [B, Q, Kv]
        mask = causal & (key < end.view(B, 1, 1))  # [B, Q, Kv]
        if trees is not None:
            for b, tree in enumerate(trees):  # own columns: ancestors only
                n, s0 = tree.size + 1, starts[b]
                mask[b, :n, s0 : s0 + n] = tree.ancestor_mask()
        mask = mask.unsqueeze(1)  # [B, 1, Q, Kv]
    kv_heads, row_len = kv.storage.shape[3], kv.storage.shape[4]
    index = flat_write_index(row_lo, write_pos, kv_heads, row_len)
    # [B, Q] keys each query sees: causal rows [0, start_b + j + 1); a tree node its prefix,
    # its ancestors and itself (depth + 1 tree columns, named by tree_bits); padding none.
    kv_lens: torch.Tensor | None = torch.where(real, start + offsets + 1, 0)
    bits = None
    if trees is not None:
        bits = _tree_bits(trees, Q)
        if bits is None or bool((real & (start + cols >= kv.max_len)).any()):
            kv_lens = None  # too large for the kernels' bits, or at the row's end: mask only
    fb = ForwardBatch(
        row_lo,
        positions.to(device),
        index.to(device),
        None if mask is None else mask.to(device),
        kv_len,
        None if kv_lens is None else kv_lens.to(device),
        real.view(-1).nonzero().squeeze(1).to(device) if pack and not bool(real.all()) else None,
        None if bits is None or kv_lens is None else bits.to(device),
    )
    return fb, ids.to(device)


def _tree_bits(trees: list[DraftTree], Q: int) -> torch.Tensor | None:
    """[B, Q] long: bit i of node j's entry set when tree node i is node j or one of its
    ancestors (``ForwardBatch.tree_bits``); padding 0. None past 63 nodes."""
    if Q > 63:
        return None
    out = torch.zeros(len(trees), Q, dtype=torch.long)  # [B, Q]
    for b, tree in enumerate(trees):
        out[b, : tree.size + 1] = torch.tensor(tree.ancestor_bits())
    return out


def _depths(trees: list[DraftTree], Q: int) -> torch.Tensor:
    """[B, Q] depth of each tree node (root 0); padding continues past the last node."""
    out = torch.arange(Q).unsqueeze(0).repeat(len(trees), 1)  # [B, Q]
    for b, tree in enumerate(trees):
        out[b, : tree.size + 1] = torch.tensor(tree.depths())
    return out
