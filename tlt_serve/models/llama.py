"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm, SmolLM2).

Plain PyTorch, written for a batch of cache rows (see ``ForwardBatch``). q/k/v and gate/up
projections are fused into one matmul each: at batch 1 on CPU a step is overhead-bound, so
fewer, larger kernels matter. GQA is computed without expanding K/V: the G query heads that
share a KV head are folded into the query-length axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tlt_serve.kernels import (
    ATTENTION_QUERIES,
    DOT_HEAD_DIMS,
    EVERY_ROW,
    MATVEC_ROWS,
    CpuKernels,
    LayerKernel,
    MatVec,
    NormKernel,
    RowAttention,
    RowWrite,
)
from tlt_serve.models.arch import ArchConfig
from tlt_serve.models.batch import ForwardBatch, KVLayer, unpack
from tlt_serve.models.layer_stack import LayerStack
from tlt_serve.models.rope import apply_rope, cos_sin_table

# (layer, x, rope, batch, kv) → x': how ``LlamaModel.forward`` may run a layer
LayerFn = Callable[["DecoderLayer", torch.Tensor, torch.Tensor, ForwardBatch, KVLayer],
                   torch.Tensor]
# Without bf16 GEMM units, up to this many rows (decode and verify batches) the own bf16
# kernel multiplies; more rows (prefill) go to the fp32 GEMM (see ``Linear``). Measured on an
# AVX2 host on the default model's projections: the kernel is 3-6x faster at 1-16 rows, 1.3x
# at 64, even at 128, slower above. With bf16 GEMM units: ``CpuKernels.matvec_rows``.


