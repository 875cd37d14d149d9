"""The target's decode and chain-verify steps at static shapes, replayed from CUDA graphs.

On a GPU a small step is bound by launching kernels, not by running them: a step of a 1.7B
model at batch 1 launches about a thousand. A CUDA graph replays them as one launch, but a
graph replays fixed shapes and fixed addresses, so a step is given one here:

- the batch is padded to the next of ``BATCH_SIZES`` (rows ``0 .. B``: the scheduler keeps
  running sequences in rows 0..N-1); padding rows write only their scratch column and
  attend only column 0, and their outputs are dropped;
- the keys attended are padded to the next power of two (at least ``MIN_KEYS``, at most the
  row length) and hidden by the mask past each row's end, so a handful of graphs serve every
  context length, reading at most twice the keys;
- the query length (1 + drafts) is kept exactly;
- inputs are copied into the graph's own buffers before each replay, outputs copied out.

With ``compile=True`` each layer of a static step runs through ``CompiledLayers`` (its small
ops fused by torch.compile), with ``attention="triton"`` attending through the own Triton
kernel (``kernels/decode_attention.py``: each query over its own row's length, read from
``lens``, no mask); where either fails (no compiler, say) the steps go without it, with a
warning.
Every batch size is captured at start (``warm``); other shapes the first time they are
needed (all graphs share one memory pool).
Prefill, draft trees and batches not starting at row 0 or larger than the largest size run
eagerly. With ``capture=False`` the same padded steps run eagerly: how the CPU tests check
that the padding changes no real row's output.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import torch

from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.models.batch import ForwardBatch, flat_write_index
from tlt_serve.models.compiled import CompiledLayers
from tlt_serve.models.llama import LayerFn, LlamaModel, ModelOutput

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KEYS = 64


@dataclass(frozen=True)
class StepShape:
    batch: int  # rows, padded
    queries: int  # tokens per row (1: decode; 1 + drafts: verify)
    keys: int  # key columns attended, padded


class StaticStep:
    """One step shape: its input buffers, its forward (captured or eager) and its outputs."""

    def __init__(self, shape: StepShape, model: LlamaModel, kv: KVCache,
                 aux_layers: tuple[int, ...], capture: bool, pool: Any,
                 layer_fn: LayerFn | None = None) -> None:
        Bp, Q, K = shape.batch, shape.queries, shape.keys
        device = kv.storage.device
        self.shape, self.model, self.kv, self.aux_layers = shape, model, kv, aux_layers
        self.layer_fn = layer_fn
        kv_heads, row_len = kv.storage.shape[3], kv.storage.shape[4]
        scratch = torch.full((Bp, Q), kv.scratch_col, dtype=torch.long, device="cpu")  # [Bp, Q]
        # [Bp, kvH * Q]: each padding row writes its own scratch column only
        self.pad_index = flat_write_index(0, scratch, kv_heads, row_len).view(Bp, -1).to(device)
        self.pad_mask = torch.zeros(1, Q, K, dtype=torch.bool, device=device)  # [1, Q, K]
        self.pad_mask[..., 0] = True  # a padding query sees column 0: no empty softmax row
        self.ids = torch.zeros(Bp, Q, dtype=torch.long, device=device)  # [Bp, Q]
        self.positions = torch.zeros(Bp, Q, dtype=torch.long, device=device)  # [Bp, Q]
        self.write_index = self.pad_index.clone()  # [Bp, kvH * Q]
        self.mask = self.pad_mask.expand(Bp, Q, K).clone().unsqueeze(1)  # [Bp, 1, Q, K]
        self.lens = torch.ones(Bp, Q, dtype=torch.long, device=device)  # [Bp, Q] keys seen
        self.graph: Any = None
        self.out: ModelOutput | None = None
        if capture:
            self._capture(pool)
        else:  # what capturing runs first (compiling, where layers compile): it fails here
            self._forward()

    def _forward(self) -> ModelOutput:
        # a new batch each time: what it derives once per forward (the attention mask as
        # torch's attention takes it) is derived again from the buffers, or captured
        batch = ForwardBatch(0, self.positions, self.write_index.view(-1), self.mask,
                             self.shape.keys, self.lens)
        out: ModelOutput = self.model(self.ids, batch, self.kv.layers, self.aux_layers,
                                      self.layer_fn)
        return out

    def _capture(self, pool: Any) -> None:
        """Warm up on a side stream (the allocator, the libraries' workspaces), then capture.
        The warm-up writes the K/V that the first replay writes again, with the same values."""
        side = torch.cuda.Stream(self.ids.device)
        side.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.cuda.stream(side):
            self._forward()
        torch.cuda.current_stream(self.ids.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(self.graph, pool=pool):
            self.out = self._forward()

    def run(self, real: ForwardBatch, ids: torch.Tensor) -> ModelOutput:
        """``real``, ``ids`` [B, Q] (host tensors, unpacked): copy them in, step, copy the B
        real rows' outputs out."""
        B, Q = ids.shape
        kv_len, K = real.kv_len, self.shape.keys
        self.ids[:B].copy_(ids, non_blocking=True)
        self.ids[B:].zero_()
        self.positions[:B].copy_(real.positions, non_blocking=True)
        self.positions[B:].zero_()
        self.write_index[:B].copy_(real.write_index.view(B, -1), non_blocking=True)
        self.write_index[B:].copy_(self.pad_index[B:])
        if real.mask is None:  # every row sees all kv_len columns
            self.mask[:B, :, :, :kv_len] = True
        else:
            self.mask[:B, :, :, :kv_len].copy_(real.mask, non_blocking=True)
        self.mask[:B, :, :, kv_len:K] = False
        self.mask[B:] = self.pad_mask
        assert real.kv_lens is not None  # a causal batch's lengths (no draft trees come here)
        self.lens[:B].copy_(real.kv_lens, non_blocking=True)  # what the mask shows, as lengths
        self.lens[B:] = 1
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self._forward()
        assert out is not None
        # the graph's outputs are overwritten by its next replay: hand out copies
        return ModelOutput(out.hidden[:B].clone(), tuple(a[:B].clone() for a in out.aux))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off for a capture: an object it frees then (an engine of
    the past and its graphs) frees CUDA memory or destroys a graph, which a stream that is
    capturing refuses, and the capture fails."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class StepGraphs:
    """The runner's static steps by shape; ``run`` answers None for a step it does not take."""

    def __init__(self, model: LlamaModel, kv: KVCache, aux_layers: Sequence[int] = (),
                 capture: bool = True, max_batch: int = BATCH_SIZES[-1],
                 compile: bool = False, attention: str = "sdpa") -> None:
        self.model, self.kv, self.aux_layers = model, kv, tuple(aux_layers)
        self.capture = capture
        if attention == "triton" and find_spec("triton") is None:
            log.warning("attention backend triton: Triton is not installed; torch's instead")
            attention = "sdpa"
        self.layer_fn: CompiledLayers | None = (
            CompiledLayers(attention=attention) if compile else None)
        self.sizes = [b for b in BATCH_SIZES if b <= min(max_batch, kv.rows)]
        self.steps: dict[StepShape, StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def shape_of(self, row_lo: int, batch: int, queries: int, kv_len: int) -> StepShape | None:
        """The static shape a step of ``batch`` rows from ``row_lo``, ``queries`` tokens each,
        attending up to ``kv_len`` columns runs at; None: it runs eagerly."""
        row_len = int(self.kv.storage.shape[4])
        if row_lo != 0 or not self.sizes or batch > self.sizes[-1] or kv_len > row_len:
            return None
        padded = next(s for s in self.sizes if s >= batch)
        keys = min(max(MIN_KEYS, 1 << (kv_len - 1).bit_length()), row_len)
        return StepShape(padded, queries, keys)

    def run(self, shape: StepShape, real: ForwardBatch, ids: torch.Tensor) -> ModelOutput:
        """The forward of ``real`` / ``ids`` [B, Q] (host tensors, unpacked, as
        ``extend_batch`` makes them) at ``shape``, its graph captured on first use."""
        step = self.steps.get(shape)
        if step is None:
            step = self.steps[shape] = self._new_step(shape)
        return step.run(real, ids)

    def _new_step(self, shape: StepShape) -> StaticStep:
        try:
            return StaticStep(shape, self.model, self.kv, self.aux_layers, self.capture,
                              self.pool, self.layer_fn)
        except Exception as err:  # noqa: BLE001 - the kernel and compiling are optimisations
            if self.layer_fn is None:
                raise
            # What failed is dropped, the Triton attention first, then the compiled layers;
            # a failed warm-up wrote only the K/V its step writes again.
            fn, what = self.layer_fn, "the Triton attention"
            if fn.attention == "triton":
                fn.attention = "sdpa"
            else:
                self.layer_fn, what = None, "compiled decoder layers"
            log.warning("%s failed (%s: %s); static steps go without", what,
                        type(err).__name__, str(err).splitlines()[0])
            self.steps.clear()
            if self.pool is not None:
                self.pool = torch.cuda.graph_pool_handle()
            return self._new_step(shape)

    def warm(self, queries: Sequence[int]) -> None:
        """Capture (and compile) the steps of every batch size for each query length in
        ``queries`` at the fewest keys, before serving asks for them: their first use would
        otherwise wait for it. A step captured this way writes only padding rows' scratch
        columns."""
        for q in queries:
            for b in self.sizes:
                shape = StepShape(b, q, min(MIN_KEYS, int(self.kv.storage.shape[4])))
                if shape not in self.steps:
                    self.steps[shape] = self._new_step(shape)

    def clear(self) -> None:
        self.steps.clear()
