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
    hidden: torch.Tensor  # [F, Q, H] final hidden states of all positions (capture uses it)


class ModelRunner:
    """Owns the model and its KV cache; mutates only the cache rows a batch names."""

    def __init__(self, model: LlamaModel, kv: KVCache, device: str = "cpu") -> None:
        self.model = model
        self.kv = kv
        self.device = device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunOutput:
        fb, input_ids, last = self._prefill(batch) if batch.is_prefill else self._decode(batch)
        out = self.model(input_ids, fb, self.kv.layers)
        for src, dst, length in batch.copies:
            self.kv.copy_row(src, dst, length)
        rows = torch.arange(len(last), device=self.device)
        logits = self.model.logits(out.hidden[rows, last])  # [F, V]
        return RunOutput(logits=logits, hidden=out.hidden)

    def _prefill(self, batch: ScheduledBatch) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        lens = torch.tensor([len(r.prompt_ids) for r in batch.forward])  # [B]
        Q = int(lens.max())
        ids = torch.zeros(len(lens), Q, dtype=torch.long)  # [B, Q]
        for b, r in enumerate(batch.forward):
            ids[b, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
        cols = torch.arange(Q).unsqueeze(0)  # [1, Q]
        real = cols < lens.unsqueeze(1)  # [B, Q]
        positions = cols.expand(len(lens), Q)
        write_pos = torch.where(real, positions, self.kv.scratch_col)
        # Causal within the prompt; keys past a prompt's end are padding. Padding queries
        # still see the real keys, so no softmax row is empty.
        mask = (cols <= cols.T).unsqueeze(0) & real.unsqueeze(1)  # [B, Q, Q]
        fb = self._batch(batch.forward[0].row, positions, write_pos, mask.unsqueeze(1), Q)
        return fb, ids.to(self.device), (lens - 1).to(self.device)

    def _decode(self, batch: ScheduledBatch) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        pos = torch.tensor([r.num_tokens - 1 for r in batch.forward])  # [B]
        ids = torch.tensor([r.last_token for r in batch.forward]).unsqueeze(1)  # [B, 1]
        kv_len = int(pos.max()) + 1
        mask = None
        if int(pos.min()) + 1 != kv_len:  # unequal lengths: hide each row's future columns
            mask = (torch.arange(kv_len).unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :]
        positions = pos.unsqueeze(1)  # [B, 1]
        fb = self._batch(batch.forward[0].row, positions, positions, mask, kv_len)
        return fb, ids.to(self.device), torch.zeros_like(pos).to(self.device)

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
