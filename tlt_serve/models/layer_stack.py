"""Every decoder layer of a model in one kernel call, where each layer would take the
whole-layer kernel.

At batch 1 a step's 30 layer calls cost more than their kernels: each gathered its weights
through the module tree, made its views and bound 19 arguments, and that Python ran between
the layers' weight streams (on the 2-vCPU AMX Xeon, the default model's layers took 13.2-14.2
ms a step called one by one and 10.4 ms as back-to-back kernel calls). The stack gathers the
weights once (``models.llama.set_cpu_kernels``; parameters are updated in place, so the
references stay current), plans the step's tokens once, and runs the layers in C++
(``kernels/decoder_layer.cpp``, the GIL released), each exactly as the layer kernel computes
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_serve.kernels import LayerKernel, StackKernel
from tlt_serve.models.batch import ForwardBatch, KVLayer


@dataclass(frozen=True)
class LayerStack:
    kernel: StackKernel
    layer: LayerKernel  # the layer kernel it stands for: only while every layer runs it
    weights: tuple[tuple[torch.Tensor, ...], ...]  # per layer: in norm, qkv, o, post, gate_up, down
    own_rows: tuple[int, ...]  # 4 per layer: the most rows each product takes the own kernel
    eps: float
    num_heads: int
    head_dim: int
    scale: float
    block_queries: int  # rows of this many query tokens on attend by blocks (CpuKernels)

    def run(
        self, x: torch.Tensor, rope: torch.Tensor, batch: ForwardBatch,
        kv_layers: Sequence[KVLayer], aux_layers: Sequence[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x [B, Q, H] (or [R, H]), rope [B, Q, 2, D] → (x after the last layer, x after each
        layer in ``aux_layers``, in layer order), each shaped as x; writes every layer's K/V."""
        assert batch.kv_lens is not None
        B, Q = batch.positions.shape
        H = x.shape[-1]
        aux = [i for i in range(len(self.weights)) if i in aux_layers] if aux_layers else []
        flat = [t for ws, (k, v) in zip(self.weights, kv_layers, strict=True) for t in (*ws, k, v)]
        outs = self.kernel(
            x.reshape(-1, H), flat, self.eps, rope.reshape(B * Q, 2, self.head_dim),
            batch.slots, batch.kv_lens.view(-1), batch.kernel_bits, batch.row_lo, Q,
            self.num_heads, self.scale, self.own_rows, self.block_queries, aux,
        )  # [R, H] each
        return outs[0].view(x.shape), [o.view(x.shape) for o in outs[1:]]
