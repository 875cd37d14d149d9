"""Lossless verification of chain drafts, batched over requests.

Row b carries ``num_drafts[b] = n`` draft tokens d_0..d_{n-1}; the target scored the K+1
positions of the chain in one forward, position j holding the target's logits for the token
after d_0..d_{j-1} (position 0: after the last committed token). Rows are independent.

Greedy rows (temperature 0): accept the longest prefix with d_j == argmax(logits_j), then emit
argmax at the first mismatch (or at position n, the bonus). Output == plain greedy decoding.

Sampled rows, with p_j the target distribution AFTER the row's temperature and top-k / top-p /
min-p filters (the engine sampler's own ``apply_filters``):

Deterministic drafts (every proposer the engine has: n-gram, suffix, the drafter's argmax
chains; ``draft_probs`` None) are sampled THROUGH: at j = 0, 1, ... draw y_j from p_j exactly
as the sampler draws a token (the next uniform of the row's stream, ``inverse_cdf``); go on
while y_j == d_j, emit y_j where it differs (or at j = n, the bonus) and stop. Every emitted
token is the target's own draw, so the output is the plain sampler's, token for token, given
the same uniforms: a seeded request samples the same tokens with speculation on or off (up to
the logits' rounding). Acceptance is as high as rejection sampling's with q = one-hot:
P(y_j == d_j) = p_j(d_j), and a mismatched y_j is a draw from p_j without d_j.

Drafts drawn from a distribution q_j (``draft_probs``): speculative (rejection) sampling,
Leviathan et al. 2023 / Chen et al. 2023:
  accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
  at the first rejection emit a token from norm(max(0, p_j - q_j)) and stop;
  if all n are accepted emit the bonus token from p_n.
Why lossless: P(emit x at j) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) *
max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p, q)(x) + max(0, p - q)(x) = p(x), since
both normalisers equal the total-variation distance.

Randomness: sampled through, one U[0,1) per emitted token, drawn when needed; with q, one per
real draft (acceptance coin) plus one for the correction or bonus token. A row with its own
generator draws from it, so its tokens do not depend on the batch (not even on the batch's K);
other sampled rows share one generator. Greedy rows draw nothing.

Reported logprobs follow the sampler: log_softmax(logits / T) at the token's position (raw
logits, T = 1, when greedy), before top-k / top-p / min-p truncation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tlt_serve.engine.sampler import (
    apply_filters,
    chosen_logprobs,
    greedy_tokens,
    inverse_cdf,
    own_kernels,
    own_row,
    row_temperatures,
    top_logprobs_of,
)
from tlt_serve.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)  # tensors: identity, not element-wise, equality
class ChainDrafts:
    """One verify step's inputs for B requests with up to K chain drafts each.

    ``draft_probs`` is the distribution each draft token was actually drawn from (after the
    drafter's own temperature / filters); ``None`` means deterministic drafts (q one-hot).
    Entries after ``num_drafts[b]`` (tokens, probabilities, logits beyond position n) are
    padding and ignored. ``params[b]`` supplies temperature, top-k, top-p, min-p and greedy.
    The tensors live on one device, the target logits'.
    """

    target_logits: torch.Tensor  # [B, K+1, V] fp32
    draft_tokens: torch.Tensor  # [B, K] long
    num_drafts: torch.Tensor  # [B] long, each in 0..K
    params: tuple[SamplingParams, ...]  # [B]
    draft_probs: torch.Tensor | None = None  # [B, K, V] or None

    def __post_init__(self) -> None:
        B, K1, V = self.target_logits.shape
        if tuple(self.draft_tokens.shape) != (B, K1 - 1):
            raise ValueError(f"draft_tokens {tuple(self.draft_tokens.shape)} != {(B, K1 - 1)}")
        if tuple(self.num_drafts.shape) != (B,) or len(self.params) != B:
            raise ValueError("num_drafts and params need one entry per row")
        if B and (int(self.num_drafts.min()) < 0 or int(self.num_drafts.max()) >= K1):
            raise ValueError(f"num_drafts must lie in 0..{K1 - 1}")
        q = self.draft_probs
        if q is not None and tuple(q.shape) != (B, K1 - 1, V):
            raise ValueError(f"draft_probs {tuple(q.shape)} != {(B, K1 - 1, V)}")


@dataclass(frozen=True)
class VerifyResult:
    """What the target accepted, per row. Nothing was mutated.

    ``num_accepted[b]`` counts accepted DRAFT tokens only: it EXCLUDES the correction / bonus
    token, so ``len(token_ids[b]) == num_accepted[b] + 1`` always (the step commits
    ``num_accepted + 1`` tokens). ``token_ids[b]`` = accepted drafts then the correction (first
    rejection) or bonus (all accepted) token; ``logprobs[b][i]`` is the target logprob of
    ``token_ids[b][i]`` at position i; ``top_logprobs`` (when any row asks for them) the
    row's ``params.top_logprobs`` best (token, logprob) pairs there, as the sampler reports.
    Field for field an ``Emitted``. Tokens after a stop token are the caller's to drop.
    """

    num_accepted: list[int]  # [B]
    token_ids: list[list[int]]  # [B][num_accepted + 1]
    logprobs: list[list[float]]  # [B][num_accepted + 1]
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None  # [B][accepted + 1][top]


def verify_chain(
    drafts: ChainDrafts,
    generators: Sequence[torch.Generator | None] | None = None,
    shared: torch.Generator | None = None,
) -> VerifyResult:
    """Accept a prefix of each row's drafts; see the module docstring for the rule.

    ``generators[b]`` (optional) is row b's own generator (a seeded request); rows without one
    draw from ``shared`` (torch's default generator when None). Only generator state advances.
    Full-vocabulary work is done only at the positions a row reaches (the accepted drafts and
    the one after): most of a deep chain is rejected.
    """
    logits, params = drafts.target_logits, drafts.params
    B = logits.shape[0]
    ns, rows = drafts.num_drafts.tolist(), drafts.draft_tokens.tolist()
    chains = [row[:n] for row, n in zip(rows, ns, strict=True)]
    counts, finals = [0] * B, [0] * B
    greedy = [b for b in range(B) if params[b].greedy]
    sampled = [b for b in range(B) if not params[b].greedy]
    if greedy:
        argmax = greedy_tokens(logits[greedy]).tolist()  # [G, K+1]
        for b, best in zip(greedy, argmax, strict=True):
            counts[b], finals[b] = follow(chains[b], best.__getitem__)
    if sampled and drafts.draft_probs is None:
        for b in sampled:
            gen = row_generator(generators, shared, b)
            counts[b], finals[b] = follow(chains[b], drawer(logits[b], params[b], gen))
    elif sampled:
        num_acc, final = _reject(drafts, generators, shared)
        for b in sampled:
            counts[b], finals[b] = int(num_acc[b]), int(final[b])
    tokens = [chain[:n] + [f] for chain, n, f in zip(chains, counts, finals, strict=True)]
    logprobs, tops = target_logprobs(logits, params, [list(range(len(t))) for t in tokens], tokens)
    return VerifyResult(counts, tokens, logprobs, tops)


def row_generator(
    generators: Sequence[torch.Generator | None] | None, shared: torch.Generator | None, b: int
) -> torch.Generator | None:
    """Row b's own generator (a seeded request), else the shared one."""
    own = generators[b] if generators is not None else None
    return own if own is not None else shared


def follow(drafted: Sequence[int], choose: Callable[[int], int]) -> tuple[int, int]:
    """Walk a chain: the target's token at position j (``choose``), on while it is the draft.
    Returns (drafts accepted, the token emitted after them)."""
    j = 0
    while True:
        y = choose(j)
        if j == len(drafted) or y != drafted[j]:
            return j, y
        j += 1


def drawer(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None
) -> Callable[[int], int]:
    """Draws the token at position j of one row's logits [Q, V] exactly as the engine's
    sampler would there (temperature, filters, its next uniform, ``inverse_cdf``)."""
    temp = torch.tensor([params.temperature], device=logits.device)  # [1] fp32, as in the sampler
    own = own_kernels(logits.device) if own_row(params) else None
    sampled = torch.tensor([False], device=logits.device)  # [1]: not a greedy row

    def draw(j: int) -> int:
        u = torch.rand(1, generator=gen, dtype=torch.float64)  # [1]
        if own is not None:  # the sampler's own kernel on this row alone: the same draw
            return int(own.sample(logits[j : j + 1].contiguous(), temp, u, sampled)[0])
        scaled = logits[j : j + 1] / temp.unsqueeze(1)  # [1, V]
        probs = torch.softmax(apply_filters(scaled, [params]), dim=-1)  # [1, V]
        return int(inverse_cdf(probs, u))

    return draw


def target_logprobs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]] | None]:
    """The sampler's logprobs (``log_softmax(logits / T)``, T = 1 when greedy) of row b's
    ``tokens[b]`` at its ``positions[b]`` of logits [B, Q, V], and the top logprobs there
    when asked for: computed for those positions only."""
    at_row = [b for b, pos in enumerate(positions) for _ in pos]  # [T]
    per_tok = [params[b] for b in at_row]
    temps = row_temperatures(per_tok)  # [T]
    picked = logits[at_row, [j for pos in positions for j in pos]]  # [T, V]
    flat = torch.tensor(
        [t for row in tokens for t in row], dtype=torch.long, device=logits.device
    )  # [T]
    chosen = chosen_logprobs(picked, temps, flat).tolist()  # [T]
    tops = top_logprobs_of(picked, temps, per_tok)  # [T][top] or None
    lps: list[list[float]] = []
    top_rows: list[list[list[tuple[int, float]]]] = []
    at = 0
    for row in tokens:
        lps.append(chosen[at : at + len(row)])
        if tops is not None:
            top_rows.append(tops[at : at + len(row)])
        at += len(row)
    return lps, top_rows if tops is not None else None


