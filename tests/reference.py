"""Independent reference implementations the tests compare the engine against, and the toy
two-position target the verifier tests sample from, with the chi-square test they judge by."""

from __future__ import annotations

import math

import torch
from scipy.stats import chi2

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


# ---- a toy target over two positions ------------------------------------------------------

V = 6
LOGITS0 = torch.tensor([1.2, 0.9, 0.5, 0.2, -0.3, -0.8])  # position 0: after the context
# Position 1 is conditioned on the token at position 0: one logits row per possible token.
LOGITS1 = torch.randn(V, V, generator=torch.Generator().manual_seed(1))  # [V, V]
LOGITS2 = torch.zeros(V)  # position 2 (bonus after two drafts); irrelevant to two tokens
SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7_top_p0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "top_k3": SamplingParams(temperature=1.0, top_k=3),
    "min_p0.2": SamplingParams(temperature=1.0, min_p=0.2),
}


def expected_joint(params: SamplingParams) -> torch.Tensor:
    """The target's joint distribution [V, V] of the first two tokens under ``params``."""
    p0 = filtered_probs(LOGITS0, params)  # [V]
    p1 = torch.stack([filtered_probs(LOGITS1[x], params) for x in range(V)])  # [V, V]
    return p0.unsqueeze(1) * p1


def critical(df: int) -> float:
    """99.9% quantile of chi2(df)."""
    return float(chi2.ppf(0.999, df))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expected under 5 are pooled.

    An observation in a cell of probability 0 (a filtered-out token) makes it infinite."""
    o, e = counts.flatten().double(), probs.flatten().double() * counts.sum().double()
    if o[e == 0].sum() > 0:
        return math.inf, 1
    small = (e > 0) & (e < 5)
    o = torch.cat([o[e >= 5], o[small].sum().view(1)])
    e = torch.cat([e[e >= 5], e[small].sum().view(1)])
    keep = e > 0
    return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1
