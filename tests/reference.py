"""Independent reference implementations the tests compare the engine against."""

from __future__ import annotations

import torch

from tlt_serve.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T), then top-k, top-p
    (smallest prefix reaching p, on the unfiltered distribution) and min-p, renormalised.
    A loop over tokens, written independently of the engine. logits [V] → fp64 [V]."""
    p = torch.softmax(logits.double() / params.temperature, dim=0)
    keep, mass = [], 0.0
    for rank, tok in enumerate(p.argsort(descending=True).tolist()):
        if params.top_k > 0 and rank >= params.top_k:
            break
        keep.append(tok)
        mass += float(p[tok])
        if mass >= params.top_p:
            break
    q = torch.zeros_like(p)
    q[keep] = p[keep] / p[keep].sum()
    q = torch.where(q >= params.min_p * q.max(), q, 0.0)
    return q / q.sum()
