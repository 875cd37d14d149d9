"""Attention of decode and chain-verify steps on a GPU, in Triton: a few query tokens per
row over that row's cached keys, the keys split across programs (flash-decoding).

torch's attention (cuDNN's flash kernel on an H200) took 18 us a layer at batch 1 and 1024
keys for the 1.7B shape, a fifth of the step: flash kernels tile the queries, and a decode
step has one query per head. Here every (row, KV head) has
``splits`` programs, each over a slice of the keys with all the G * Q queries of that KV
head (the G query heads sharing it, folded as in ``Attention.fold``), keeping a running
maximum, sum and weighted values; a second kernel combines the slices. Query j of row b sees
keys ``[0, lens[b, j])`` (causal rows: no mask tensor), so a slice past every query's
length reads nothing.

``TRITON_INTERPRET=1`` (set before Triton is imported) runs both kernels on the CPU: how the
tests check them against torch's attention (the interpreter's bf16 products being wrong,
tiles are widened to fp32 there).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner iteration
SPLIT_TARGET = 2  # programs per multiprocessor the splits aim at


@triton.jit
def _partial(q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, m_ptr, l_ptr,
             row_lo, kv_heads, sqb, sqh, sqr, skb, skh, skn, svb, svh, svn, slb, scale,
             R, QN, CHUNK, SPLITS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             D: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)  # b * kv_heads + h
    s = tl.program_id(1)  # this program's slice of the keys
    b = pid // kv_heads
    h = pid % kv_heads
    rows = tl.arange(0, BLOCK_M)  # folded query rows g * QN + j
    d = tl.arange(0, D)
    real = rows < R
    q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqr + d[None, :],
                mask=real[:, None], other=0.0)  # [BLOCK_M, D]
    if WIDEN:
        q = q.to(tl.float32)
    n = tl.load(lens_ptr + b * slb + rows % QN, mask=real, other=1)  # keys each row sees
    n = tl.maximum(n.to(tl.int32), 1)  # a padding query (0 keys) sees column 0
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, tl.max(n, 0))  # nothing past the longest row is read
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_row = k_ptr + (row_lo + b) * skb + h * skh
    v_row = v_ptr + (row_lo + b) * svb + h * svh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < hi
        k = tl.load(k_row + cols[None, :] * skn + d[:, None], mask=inside[None, :],
                    other=0.0)  # [D, BLOCK_N]
        if WIDEN:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        scores = tl.where(cols[None, :] < n[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_row + cols[:, None] * svn + d[None, :], mask=inside[:, None],
                    other=0.0)  # [BLOCK_N, D]
        if WIDEN:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    part = pid * SPLITS + s
    tl.store(o_ptr + part * BLOCK_M * D + rows[:, None] * D + d[None, :], acc)
    tl.store(m_ptr + part * BLOCK_M + rows, m_i)
    tl.store(l_ptr + part * BLOCK_M + rows, l_i)


@triton.jit
def _combine(o_ptr, m_ptr, l_ptr, out_ptr, kv_heads, sob, soh, sor, R,
             SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // kv_heads
    h = pid % kv_heads
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    splits = tl.arange(0, SPLITS)
    m = tl.load(m_ptr + (pid * SPLITS + splits[:, None]) * BLOCK_M + rows[None, :])  # [S, M]
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(m - top[None, :])  # [SPLITS, BLOCK_M]
    lsum = tl.load(l_ptr + (pid * SPLITS + splits[:, None]) * BLOCK_M + rows[None, :])
    denom = tl.sum(w * lsum, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in range(SPLITS):
        ws = tl.exp(tl.load(m_ptr + (pid * SPLITS + s) * BLOCK_M + rows) - top)  # [BLOCK_M]
        o = tl.load(o_ptr + (pid * SPLITS + s) * BLOCK_M * D + rows[:, None] * D + d[None, :])
        acc += o * ws[:, None]
    out = acc / denom[:, None]
    tl.store(out_ptr + b * sob + h * soh + rows[:, None] * sor + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < R)[:, None])


def fits(head_dim: int, rows: int) -> bool:
    """Whether the kernels take a head size and G * Q folded query rows."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and rows <= 128


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_lo: int,
                     lens: torch.Tensor, keys: int, scale: float,
                     programs: int | None = None) -> torch.Tensor:
    """q folded [B, kvH, G * Q, D] (row g * Q + j: head g's query j), the layer's cache
    [S, kvH, L + 1, D] (rows ``row_lo ..``, key columns ``[0, keys)``, keys a multiple of
    BLOCK_N or less than it), lens [B, Q] (keys query j of row b sees) → [B, kvH, G * Q, D]
    in q's dtype. ``programs``: how many programs the splits aim at (default: twice the
    GPU's multiprocessors)."""
    B, kv_heads, R, D = q.shape
    QN = lens.shape[1]
    assert fits(D, R) and k_cache.stride(-1) == v_cache.stride(-1) == q.stride(-1) == 1
    block_m = max(16, triton.next_power_of_2(R))
    if programs is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        programs = SPLIT_TARGET * sms
    most = max(1, keys // BLOCK_N)  # slices of at least BLOCK_N keys
    splits = 1
    while splits * 2 <= most and B * kv_heads * splits < programs:
        splits *= 2
    chunk = -(-keys // splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N  # whole blocks per slice
    parts = B * kv_heads * splits
    o = torch.empty(parts, block_m, D, dtype=torch.float32, device=q.device)
    m = torch.empty(parts, block_m, dtype=torch.float32, device=q.device)
    l_ = torch.empty(parts, block_m, dtype=torch.float32, device=q.device)
    # Triton's interpreter multiplies bf16 tiles wrongly: there, tiles are widened to fp32
    widen = os.environ.get("TRITON_INTERPRET") == "1"
    # fp32 products in full fp32 (not tf32: fp32 serving is the exactness reference)
    precision = "ieee" if q.dtype == torch.float32 or widen else None
    _partial[(B * kv_heads, splits)](
        q, k_cache, v_cache, lens, o, m, l_, row_lo, kv_heads,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        lens.stride(0), scale,
        R, QN, chunk, splits, BLOCK_M=block_m, BLOCK_N=BLOCK_N, D=D, PRECISION=precision,
        WIDEN=widen)
    out = torch.empty_like(q)
    _combine[(B * kv_heads,)](o, m, l_, out, kv_heads, out.stride(0), out.stride(1),
                              out.stride(2), R, SPLITS=splits, BLOCK_M=block_m, D=D)
    return out
