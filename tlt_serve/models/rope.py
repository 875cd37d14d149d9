"""Rotary position embedding tables (HF "rotate_half" convention)."""

from __future__ import annotations

import math

import torch

from tlt_serve.models.arch import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [D/2] in fp32, with the configured scaling applied."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, blended, inv)
    return inv.float()


def cos_sin_table(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """Table [P, 2, D] of (cos, sin) for positions 0..P-1, fp32 (cast at use)."""
    inv = inv_frequencies(rope, head_dim)  # [D/2]
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    return torch.stack([emb.cos(), emb.sin()], dim=1)  # [P, 2, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, Q, heads, D]; cos/sin [B, Q, 1, D]. Returns x rotated: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
