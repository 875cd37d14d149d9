"""The chain verifier alone: greedy exact match, statistical losslessness, logprobs, seeds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tlt_serve.sampling_params import SamplingParams
from tlt_serve.spec.verify import ChainDrafts, _filtered_probs, verify_chain

V = 6
LOGITS0 = torch.tensor([1.2, 0.9, 0.5, 0.2, -0.3, -0.8])  # position 0: after the context
# Position 1 is conditioned on the token at position 0: one logits row per possible token.
LOGITS1 = torch.randn(V, V, generator=torch.Generator().manual_seed(1))  # [V, V]
LOGITS2 = torch.zeros(V)  # position 2 (bonus after two drafts); irrelevant to two tokens
GREEDY = SamplingParams(temperature=0.0)
SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7_top_p0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "top_k3": SamplingParams(temperature=1.0, top_k=3),
    "min_p0.2": SamplingParams(temperature=1.0, min_p=0.2),
}
Verifier = Callable[[ChainDrafts, torch.Generator], list[list[int]]]


def critical(df: int) -> float:
    """99.9% quantile of chi2(df): scipy if present, else Wilson-Hilferty (within ~0.5% here)."""
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(0.999, df))
    except ImportError:
        z = 3.0902  # standard normal 99.9% quantile
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


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


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered target distribution, written as a loop independently of the engine code."""
    p = torch.softmax(logits.double() / params.temperature, dim=0)
    keep, mass = [], 0.0
    for rank, tok in enumerate(p.argsort(descending=True).tolist()):
        if params.top_k > 0 and rank >= params.top_k:
            break
        keep.append(tok)
        mass += float(p[tok])
        if mass >= params.top_p:
            break
    q = torch.zeros(V, dtype=torch.float64)
    q[keep] = p[keep] / p[keep].sum()
    q = torch.where(q >= params.min_p * q.max(), q, 0.0)
    return q / q.sum()