def _filtered_probs(scaled: torch.Tensor, per_pos: Sequence[SamplingParams]) -> torch.Tensor:
    """p after the filters: [B, K+1, V] -> [B, K+1, V]; ``per_pos`` [B*(K+1)] row-major."""
    B, K1, V = scaled.shape
    filtered = apply_filters(scaled.reshape(B * K1, V), per_pos)  # [B*(K+1), V]
    return torch.softmax(filtered, dim=-1).view(B, K1, V)


def _reject(
    drafts: ChainDrafts,
    generators: Sequence[torch.Generator | None] | None,
    shared: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts drawn from q: rejection sampling over every position. Returns accepted drafts
    [B] and the correction / bonus token [B] (meaningful on sampled rows)."""
    logits, params = drafts.target_logits, drafts.params
    B, K1, V = logits.shape
    K = K1 - 1
    temps = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params], device=logits.device
    )  # [B]
    per_pos = [p for p in params for _ in range(K1)]  # [B*(K+1)] settings, row-major
    p = _filtered_probs(logits / temps.view(B, 1, 1), per_pos)  # [B, K+1, V]
    valid = torch.arange(K, device=logits.device) < drafts.num_drafts.unsqueeze(1)  # [B, K]
    d = torch.where(valid, drafts.draft_tokens, 0)  # [B, K] padding -> a safe index
    sampled = [not prm.greedy for prm in params]  # [B]
    u = _uniforms(drafts.num_drafts.tolist(), sampled, generators, shared, K)  # [B, K+1] fp64
    u = u.to(logits.device)  # drawn on the CPU generators
    # fp64 only on gathered values: a [B, K+1, V] fp64 copy would be ~100 MB at V=49k.
    p_d = p[:, :K].gather(2, d.unsqueeze(2)).squeeze(2).double()  # [B, K]
    q = drafts.draft_probs
    assert q is not None
    q_d = q.gather(2, d.unsqueeze(2)).squeeze(2).double()  # [B, K]
    # u < p/q written as u*q < p: no division, and p(d) = 0 (filtered out) never passes.
    ok = (u[:, :K] * q_d < p_d) & valid
    num_acc = ok.long().cumprod(dim=1).sum(dim=1)  # [B]
    return num_acc, _correction(drafts, p, num_acc, u[:, K])


def _uniforms(
    num_drafts: Sequence[int],
    sampled: Sequence[bool],
    generators: Sequence[torch.Generator | None] | None,
    shared: torch.Generator | None,
    K: int,
) -> torch.Tensor:
    """U[0,1) [B, K+1] fp64: columns 0..n-1 are acceptance coins, column K the final draw.

    Rows with their own generator draw exactly n + 1 values from it (batch-independent);
    the rest come from one draw on ``shared``. Greedy rows keep the shared values, unused.
    """
    u = torch.rand(len(num_drafts), K + 1, generator=shared, dtype=torch.float64)
    if generators is None:
        return u
    for b, gen in enumerate(generators):
        if gen is None or not sampled[b]:
            continue
        n = num_drafts[b]
        own = torch.rand(n + 1, generator=gen, dtype=torch.float64)
        u[b, :n] = own[:n]
        u[b, K] = own[n]
    return u


def _correction(
    drafts: ChainDrafts, p: torch.Tensor, num_acc: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """The token emitted after the accepted prefix, for sampled rows [B].

    Rejected rows sample norm(max(0, p - q)) at the rejected position; rows that accepted all
    their drafts sample the bonus from p at position n (q taken as 0 there).
    """
    B = p.shape[0]
    rows = torch.arange(B, device=p.device)  # [B]
    p_a = p[rows, num_acc].double()  # [B, V] target at the first unaccepted position
    rejected = num_acc < drafts.num_drafts  # [B]
    residual = (p_a - _draft_dist_at(drafts, num_acc, rejected)).clamp_min(0.0)  # [B, V]
    # A rejection implies p(d) < q(d), so the residual has mass TV(p, q) > 0; fall back to p
    # only if rounding left exactly nothing.
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_a)
    return inverse_cdf(residual, u)


def _draft_dist_at(drafts: ChainDrafts, pos: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """q at each row's rejected position [B, V] fp64; zeros where nothing was rejected."""
    B, K1, V = drafts.target_logits.shape
    if K1 == 1:
        return torch.zeros(B, V, dtype=torch.float64, device=drafts.target_logits.device)
    at = pos.clamp(max=K1 - 2)  # [B] bonus rows point anywhere valid; masked below
    q = drafts.draft_probs
    assert q is not None
    q_a = q[torch.arange(B, device=q.device), at].double()  # [B, V]
    return torch.where(rejected.unsqueeze(1), q_a, 0.0)  # where, not *: padding may be NaN
