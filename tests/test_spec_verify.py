"""The chain verifier alone: greedy exact match, statistical losslessness, logprobs, seeds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.reference import (
    LOGITS0,
    LOGITS1,
    LOGITS2,
    SETTINGS,
    V,
    chi_square,
    critical,
    expected_joint,
)
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative.verify import ChainDrafts, _filtered_probs, verify_chain

GREEDY = SamplingParams(temperature=0.0)
Verifier = Callable[[ChainDrafts, torch.Generator], list[list[int]]]


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
    "onehot": Drafter(None, None),  # often drafts filtered-out tokens: always rejected
    # Deterministic drafts of likely tokens (2nd best after each x): accepted and rejected.
    "onehot_top": Drafter(None, None, 1, tuple(LOGITS1.argsort(1, descending=True)[:, 1].tolist())),
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
    step2 = ChainDrafts(
        logits,
        tok.unsqueeze(1),
        torch.ones(m, dtype=torch.long),
        (params,) * m,
        None if q is None else q.unsqueeze(1),
    )
    e1[again] = torch.tensor([row[0] for row in verify(step2, gen)])
    return torch.bincount(e0 * V + e1, minlength=V * V).view(V, V)


def correct(drafts: ChainDrafts, gen: torch.Generator) -> list[list[int]]:
    return verify_chain(drafts, shared=gen).token_ids


def biased(drafts: ChainDrafts, gen: torch.Generator) -> list[list[int]]:
    """The classic bug: accept with min(1, p/q) but resample the correction from p itself."""
    B, K1, _ = drafts.target_logits.shape
    temps = torch.tensor([p.temperature for p in drafts.params]).view(B, 1, 1)
    per_pos = [p for p in drafts.params for _ in range(K1)]
    p = _filtered_probs(drafts.target_logits / temps, per_pos)  # [B, K+1, V]
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


@pytest.mark.parametrize("drafter", ["far", "onehot_top"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_biased_verifier_is_caught(setting: str, drafter: str) -> None:
    params = SETTINGS[setting]
    counts = two_tokens(biased, params, DRAFTERS[drafter], 20000)
    stat, df = chi_square(counts, expected_joint(params))
    assert stat > critical(df), f"bias not detected: chi2={stat:.1f} df={df}"


def _greedy_logits(argmaxes: list[int], V: int = 5) -> torch.Tensor:
    """[len, V] logits whose row j peaks at argmaxes[j] (distinct values, so logprobs differ)."""
    logits = torch.linspace(-1.0, 0.0, V).repeat(len(argmaxes), 1)
    for j, t in enumerate(argmaxes):
        logits[j, t] = 2.0 + j
    return logits


def test_greedy_exact_match() -> None:
    logits = _greedy_logits([2, 4, 1, 3])  # [K+1=4, V=5]
    rows = [  # (drafts, num_drafts) -> expected emitted tokens
        ([2, 4, 1], 3, [2, 4, 1, 3]),  # all accepted: the bonus from position 3
        ([2, 0, 1], 3, [2, 4]),  # first mismatch at 1: argmax there, later drafts ignored
        ([0, 4, 1], 3, [2]),  # mismatch at 0
        ([2, 4, -1], 2, [2, 4, 1]),  # fewer real drafts: the bonus comes from position 2
        ([-1, -1, -1], 0, [2]),  # no drafts: plain greedy decoding
    ]
    B = len(rows)
    drafts = ChainDrafts(
        logits.expand(B, -1, -1).clone(),
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        (GREEDY,) * B,
    )
    out = verify_chain(drafts)
    assert out.token_ids == [r[2] for r in rows]
    assert out.num_accepted == [len(r[2]) - 1 for r in rows]  # excludes the bonus/correction
    raw = torch.log_softmax(logits, dim=-1)  # greedy logprobs: raw logits, T = 1
    for toks, lps in zip(out.token_ids, out.logprobs, strict=True):
        assert lps == pytest.approx([float(raw[j, t]) for j, t in enumerate(toks)], abs=1e-6)


def test_greedy_and_sampled_rows_mix() -> None:
    logits = _greedy_logits([2, 4, 1]).expand(3, -1, -1).clone()
    top1 = SamplingParams(temperature=0.8, top_k=1)  # sampling that can only pick the argmax
    drafts = ChainDrafts(
        logits,
        torch.tensor([[2, 4], [2, 3], [2, 4]]),
        torch.tensor([2, 2, 2]),
        (GREEDY, top1, top1),
    )
    out = verify_chain(drafts, shared=torch.Generator().manual_seed(0))
    assert out.token_ids == [[2, 4, 1], [2, 4], [2, 4, 1]]


def test_deterministic_draft_outside_filter_never_accepted() -> None:
    n = 2000
    logits = LOGITS0.expand(n, 2, V).clone()
    drafts = ChainDrafts(
        logits, torch.full((n, 1), 3), torch.ones(n, dtype=torch.long), (SETTINGS["top_k3"],) * n
    )
    out = verify_chain(drafts, shared=torch.Generator().manual_seed(0))
    assert set(out.num_accepted) == {0}
    assert {row[0] for row in out.token_ids} == {0, 1, 2}


def test_sampled_logprobs_are_tempered_unfiltered_at_their_positions() -> None:
    base = SETTINGS["T0.7_top_p0.8"]
    tops = SamplingParams(temperature=0.7, top_p=0.8, top_logprobs=2)
    n = 64
    params = tuple(tops if b % 2 else base for b in range(n))  # top logprobs for odd rows
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(n, 4, V, generator=gen)  # [B, K+1, V]
    tokens = torch.randint(0, V, (n, 3), generator=gen)
    num = torch.randint(0, 4, (n,), generator=gen)
    out = verify_chain(ChainDrafts(logits, tokens, num, params), shared=gen)
    ref = torch.log_softmax(logits / 0.7, dim=-1)  # before top-p truncation
    assert out.top_logprobs is not None
    for b in range(n):
        toks = out.token_ids[b]
        assert toks[:-1] == tokens[b, : out.num_accepted[b]].tolist()
        expect = [float(ref[b, j, t]) for j, t in enumerate(toks)]
        assert out.logprobs[b] == pytest.approx(expect, abs=1e-5)
        for j, top in enumerate(out.top_logprobs[b]):
            best = ref[b, j].topk(2 if b % 2 else 0)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-5)
        assert len(out.top_logprobs[b]) == len(toks)


def test_seeded_row_independent_of_batch_and_inputs_untouched() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    q = _softmax_noise(torch.zeros(1, 2, V), 1.0, 9)  # [1, K=2, V]
    alone = ChainDrafts(
        torch.stack([LOGITS0, LOGITS1[1], LOGITS2]).unsqueeze(0),
        torch.tensor([[1, 0]]),
        torch.tensor([2]),
        (params,),
        q,
    )
    # The same row inside a wider batch (K=3, padded) next to an unseeded row.
    logits = torch.randn(2, 4, V, generator=torch.Generator().manual_seed(3))
    logits[1, :3] = alone.target_logits[0]
    wide_q = torch.full((2, 3, V), 1.0 / V)
    wide_q[1, :2] = q[0]
    wide = ChainDrafts(
        logits,
        torch.tensor([[0, 1, 2], [1, 0, -1]]),
        torch.tensor([3, 2]),
        (SamplingParams(), params),
        wide_q,
    )
    before = [t.clone() for t in (wide.target_logits, wide.draft_tokens, wide_q)]
    for seed in range(20):
        a = verify_chain(alone, [torch.Generator().manual_seed(seed)])
        w = verify_chain(wide, [None, torch.Generator().manual_seed(seed)])
        assert (a.token_ids[0], a.logprobs[0]) == (w.token_ids[1], w.logprobs[1])
    after = (wide.target_logits, wide.draft_tokens, wide_q)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_shapes_are_validated() -> None:
    logits = torch.zeros(2, 3, V)
    with pytest.raises(ValueError, match="draft_tokens"):
        ChainDrafts(
            logits,
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, dtype=torch.long),
            (GREEDY,) * 2,
        )
    with pytest.raises(ValueError, match="num_drafts"):
        ChainDrafts(
            logits, torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 3]), (GREEDY,) * 2
        )
    with pytest.raises(ValueError, match="draft_probs"):
        ChainDrafts(
            logits,
            torch.zeros(2, 2, dtype=torch.long),
            torch.tensor([0, 2]),
            (GREEDY,) * 2,
            torch.zeros(2, 3, V),
        )
