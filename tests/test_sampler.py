"""The sampler alone: distributions after temperature / top-k / top-p / min-p, seeds, greedy."""

from __future__ import annotations

import pytest
import torch

from tests.reference import filtered_probs
from tlt_serve.engine.request import Request
from tlt_serve.engine.sampler import CDF_BLOCK, Sampler, greedy_tokens, inverse_cdf
from tlt_serve.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def reqs(params: SamplingParams, n: int, seed: int | None = None) -> list[Request]:
    out = []
    for i in range(n):
        gen = None if seed is None else torch.Generator().manual_seed(seed + i)
        out.append(Request(f"r{i}", [1], params, None, generator=gen))
    return out


def expected(params: SamplingParams) -> torch.Tensor:
    return filtered_probs(LOGITS, params)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.3, top_p=0.9, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.3),
    ],
)
def test_empirical_distribution_matches(params: SamplingParams) -> None:
    n = 40000
    sampler = Sampler(seed=0)
    tokens = torch.tensor(sampler.sample(LOGITS.expand(n, -1).clone(), reqs(params, n)).token_ids)
    freq = torch.bincount(tokens, minlength=len(LOGITS)).double() / n
    q = expected(params).double()
    assert torch.all(freq[q == 0] == 0), "a filtered-out token was sampled"
    # Chi-square over the kept tokens; 8 bins, the 99.9% quantile of chi2(7) is 24.3.
    kept = q > 0
    chi2 = float(((freq[kept] - q[kept]) ** 2 / q[kept]).sum() * n)
    assert chi2 < 24.3, (chi2, freq, q)


def test_chi_square_detects_a_biased_sampler() -> None:
    """The check above has power: a slightly wrong temperature fails it."""
    n = 40000
    sampler = Sampler(seed=0)
    wrong = SamplingParams(temperature=1.1)
    tokens = torch.tensor(sampler.sample(LOGITS.expand(n, -1).clone(), reqs(wrong, n)).token_ids)
    freq = torch.bincount(tokens, minlength=len(LOGITS)).double() / n
    q = expected(SamplingParams(temperature=1.0)).double()
    assert float(((freq - q) ** 2 / q).sum() * n) > 24.3


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    p = SamplingParams(temperature=1.0)
    alone = Sampler(seed=0).sample(LOGITS.expand(4, -1).clone(), reqs(p, 4, seed=5))
    mixed_reqs = reqs(p, 3) + reqs(p, 4, seed=5)
    mixed = Sampler(seed=1).sample(LOGITS.expand(7, -1).clone(), mixed_reqs)
    assert mixed.token_ids[3:] == alone.token_ids


def test_greedy_rows_take_argmax_and_report_raw_logprobs() -> None:
    rows = reqs(SamplingParams(temperature=0.0, top_logprobs=2), 2)
    rows += reqs(SamplingParams(temperature=1.0), 1)
    out = Sampler(seed=0).sample(LOGITS.expand(3, -1).clone(), rows)
    assert out.token_ids[:2] == [0, 0]
    ref = torch.log_softmax(LOGITS, dim=0)
    assert out.logprobs[0] == pytest.approx(float(ref[0]), abs=1e-6)
    assert out.top_logprobs is not None and [t for t, _ in out.top_logprobs[0]] == [0, 1]


def _reference_filters(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """apply_filters by the reference: keep what ``filtered_probs`` gives mass to."""
    out = torch.full_like(scaled, float("-inf"))
    for i, p in enumerate(params):
        kept = filtered_probs(scaled[i], p) > 0
        out[i, kept] = scaled[i, kept]
    return out


def test_candidate_filters_equal_a_full_sort_on_a_large_vocabulary() -> None:
    """Top-k / top-p work on the best TOP_CANDIDATES tokens and fall back to a full sort
    when the nucleus is wider (flat rows): both paths must keep exactly the same tokens."""
    from tlt_serve.engine.sampler import TOP_CANDIDATES, apply_filters

    V = 3 * TOP_CANDIDATES
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(3, V, generator=g) * 4.0
    flat = torch.randn(3, V, generator=g) * 0.05  # nucleus of p=0.9 spans most of V
    logits = torch.cat([peaked, flat])
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=50, top_p=0.95),
        SamplingParams(top_k=2000, min_p=0.1),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=1500, top_p=0.99),
        SamplingParams(top_p=0.5, min_p=0.01),
    ]
    got = apply_filters(logits, params)
    want = _reference_filters(logits, params)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], want[~want.isinf()])
    assert int((~got[3].isinf()).sum()) > TOP_CANDIDATES  # the fallback path really ran


@pytest.mark.parametrize("vocab", [5, CDF_BLOCK, 3 * CDF_BLOCK + 7, 49152])
def test_the_blocked_inverse_cdf_is_the_full_one(vocab: int) -> None:
    """Two levels (fp32 block sums, one block in fp64) draw what one fp64 cumulative sum of
    the whole row draws, but where the target lies within 1e-6 of a boundary (the block sums'
    rounding moves it by ~1e-8 of the total); never a token of zero probability, also for a
    target at the very top of a row whose last tokens have none."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(3 * torch.randn(64, vocab, generator=g), dim=-1)  # [64, V]
    probs[:, 1::3] = 0.0
    for _ in range(20):
        u = torch.rand(64, generator=g, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)  # [64, V]
        x = u.unsqueeze(1) * cdf[:, -1:]
        full = torch.searchsorted(cdf, x, right=True).squeeze(1)
        got = inverse_cdf(probs, u)
        assert (probs.gather(1, got.unsqueeze(1)) > 0).all()
        near = ((cdf - x).abs() < 1e-6).any(dim=1)
        assert (~near).sum() >= 32  # most draws are compared
        assert torch.equal(got[~near], full[~near])
        assert torch.equal(inverse_cdf(probs[:1], u[:1]), got[:1])  # rows draw alone
    # zero beyond a block's fifth-last token: the very top lands on that token
    edge = torch.zeros(2, 2 * CDF_BLOCK)
    edge[:, 3] = 0.5
    edge[:, CDF_BLOCK - 5] = 0.5
    top = torch.tensor([1 - 1e-12, 0.0], dtype=torch.float64)
    assert inverse_cdf(edge, top).tolist() == [CDF_BLOCK - 5, 3]


def test_greedy_tokens_pick_what_argmax_picks() -> None:
    """Ties to the first, a NaN as the largest, rows of -inf, 2-D and 3-D logits: the same
    index as torch's argmax."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randint(0, 4, (3, 16, 300), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[torch.rand(x.shape, generator=g) < 0.01] = float("nan")
        if trial % 5 == 0:
            x[1] = float("-inf")
        assert torch.equal(greedy_tokens(x), x.argmax(dim=-1)), trial
        assert torch.equal(greedy_tokens(x[0]), x[0].argmax(dim=-1)), trial
