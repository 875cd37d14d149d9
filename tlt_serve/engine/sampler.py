"""Batched sampling with per-row settings; exact and reproducible per seed.

Sampling is by inverse CDF: one uniform ``u`` per row, token = first index whose cumulative
probability (fp64) exceeds ``u`` times the total. Rows with their own seed draw ``u`` from their
own generator, so their tokens do not depend on what else is in the batch; one scalar draw per
row keeps seeded sampling cheap (drawing a vocabulary-sized noise vector per row cost ~0.3 ms).

Reported logprobs are ``log_softmax(logits / T)`` (raw logits when greedy), before the top-k /
top-p / min-p truncation: the distribution an RL trainer recomputes at temperature T.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tlt_serve.engine.request import Request
from tlt_serve.engine.scheduler import Sampled
from tlt_serve.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> Sampled:
        """logits [N, V] fp32, one row per request → one token each."""
        params = [r.params for r in reqs]
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
        scaled = logits / temps.unsqueeze(1)  # [N, V]
        logprobs = torch.log_softmax(scaled, dim=-1)  # [N, V]
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)  # [N]
        else:
            filtered = _apply_filters(scaled, params)  # [N, V], -inf outside the nucleus
            cdf = torch.softmax(filtered, dim=-1).double().cumsum(dim=-1)  # [N, V]
            u = self._uniforms(reqs).unsqueeze(1) * cdf[:, -1:]  # [N, 1]
            tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy), logits.argmax(dim=-1), tokens)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [N]
        return Sampled(tokens.tolist(), chosen.tolist(), _top_logprobs(logprobs, params))

    def _uniforms(self, reqs: Sequence[Request]) -> torch.Tensor:
        """One U[0, 1) draw per row [N] (fp64), from the row's generator or the shared one."""
        u = torch.rand(len(reqs), generator=self.generator, dtype=torch.float64)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator, dtype=torch.float64)
        return u


def _apply_filters(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / top-p / min-p set."""
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    out = scaled
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V]
        V = scaled.shape[1]
        rank = torch.arange(V).unsqueeze(0)  # [1, V]
        k = torch.tensor([k if k > 0 else V for k in top_k]).unsqueeze(1)  # [N, 1]
        drop = rank >= k
        # top-p: keep the smallest prefix whose mass reaches p (the token crossing p stays).
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= torch.tensor(top_p).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        out = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(out, dim=-1)
        floor = torch.tensor(min_p).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        out = out.masked_fill(probs < floor, float("-inf"))
    return out


def _top_logprobs(
    logprobs: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]]] | None:
    k = max(p.top_logprobs for p in params)
    if k == 0:
        return None
    values, ids = logprobs.topk(k, dim=-1)  # [N, k]
    rows = zip(ids.tolist(), values.tolist(), strict=True)
    return [
        list(zip(i[: p.top_logprobs], v[: p.top_logprobs], strict=True))
        for (i, v), p in zip(rows, params, strict=True)
    ]