class Linear(nn.Linear):
    """nn.Linear with the own bf16 kernel for up to MATVEC_ROWS rows and an optional fp32
    copy of its weight for larger products.

    On CPUs without bf16 matrix units (AVX2 only) torch has no bf16 GEMM: it runs one
    matrix-vector product per row, ~7x slower than fp32 GEMM at M = 64 (measured here). Up to
    MATVEC_ROWS rows (decode, verify) the own AVX2 kernel (``matvec``) multiplies the bf16
    weight, read from memory once for all rows. More rows (prefill) multiply in fp32 against
    the same (bf16-valued) weights, accumulating in fp32 as a native bf16 GEMM would.
    """

    weight_f32: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_f32", None, persistent=False)
        self.matvec: MatVec | None = None  # own bf16 kernel for up to matvec_rows rows
        self.matvec_rows = MATVEC_ROWS  # set with the kernel (fewer where torch has bf16 GEMM)

    def _own_kernel(self, rows: int) -> MatVec | None:
        """The own kernel where it takes ``rows`` rows. It has no backward: only for products
        nothing differentiates (serving)."""
        if 1 <= rows <= self.matvec_rows and not torch.is_grad_enabled():
            return self.matvec
        return None

    def rounds_to_bf16(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether the product of ``rows`` rows of ``dtype`` is torch's bf16 GEMM, whose
        output is rounded to bf16 whatever ``out_dtype`` asks (widened after)."""
        return (dtype == self.weight.dtype == torch.bfloat16 and self.bias is None
                and self._own_kernel(rows) is None and (self.weight_f32 is None or rows == 1))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        rows = x.numel() // x.shape[-1]
        if (matvec := self._own_kernel(rows)) is not None:
            x2 = x.reshape(rows, -1)  # [rows, K], widened to fp32 in the kernel
            if self.bias is None:  # rounded to out_dtype in the kernel when that is bf16
                y = matvec(self.weight, x2, out_dtype == torch.bfloat16)  # [rows, N]
                y = y.view(*x.shape[:-1], -1)
                return y if y.dtype == out_dtype else y.to(out_dtype)
            y = matvec(self.weight, x2, False) + self.bias.float()  # [rows, N] fp32
            return y.view(*x.shape[:-1], -1).to(out_dtype)
        if self.weight_f32 is not None and x.numel() > x.shape[-1]:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight_f32, bias).to(out_dtype)
        return F.linear(x, self.weight, self.bias).to(out_dtype)

    def set_fp32_copy(self, enabled: bool) -> None:
        self.weight_f32 = self.weight.detach().float() if enabled else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel: NormKernel | None = None  # own bf16 kernel (serving only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.kernel is not None
            and x.dtype == torch.bfloat16 == self.weight.dtype
            and x.is_contiguous()
            and not torch.is_grad_enabled()
        ):
            # HF's order and rounding (normalise in fp32, round, scale, round) in one pass:
            # 4 vs 50 us at one row here, where torch runs seven ops for bf16 input.
            return self.kernel(x, self.weight, self.eps)
        # One fused op (accumulates in fp32 for bf16 input); at batch 1 a step is dominated
        # by per-op overhead, and HF's four-op form (upcast, norm, downcast, scale) costs more.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.kernel: RowAttention | None = None  # own bf16 kernel (serving only)
        self.kernel_queries = ATTENTION_QUERIES  # most query tokens per row it takes
        self.block_queries = EVERY_ROW  # rows of this many tokens on go by blocks (its kernel)
        self.write_rows: RowWrite | None = None  # own cache write (serving only)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, batch: ForwardBatch, kv: KVLayer
    ) -> torch.Tensor:
        """x [B, Q, H] (or [R, H] real tokens, ``batch.packed``), normed → [B, Q, H] (or
        [R, H]); writes the step's K/V into the rows ``batch`` names."""
        q, k, v = self.project(x, rope, batch.packed)
        self.write(k, v, batch.write_index, kv)
        lens = _kernel_lens(batch, q, kv[0], self.kernel_queries)  # [B, Q] or None
        if self.kernel is not None and lens is not None:
            # Query j of row b attends its kv_lens[b, j] keys (columns [0, kv_lens), or a tree
            # node's prefix + ancestors): no mask, no view, one call (24 vs 50-75 us for
            # torch's SDPA at batch 1 and 300 cached tokens here), and a token gets the same
            # output in a verify step (chain or tree) as in a decode step.
            B, Q = q.shape[:2]
            q5 = q.reshape(B, Q, self.cfg.num_kv_heads, self.group, self.cfg.head_dim)
            out = self.kernel(q5, kv[0], kv[1], batch.row_lo, lens, batch.kernel_bits,
                              self.scale, self.block_queries)
            out = out.view(B, Q, self.cfg.q_size)  # [B, Q, kvH * G * D]
        else:
            out = self.attend(q, kv, batch.row_lo, batch.kv_len, batch.sdpa_mask(self.group,
                                                                                 q.dtype))
        return self.output(out, batch.packed)

    def project(
        self, x: torch.Tensor, rope: torch.Tensor, packed: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, Q, H] or [R, H] (``packed``), rope [B, Q, 2, D] → q [B, Q, kvH * G, D] (the
        G query heads of each KV head together), k, v [B, Q, kvH, D]: the projections, the
        q/k norms and the rotation."""
        cfg = self.cfg
        B, Q = rope.shape[:2]
        D, kvH, G = cfg.head_dim, cfg.num_kv_heads, self.group
        qkv = unpack(self.qkv_proj(x), packed, B, Q)  # [B, Q, q + 2 kv]
        qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = qk.view(B, Q, kvH * G + kvH, D)  # q heads then k heads
        if cfg.qk_norm:
            q, k = qk.split([kvH * G, kvH], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        cos, sin = rope[:, :, 0:1], rope[:, :, 1:2]  # [B, Q, 1, D] each
        q, k = apply_rope(qk, cos, sin).split([kvH * G, kvH], dim=2)  # one rotation for both
        return q, k, v.view(B, Q, kvH, D)

    def write(self, k: torch.Tensor, v: torch.Tensor, write_index: torch.Tensor,
              kv: KVLayer) -> None:
        """This step's K/V [B, Q, kvH, D] into the cache: as [B, kvH, Q, D], rows of the flat
        cache [S * kvH * (L + 1), D] at ``write_index`` (``ForwardBatch``); by the own row copy
        where it is set (the same bytes as torch's index_copy_)."""
        D = k.shape[-1]
        # The kernel has no backward: only for writes nothing differentiates (serving).
        own = None if torch.is_grad_enabled() else self.write_rows
        for cache, step in zip(kv, (k, v), strict=True):
            rows = step.transpose(1, 2).reshape(-1, D)  # [R, D]
            if own is not None:
                own(cache.view(-1, D), write_index, rows)
            else:
                cache.view(-1, D).index_copy_(0, write_index, rows)

    def fold(self, q: torch.Tensor) -> torch.Tensor:
        """[B, Q, kvH * G, D] → [B, kvH, G * Q, D]: the G query heads of each KV head folded
        into the length axis (GQA without expanding K/V)."""
        B, Q = q.shape[:2]
        kvH, G, D = self.cfg.num_kv_heads, self.group, self.cfg.head_dim
        return q.reshape(B, Q, kvH, G, D).permute(0, 2, 3, 1, 4).reshape(B, kvH, G * Q, D)

    def attend(
        self, q: torch.Tensor, kv: KVLayer, row_lo: int, kv_len: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """torch's attention of q [B, Q, kvH * G, D] over key columns [0, kv_len) of cache
        rows [row_lo, row_lo + B), ``mask`` [B, 1, G * Q, kv_len] additive
        (``ForwardBatch.sdpa_mask``) or None → [B, Q, kvH * G * D]."""
        return self.unfold(self.sdpa(self.fold(q), kv, row_lo, kv_len, mask))

    def sdpa(
        self, q: torch.Tensor, kv: KVLayer, row_lo: int, kv_len: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``attend`` of q folded [B, kvH, G * Q, D] → [B, kvH, G * Q, D] (folded)."""
        rows = slice(row_lo, row_lo + q.shape[0])
        keys = kv[0][rows, :, :kv_len]  # [B, kvH, Kv, D] (view)
        values = kv[1][rows, :, :kv_len]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)

    def unfold(self, out: torch.Tensor) -> torch.Tensor:
        """[B, kvH, G * Q, D] → [B, Q, kvH * G * D] (``fold`` undone, heads flattened)."""
        B, kvH, GQ, D = out.shape
        Q = GQ // self.group
        return out.view(B, kvH, self.group, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, -1)

    def output(self, out: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
        """Attention's output [B, Q, kvH * G * D] → o_proj [B, Q, H], or [R, H] for the real
        tokens (``packed``)."""
        B, Q = out.shape[:2]
        if packed is not None:
            out = out.view(B * Q, -1).index_select(0, packed)  # [R, q]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.input_layernorm: nn.Module = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.kernel: LayerKernel | None = None  # the whole layer in one call (serving only)
        self.kernel_rows = MATVEC_ROWS  # most tokens it takes (``CpuKernels.layer_rows``)
        # the most rows the own product takes for qkv, o, gate_up, down (more: torch's)
        self.product_rows = [MATVEC_ROWS] * 4

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, batch: ForwardBatch, kv: KVLayer
    ) -> torch.Tensor:
        """x [B, Q, H] (or [R, H] real tokens), rope [B, Q, 2, D] (cos, sin) → x'."""
        if self._kernel_fits(x, batch, kv):
            return self._kernel_forward(x, rope, batch, kv)
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _kernel_fits(self, x: torch.Tensor, batch: ForwardBatch, kv: KVLayer) -> bool:
        """Whether the whole-layer kernel takes this step: up to ``kernel_rows`` tokens, or
        more where at least half the batch's slots are padding (rows of one token beside a
        prompt: a mixed step), which op by op would rotate, write and attend padded."""
        rows = x.numel() // x.shape[-1]
        return (
            self.kernel is not None
            and _kernel_lens(batch, x, kv[0], self.self_attn.kernel_queries) is not None
            and (rows <= self.kernel_rows or batch.positions.numel() >= 2 * rows)
            # its torch products are bf16 GEMMs: none where Linear multiplies an fp32 copy
            and (rows <= min(self.product_rows) or self.mlp.down_proj.weight_f32 is None)
            and self.post_attention_layernorm.weight.dtype == torch.bfloat16
        )

    def _kernel_forward(
        self, x: torch.Tensor, rope: torch.Tensor, batch: ForwardBatch, kv: KVLayer
    ) -> torch.Tensor:
        """The same layer as ``forward``'s op-by-op path, same bits, in one call: at batch 1
        the ~35 torch ops around a layer's four products cost about what the products do."""
        assert self.kernel is not None and batch.kv_lens is not None
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        norm = self.input_layernorm
        in_norm = norm.weight if isinstance(norm, RMSNorm) else x.new_empty(0)  # empty: identity
        B, Q = batch.positions.shape
        H, D = x.shape[-1], attn.cfg.head_dim
        out = self.kernel(
            x.reshape(-1, H), in_norm, attn.qkv_proj.weight, attn.o_proj.weight, post.weight,
            mlp.gate_up_proj.weight, mlp.down_proj.weight, post.eps, kv[0], kv[1],
            rope.reshape(B * Q, 2, D), batch.slots, batch.kv_lens.view(-1), batch.kernel_bits,
            batch.row_lo, Q,
            attn.cfg.num_heads, attn.scale, self.product_rows, attn.block_queries,
        )  # [R, H]
        return out.view(x.shape)


def _kernel_lens(
    batch: ForwardBatch, x: torch.Tensor, cache: torch.Tensor, max_queries: int
) -> torch.Tensor | None:
    """``batch.kv_lens`` [B, Q] when the own row kernels (attention, whole layer) take this
    batch, else None: rows (causal, or tree nodes with ``tree_bits``) of at most
    ``max_queries`` tokens (``CpuKernels.attention_queries``), bf16 activations and cache, no
    autograd (the kernels have no backward)."""
    takes = (
        batch.positions.shape[1] <= max_queries
        and x.dtype == cache.dtype == torch.bfloat16
        and not torch.is_grad_enabled()
    )
    return batch.kv_lens if takes else None


@dataclass(frozen=True)
class ModelOutput:
    hidden: torch.Tensor  # [B, Q, H] after the final norm (what lm_head reads)
    aux: tuple[torch.Tensor, ...]  # [B, Q, H] residual stream after each requested layer


class LlamaModel(nn.Module):
    """Decoder stack + head. Mutates only the KV cache rows named by the batch."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer(
            "rope_table", cos_sin_table(cfg.rope, cfg.head_dim, max_positions), persistent=False
        )
        self.kernels: CpuKernels | None = None  # the own kernels in use (set_cpu_kernels)
        self.stack: LayerStack | None = None  # every layer in one call (set_cpu_kernels)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        kv_layers: Sequence[KVLayer],
        aux_layers: Sequence[int] = (),
        layer_fn: LayerFn | None = None,
    ) -> ModelOutput:
        """input_ids [B, Q] → hidden [B, Q, H]; writes the new K/V of every layer. With
        ``batch.packed`` the layers run on the real tokens only ([R, H]) and padding
        positions of the outputs are zeros. ``layer_fn(layer, x, rope, batch, kv)`` runs
        each layer in place of its own forward (``compiled.CompiledLayers``)."""
        if batch.packed is not None:
            x = self.embed_tokens(input_ids.view(-1).index_select(0, batch.packed))  # [R, H]
        else:
            x = self.embed_tokens(input_ids)  # [B, Q, H]
        table: torch.Tensor = self.rope_table  # type: ignore[assignment]  # a registered buffer
        rope = table[batch.positions].to(x.dtype)  # [B, Q, 2, D] (cos, sin)
        if layer_fn is None and self._stack_fits(x, batch, kv_layers):
            assert self.stack is not None
            x, aux = self.stack.run(x, rope, batch, kv_layers, aux_layers)
        else:
            aux = []
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, DecoderLayer)
                run = layer if layer_fn is None else partial(layer_fn, layer)
                x = run(x, rope, batch, kv_layers[i])
                if i in aux_layers:
                    aux.append(x)
        return ModelOutput(
            hidden=batch.unpack(self.norm(x)), aux=tuple(batch.unpack(a) for a in aux)
        )

    def _stack_fits(
        self, x: torch.Tensor, batch: ForwardBatch, kv_layers: Sequence[KVLayer]
    ) -> bool:
        """Whether every layer takes the whole-layer kernel this step (they are alike: one
        decides for all), which the stack then runs in one call."""
        if self.stack is None:
            return False
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        return first.kernel is self.stack.layer and first._kernel_fits(x, batch, kv_layers[0])

    def packed_queries(self) -> int:
        """The most query tokens per row a step runs packed end to end (the whole-layer
        kernel rotates, writes and attends the real tokens only); 0 where the layers pad
        around attention (torch's ops: fp32, no own kernels)."""
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer.self_attn.kernel_queries if layer.kernel is not None else 0

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] → logits [N, V] in fp32. With ``out`` (bf16 [>= N, V]), where the
        head's product rounds to bf16 anyway (``Linear.rounds_to_bf16``), its first N rows
        instead: the same values, not widened, and no new [N, V] tensor."""
        if out is not None and self.lm_head.rounds_to_bf16(hidden.shape[0], hidden.dtype):
            return torch.mm(hidden, self.lm_head.weight.t(), out=out[: hidden.shape[0]])
        return self.lm_head(hidden, out_dtype=torch.float32)

    def set_fp32_batch_matmul(self, enabled: bool) -> None:
        set_fp32_copies(self, enabled)

    @property
    def fp32_batch_matmul(self) -> bool:
        return self.lm_head.weight_f32 is not None


def set_cpu_kernels(module: nn.Module, kernels: CpuKernels | None) -> None:
    """Use the own bf16 kernels in ``module`` (None, or a None field: torch's): the product
    for up to ``CpuKernels.rows_for`` its weight rows (a head: ``matvec_rows``), the RMSNorms,
    the attention of decode and verify rows (and of prefills, ``attention_queries``; for
    head_dim a multiple of 8 up to 256 and up to 16 query heads per KV head: its limits)."""
    if isinstance(module, LlamaModel):
        module.kernels = kernels  # a drafter loaded for this model uses the same
    for m in module.modules():
        if isinstance(m, Linear):
            m.matvec = None if kernels is None else kernels.matvec
            m.matvec_rows = MATVEC_ROWS if kernels is None else kernels.rows_for(m.weight)
        elif isinstance(m, RMSNorm):
            m.kernel = None if kernels is None else kernels.norm
        elif isinstance(m, Attention):
            m.kernel = None if kernels is None or not _attention_fits(m) else kernels.attention
            m.kernel_queries = ATTENTION_QUERIES
            m.block_queries = EVERY_ROW if kernels is None else kernels.block_queries
            m.write_rows = None if kernels is None else kernels.write
            if kernels is not None:
                dot = m.cfg.head_dim in DOT_HEAD_DIMS
                m.kernel_queries = kernels.attention_queries if dot else kernels.other_head_queries
        elif isinstance(m, DecoderLayer):
            m.kernel = None if kernels is None or not _layer_fits(m, kernels) else kernels.layer
            products = (m.self_attn.qkv_proj, m.self_attn.o_proj, m.mlp.gate_up_proj,
                        m.mlp.down_proj)
            m.product_rows = [MATVEC_ROWS if kernels is None else kernels.rows_for(p.weight)
                              for p in products]
            m.kernel_rows = max(min(m.product_rows),
                                MATVEC_ROWS if kernels is None else kernels.layer_rows)
    if isinstance(module, LlamaModel):
        module.stack = _layer_stack(module, kernels)
    if isinstance(module, LlamaModel) and kernels is not None:
        # The head keeps ``matvec_rows`` whatever its size: at 33-64 rows its limit bought
        # nothing measurable on the default model (28M weights), and a verify step's logits
        # then take the own product as far as a decode step's (bf16 speculation bit-exact).
        module.lm_head.matvec_rows = kernels.matvec_rows


def _layer_stack(model: LlamaModel, kernels: CpuKernels | None) -> LayerStack | None:
    """Every layer in one call, where every layer runs the whole-layer kernel."""
    layers = [m for m in model.layers if isinstance(m, DecoderLayer)]
    if kernels is None or kernels.stack is None or kernels.layer is None or not all(
        m.kernel is kernels.layer and isinstance(m.input_layernorm, RMSNorm) for m in layers
    ):
        return None
    attn, post = layers[0].self_attn, layers[0].post_attention_layernorm
    if any(m.post_attention_layernorm.eps != post.eps for m in layers):
        return None
    weights = tuple(
        (_norm_weight(m.input_layernorm), m.self_attn.qkv_proj.weight, m.self_attn.o_proj.weight,
         m.post_attention_layernorm.weight, m.mlp.gate_up_proj.weight, m.mlp.down_proj.weight)
        for m in layers
    )
    return LayerStack(
        kernels.stack, kernels.layer, weights, tuple(r for m in layers for r in m.product_rows),
        post.eps, attn.cfg.num_heads, attn.cfg.head_dim, attn.scale, attn.block_queries,
    )


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    assert isinstance(norm, RMSNorm)
    return norm.weight


def _attention_fits(m: Attention) -> bool:
    return m.cfg.head_dim % 8 == 0 and m.cfg.head_dim <= 256 and m.group <= 16


def _layer_fits(m: DecoderLayer, kernels: CpuKernels) -> bool:
    """The whole-layer kernel: Llama layers without biases or q/k norms (not Qwen2 / Qwen3),
    and only with all the kernels it is made of (an A/B switching one off switches it off)."""
    attn, cfg = m.self_attn, m.self_attn.cfg
    return (
        kernels.matvec is not None
        and kernels.norm is not None
        and kernels.attention is not None
        and _attention_fits(attn)
        and not cfg.attention_bias
        and not cfg.qk_norm
        and isinstance(m.input_layernorm, RMSNorm | nn.Identity)
    )


def set_fp32_copies(module: nn.Module, enabled: bool) -> None:
    """Keep fp32 copies of all projection weights for large products (see ``Linear``).

    Call again after weights change (``refresh_fp32_copies``; the loader does)."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.set_fp32_copy(enabled)


def refresh_fp32_copies(module: nn.Module) -> None:
    """Recompute the fp32 copies that exist (after an in-place weight change)."""
    for m in module.modules():
        if isinstance(m, Linear) and m.weight_f32 is not None:
            m.set_fp32_copy(True)
