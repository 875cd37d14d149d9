"""Turns a ScheduledBatch into tensors, runs the target, returns last-position logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.scheduler import ScheduledBatch
from tlt_serve.models.batch import ForwardBatch, flat_write_index
from tlt_serve.models.llama import LlamaModel


@dataclass(frozen=True)
class RunOutput:
    logits: torch.Tensor  # [F, V] fp32, last position of each forward request
    hidden: torch.Tensor  # [F, Q, H] final hidden states of all positions (for drafters)


class ModelRunner:
    """Owns the model and its KV cache; mutates only the cache rows a batch names."""

    def __init__(self, model: LlamaModel, kv: KVCache, device: str = "cpu") -> None:
        self.model = model
        self.kv = kv
        self.device = device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunOutput:
        if batch.is_prefill:
            starts, tokens = [0] * len(batch.forward), [r.prompt_ids for r in batch.forward]
        else:
            starts = [r.num_tokens - 1 for r in batch.forward]
            tokens = [[r.last_token] for r in batch.forward]
        fb, input_ids = self.extend_batch(batch.forward[0].row, starts, tokens)
        out = self.model(input_ids, fb, self.kv.layers)
        for src, dst, length in batch.copies:
            self.kv.copy_row(src, dst, length)
        rows = torch.arange(len(tokens), device=self.device)
        last = torch.tensor([len(t) - 1 for t in tokens], device=self.device)
        logits = self.model.logits(out.hidden[rows, last])  # [F, V]
        return RunOutput(logits=logits, hidden=out.hidden)

    def extend_batch(
        self, row_lo: int, starts: list[int], tokens: list[list[int]]
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """Rows ``row_lo..`` get ``tokens[b]`` at positions ``starts[b]..``, attending to
        their first ``starts[b]`` cached columns and causally to each other.

        One form for prefill (start 0), decode (one token) and verification (last token plus
        drafts). Returns the batch and input ids [B, Q], right-padded.
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
        positions = (start + cols).clamp(max=self.kv.max_len - 1)  # [B, Q]
        write_pos = torch.where(real, positions, self.kv.scratch_col)
        end = start.squeeze(1) + lens  # [B] one past each row's last real column
        kv_len = int(end.max())
        mask = None
        if Q > 1 or int(end.min()) != kv_len:
            # Key c is visible to query j of row b when c <= start_b + j and c < end_b
            # (padding columns hidden). Padding queries still see the real keys, so no
            # softmax row is empty.
            key = torch.arange(kv_len).view(1, 1, kv_len)  # [1, 1, Kv]
            causal = key <= (start + cols).unsqueeze(2)  # [B, Q, Kv]
            mask = (causal & (key < end.view(B, 1, 1))).unsqueeze(1)  # [B, 1, Q, Kv]
        fb = self._batch(row_lo, positions, write_pos, mask, kv_len)
        return fb, ids.to(self.device)

    def _batch(
        self,
        row_lo: int,
        positions: torch.Tensor,
        write_pos: torch.Tensor,
        mask: torch.Tensor | None,
        kv_len: int,
    ) -> ForwardBatch:
        kv_heads, row_len = self.kv.storage.shape[3], self.kv.storage.shape[4]
        index = flat_write_index(row_lo, write_pos, kv_heads, row_len)
        d = self.device
        mask = None if mask is None else mask.to(d)
        return ForwardBatch(row_lo, positions.to(d), index.to(d), mask, kv_len)