@dataclass(frozen=True)
class Drafter:
    """Draft distributions: q0 [V] after the context, q1 [V, V] after token x.

    ``None``: deterministic drafts (q one-hot), ``first`` after the context, ``after[x]``."""

    q0: torch.Tensor | None
    q1: torch.Tensor | None
    first: int = 3  # ranked 4th by LOGITS0: filtered out under top_k=3, min_p=0.2
    after: tuple[int, ...] = (3, 0, 5, 1, 2, 4)

    def draw(
        self, ctx: torch.Tensor | None, n: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """n drafts [n] after tokens ctx [n] (None: after the context), and their q [n, V]."""
        if self.q0 is None or self.q1 is None:
            det = torch.full((n,), self.first) if ctx is None else torch.tensor(self.after)[ctx]
            return det, None
        q = self.q0.expand(n, V) if ctx is None else self.q1[ctx]
        return torch.multinomial(q, 1, generator=gen).squeeze(1), q


def _softmax_noise(base: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(seed))
    return torch.softmax(base + scale * noise, dim=-1)


DRAFTERS = {
    "near": Drafter(_softmax_noise(LOGITS0, 0.3, 2), _softmax_noise(LOGITS1, 0.3, 3)),
    "far": Drafter(torch.softmax(-2.0 * LOGITS0, 0), torch.softmax(-2.0 * LOGITS1, 1)),
    "onehot": Drafter(None, None),
}


def two_tokens(verify: Verifier, params: SamplingParams, drafter: Drafter, n: int) -> torch.Tensor:
    """Counts [V, V] of the first two emitted tokens over n independent rows.

    Step 1 drafts K=2 (rows get 0, 1 or 2 real drafts, padding -1 / NaN after); rows that
    emitted a single token run a second step drafting after it, as real decoding would."""
    gen = torch.Generator().manual_seed(1234)
    num = torch.multinomial(torch.tensor([0.1, 0.2, 0.7]), n, True, generator=gen)  # [B]
    real = torch.arange(2) < num.unsqueeze(1)  # [B, 2]
    tok0, q0 = drafter.draw(None, n, gen)
    tok1, q1 = drafter.draw(tok0, n, gen)
    tokens = torch.where(real, torch.stack([tok0, tok1], dim=1), -1)  # [B, 2]
    # Position 1 is scored after draft 0, so its logits are LOGITS1[draft 0].
    logits = torch.stack([LOGITS0.expand(n, V), LOGITS1[tok0], LOGITS2.expand(n, V)], 1)
    q = None
    if q0 is not None and q1 is not None:
        q = torch.where(real.unsqueeze(2), torch.stack([q0, q1], dim=1), math.nan)  # [B, 2, V]
    first = verify(ChainDrafts(logits, tokens, num, (params,) * n, q), gen)
    e0 = torch.tensor([row[0] for row in first])
    e1 = torch.tensor([row[1] if len(row) > 1 else -1 for row in first])
    again = (e1 < 0).nonzero().squeeze(1)  # rows that still need their second token
    m, ctx = len(again), e0[again]
    tok, q = drafter.draw(ctx, m, gen)
    logits = torch.stack([LOGITS1[ctx], LOGITS2.expand(m, V)], 1)  # [m, 2, V]
    step2 = ChainDrafts(logits, tok.unsqueeze(1), torch.ones(m, dtype=torch.long),
                        (params,) * m, None if q is None else q.unsqueeze(1))  # fmt: skip
    e1[again] = torch.tensor([row[0] for row in verify(step2, gen)])
    return torch.bincount(e0 * V + e1, minlength=V * V).view(V, V)


def expected_joint(params: SamplingParams) -> torch.Tensor:
    p0 = reference_probs(LOGITS0, params)  # [V]
    p1 = torch.stack([reference_probs(LOGITS1[x], params) for x in range(V)])  # [V, V]
    return p0.unsqueeze(1) * p1


def correct(drafts: ChainDrafts, gen: torch.Generator) -> list[list[int]]:
    return verify_chain(drafts, shared=gen).token_ids


def biased(drafts: ChainDrafts, gen: torch.Generator) -> list[list[int]]:
    """The classic bug: accept with min(1, p/q) but resample the correction from p itself."""
    B, K1, _ = drafts.target_logits.shape
    temps = torch.tensor([p.temperature for p in drafts.params]).view(B, 1, 1)
    p = _filtered_probs(drafts.target_logits / temps, drafts.params)  # [B, K+1, V]
    valid = torch.arange(K1 - 1) < drafts.num_drafts.unsqueeze(1)
    d = torch.where(valid, drafts.draft_tokens, 0)
    p_d = p[:, :-1].gather(2, d.unsqueeze(2)).squeeze(2)
    q = drafts.draft_probs
    q_d = torch.ones_like(p_d) if q is None else q.double().gather(2, d.unsqueeze(2)).squeeze(2)
    u = torch.rand(B, K1, generator=gen, dtype=torch.float64)
    n = ((u[:, :-1] * q_d < p_d) & valid).long().cumprod(1).sum(1)  # [B]
    last = torch.multinomial(p[torch.arange(B), n], 1, generator=gen).squeeze(1)
    return [d[b, : n[b]].tolist() + [int(last[b])] for b in range(B)]


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_lossless_first_and_joint(setting: str, drafter: str) -> None:
    params = SETTINGS[setting]
    counts = two_tokens(correct, params, DRAFTERS[drafter], 20000)
    joint = expected_joint(params)
    for observed, probs in ((counts.sum(1), joint.sum(1)), (counts, joint)):
        stat, df = chi_square(observed, probs)
        assert stat < critical(df), f"chi2={stat:.1f} df={df} crit={critical(df):.1f}"


@pytest.mark.parametrize("drafter", ["far", "onehot"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_biased_verifier_is_caught(setting: str, drafter: str) -> None:
    params = SETTINGS[setting]
    counts = two_tokens(biased, params, DRAFTERS[drafter], 20000)
    stat, df = chi_square(counts, expected_joint(params))
    assert stat > critical(df), f"bias not detected: chi2={stat:.1f} df={df}"
