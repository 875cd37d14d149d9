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


def test_own_kernel_draws_the_softmax_and_reports_log_softmax() -> None:
    """The own sampling kernel (CPU): greedy rows take the first maximum (ties included) with
    raw-logit logprobs; sampled rows draw the distribution of softmax(x / T) over blocks of
    CDF_BLOCK tokens (a chi-square over buckets of a 5000-token vocabulary), the token the
    inverse CDF of torch's softmax gives at the same uniform (but where the uniform sits
    within rounding of a boundary), never a masked token; logprobs within fp32 rounding of
    log_softmax, the same bits by ``token_logprobs`` and by scoring's maximum and log-sum, and
    a row's results do not depend on the rows beside it."""
    from tests.harness import own_kernels
    from tlt_serve.kernels import sampling_kernels

    own_kernels()  # a skip without them (a failure where they are required)
    own = sampling_kernels()
    assert own is not None
    g = torch.Generator().manual_seed(0)
    V = 5 * CDF_BLOCK - 17  # a partial last block
    logits = (torch.randn(64, V, generator=g) * 2).round(decimals=1)  # ties
    temps = torch.tensor([1.0, 0.7] * 32)
    greedy = torch.tensor([True, False, False, False] * 16)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    tokens, lps = own.sample(logits, temps, u, greedy)
    scaled = logits / temps.unsqueeze(1)
    assert torch.equal(tokens[greedy], greedy_tokens(scaled[greedy]))
    want = torch.log_softmax(scaled, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(lps, want, atol=2e-6, rtol=1e-6)
    assert torch.equal(own.logprobs(logits, temps, tokens), lps)
    unit = temps == 1.0
    mx, logsum, _ = own.scores(logits[unit], tokens[unit])
    assert torch.equal((logits[unit].gather(1, tokens[unit, None]).squeeze(1) - mx) - logsum,
                       lps[unit])
    for r in (1, 2, 35):
        alone = own.sample(logits[r : r + 1], temps[r : r + 1], u[r : r + 1], greedy[r : r + 1])
        assert alone[0].item() == tokens[r].item() and alone[1].item() == lps[r].item()
    # the torch path's draw at the same uniforms
    n = 4000
    row = logits[3:4].expand(n, -1).contiguous()
    us = torch.rand(n, generator=g, dtype=torch.float64)
    got, _ = own.sample(row, torch.full((n,), 0.7), us, torch.zeros(n, dtype=torch.bool))
    ref = inverse_cdf(torch.softmax(row / 0.7, dim=-1), us)
    assert int((got != ref).sum()) <= 2
    # the distribution: the 9 likeliest tokens one bin each, the rest one (99.9% of chi2(9)
    # is 27.9)
    p = torch.softmax(logits[3].double() / 0.7, dim=0)
    bins = torch.full((V,), 9)
    bins[p.argsort(descending=True)[:9]] = torch.arange(9)
    freq = torch.bincount(bins[got], minlength=10).double() / n
    q = torch.zeros(10, dtype=torch.float64).index_add_(0, bins, p)
    assert float(((freq - q) ** 2 / q).sum() * n) < 27.9
    # masked tokens are never drawn, not even at u -> 1
    masked = logits[:4].clone()
    masked[:, 1::2] = float("-inf")
    edge = torch.tensor([0.0, 0.5, 1 - 1e-12, 0.999999], dtype=torch.float64)
    t, lp = own.sample(masked, torch.ones(4), edge, torch.zeros(4, dtype=torch.bool))
    assert all(int(i) % 2 == 0 for i in t) and torch.isfinite(lp).all()
    # a NaN row: torch's max picks the NaN, and so does the kernel
    nan = logits[:1].clone()
    nan[0, 77] = float("nan")
    t, lp = own.sample(nan, torch.ones(1), u[:1], torch.tensor([True]))
    assert t.item() == 77 == greedy_tokens(nan).item() and lp.isnan().all()
    with pytest.raises(RuntimeError, match="fp32"):
        own.sample(logits.double(), temps, u, greedy)
    with pytest.raises(RuntimeError, match="token out of range"):
        own.logprobs(logits[:1], temps[:1], torch.tensor([V]))


def test_a_row_draws_the_same_token_beside_filtered_or_constrained_rows() -> None:
    """A seeded row without filters is drawn by the own kernel (where built) and a row with
    top-k / top-p by torch's ops, each alone: a row's token and logprob are the same whatever
    rows share its step."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 3000, generator=g) * 3
    plain = SamplingParams(temperature=0.9)
    alone = Sampler(seed=0).sample(logits.clone(), reqs(plain, 1, seed=11))
    mixed = reqs(SamplingParams(temperature=0.8, top_p=0.9), 2, seed=3) + reqs(plain, 1, seed=11)
    mixed += reqs(SamplingParams(temperature=0.0), 1)
    out = Sampler(seed=1).sample(logits.expand(4, -1).clone(), mixed)
    assert out.token_ids[2] == alone.token_ids[0] and out.logprobs[2] == alone.logprobs[0]
    assert out.token_ids[3] == int(logits.argmax())
