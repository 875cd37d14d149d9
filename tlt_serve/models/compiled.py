"""Decoder layers with their small ops fused by torch.compile, for the static steps that CUDA
graphs replay.

Replayed from a CUDA graph, a decode step at batch 1 costs what its kernels run, and most of
its kernels are small: per layer, besides four products and attention, a norm, the q/k norms,
the rotation, the layout copies around attention, the residual adds and the gate, each its own
kernel of a few microseconds. ``CompiledLayers`` runs each layer as two compiled regions
around the attention (``layer_in``: the input norm, the q/k/v product, the q/k norms, the
rotation, the layouts attention takes; ``layer_out``: the output product, the residual, the
norm, the MLP), where Inductor fuses the small ops into a few kernels; the cache write and
the attention (torch's, or with ``attention="triton"`` the own kernel of
``kernels/decode_attention.py``) run between them.

The regions take the layer module as an argument, so every layer of a model (same shapes)
shares one compiled graph per step shape. Only unpacked, causal batches from row 0 (the
static steps) come here; anything else goes to the layer's own forward. The same code
uncompiled (``compile=False``) is what the CPU tests hold the compiled regions to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tlt_serve.models.batch import ForwardBatch, KVLayer
from tlt_serve.models.llama import DecoderLayer


def layer_in(
    layer: DecoderLayer, x: torch.Tensor, rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, Q, H], rope [B, Q, 2, D] → q folded [B, kvH, G * Q, D] (``Attention.fold``), k
    and v [B, kvH, Q, D], contiguous (the cache's layout)."""
    attn = layer.self_attn
    q, k, v = attn.project(layer.input_layernorm(x), rope, None)
    return attn.fold(q), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def layer_out(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [B, Q, H] (the layer's input), attention's output folded [B, kvH, G * Q, D] → the
    layer's output [B, Q, H]."""
    attn = layer.self_attn
    x = x + attn.output(attn.unfold(out), None)
    return x + layer.mlp(layer.post_attention_layernorm(x))


class CompiledLayers:
    """A layer hook for ``LlamaModel.forward``: each layer of a static step through the two
    compiled regions (or, ``compile=False``, the same regions eagerly)."""

    def __init__(self, compile: bool = True, attention: str = "sdpa") -> None:
        """``attention``: ``sdpa`` (torch's) or ``triton`` (``kernels.decode_attention``, for
        batches that name each query's keys, ``kv_lens``, at head sizes it takes)."""
        self.attention = attention
        wrap: Callable[[Any], Any] = _compiled if compile else (lambda f: f)
        self.layer_in = wrap(layer_in)
        self.layer_out = wrap(layer_out)

    def __call__(
        self, layer: DecoderLayer, x: torch.Tensor, rope: torch.Tensor, batch: ForwardBatch,
        kv: KVLayer,
    ) -> torch.Tensor:
        if batch.packed is not None or batch.tree_bits is not None:  # not a static step
            return layer(x, rope, batch, kv)  # type: ignore[no-any-return]
        attn = layer.self_attn
        q, k, v = self.layer_in(layer, x, rope)  # [B, kvH, G * Q, D], [B, kvH, Q, D] x 2
        attn.write(k.transpose(1, 2), v.transpose(1, 2), batch.write_index, kv)
        out = self._attend(layer, q, kv, batch)  # [B, kvH, G * Q, D]
        return self.layer_out(layer, x, out)  # type: ignore[no-any-return]

    def _attend(self, layer: DecoderLayer, q: torch.Tensor, kv: KVLayer,
                batch: ForwardBatch) -> torch.Tensor:
        """q folded [B, kvH, G * Q, D] over the cache → [B, kvH, G * Q, D]."""
        attn = layer.self_attn
        if self.attention == "triton" and batch.kv_lens is not None:
            from tlt_serve.kernels import decode_attention as kernel  # imports Triton

            if kernel.fits(q.shape[-1], q.shape[2]):
                return kernel.decode_attention(q, kv[0], kv[1], batch.row_lo, batch.kv_lens,
                                               batch.kv_len, attn.scale)
        mask = batch.sdpa_mask(attn.group, q.dtype)  # made once per batch, for all layers
        return attn.sdpa(q, kv, batch.row_lo, batch.kv_len, mask)


# Graphs a region may hold: one per step shape until dynamo makes the batch and query axes
# symbolic (a handful), times the model shapes a process runs (benchmarks run several; past
# torch's default of 8 a region would silently run uncompiled)
RECOMPILE_LIMIT = 64


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch({name: RECOMPILE_LIMIT})(torch.compile(fn))  # type: ignore[no-any-return]
