"""Prompt logprobs of a prefill: each asked prompt token's logprob given the tokens before
it, read off the hidden states the prefill computed anyway (no second forward)."""

from __future__ import annotations

import torch

from tlt_serve.engine.request import PromptLogprobs, Request
from tlt_serve.engine.sampler import own_kernels
from tlt_serve.engine.scheduler import ScheduledBatch
from tlt_serve.models.llama import LlamaModel

# Bytes of logits formed at once (positions x vocabulary). Above ~32 MB glibc hands each new
# tensor fresh pages from the kernel, and their first touch costs: the head of 256 positions
# of a 49152-token vocabulary as fp32 (50 MB) took 34 ms with its widening, 19.5 without. Where
# the head's product is torch's bf16 GEMM, its bf16 logits go into one buffer reused by every
# chunk of a step (256 positions: 17 ms, 8.5 per 128, against 10 ms for 128 into a new tensor)
# and the log-softmax kernel widens each row in cache.
CHUNK_BYTES = 24 << 20
MAX_CHUNK = 256  # positions
RANK_PROBE = 64  # without the CPU kernel: a token's rank is read off the top this many,
#   where it is among them


def first_needed(req: Request) -> int:
    """The first prompt position whose hidden state scoring ``req`` reads (the prefix
    cache may hold at most the positions before it)."""
    return max(req.params.prompt_logprobs_start, 1) - 1


@torch.inference_mode()  # as the forward ran: the own kernels serve only without autograd
def score_prompts(model: LlamaModel, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
    """Sets ``prompt_logprobs`` of every request in a prefill that asked for them; siblings
    (which share their leader's prefill) get their leader's. ``hidden`` [F, Q, H]: row f
    holds ``batch.forward[f]``'s computed positions from its ``cached_tokens`` on (a row
    decoding beside them holds one position, and was scored when it was admitted)."""
    scoring = [f for f, req in enumerate(batch.forward[batch.decodes :], start=batch.decodes)
               if req.params.scores_prompt]
    if scoring:
        chunk, out = _chunks(model, hidden)
        for f in scoring:
            batch.forward[f].prompt_logprobs = _score(model, batch.forward[f], hidden[f],
                                                      chunk, out)
    for i, req in enumerate(batch.prefilling, start=batch.decodes):
        if req.params.scores_prompt and req.prompt_logprobs is None:
            req.prompt_logprobs = batch.forward[batch.logit_index[i]].prompt_logprobs


def _chunks(model: LlamaModel, hidden: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """Positions per head product, and the bf16 buffer [chunk, V] its logits go into where
    the head rounds them to bf16 anyway (None: fp32 logits, a new tensor a chunk)."""
    V = model.lm_head.weight.shape[0]
    narrow = max(1, min(MAX_CHUNK, CHUNK_BYTES // (2 * V)))
    if model.lm_head.rounds_to_bf16(narrow, hidden.dtype):
        return narrow, torch.empty(narrow, V, dtype=torch.bfloat16, device=hidden.device)
    return max(1, min(MAX_CHUNK, CHUNK_BYTES // (4 * V))), None


def _score(model: LlamaModel, req: Request, hidden: torch.Tensor, chunk: int,
           out: torch.Tensor | None) -> PromptLogprobs:
    """hidden [Q, H] of positions ``cached_tokens..``; the token at position p is scored by
    the logits of position p - 1, ``chunk`` positions at a time (their logits into ``out``
    where given, see ``_chunks``)."""
    start, k = req.params.prompt_logprobs_start, req.params.prompt_logprobs
    prompt = req.prompt_ids
    first = max(start, 1)  # position 0 follows nothing
    assert req.cached_tokens <= first - 1, "the scored prompt's prefix was not computed"
    logprobs: list[float | None] = [None] * (first - start)
    ranks: list[int | None] = [None] * (first - start)
    top: list[list[tuple[int, float]]] = [[] for _ in range(first - start)]
    targets = torch.tensor(prompt[first:], device=hidden.device)  # [P]
    own = own_kernels(hidden.device)  # the sampler's: a token scored as it was sampled
    fused = own.scores if own is not None else None
    V = model.lm_head.weight.shape[0]
    for lo in range(0, len(prompt) - first, chunk):
        rows = slice(first - 1 - req.cached_tokens + lo,
                     first - 1 - req.cached_tokens + min(lo + chunk, len(prompt) - first))
        logits = model.logits(hidden[rows], out)  # [C, V] fp32, or bf16 in out (exact)
        tgt = targets[lo : lo + logits.shape[0]].unsqueeze(1)  # [C, 1]
        if fused is not None:  # two passes over each row, nothing [C, V] written
            mx, logsum, rank = fused(logits, tgt.squeeze(1))  # [C] each
            chosen = (logits.gather(1, tgt).float() - mx[:, None]) - logsum[:, None]  # [C, 1]
            if k:
                values, ids = logits.float().topk(min(k, V), dim=-1)  # [C, k] best first
                values = (values - mx[:, None]) - logsum[:, None]
        else:
            lp = torch.log_softmax(logits.float(), dim=-1)  # [C, V]
            chosen = lp.gather(1, tgt)  # [C, 1]
            values, ids = lp.topk(min(max(k, RANK_PROBE), V), dim=-1)  # [C, P]
            rank = _ranks(lp, chosen, values)
        logprobs.extend(chosen.squeeze(1).tolist())
        ranks.extend(rank.tolist())
        if k:
            top.extend([list(zip(i, v, strict=True)) for i, v in
                        zip(ids[:, :k].tolist(), values[:, :k].tolist(), strict=True)])
        else:
            top.extend([] for _ in range(logits.shape[0]))
    return PromptLogprobs(start, logprobs, ranks, top)


def _ranks(lp: torch.Tensor, chosen: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """1 + how many tokens are likelier than the chosen one, per row. lp [C, V], chosen
    [C, 1], probe [C, P] the row's P largest: a token at least as likely as the P-th has
    every likelier token among them; the others count over the whole row (exact either
    way, one pass over the vocabulary saved for most rows)."""
    ranks = (probe > chosen).sum(dim=1) + 1  # [C]
    beyond = (chosen.squeeze(1) < probe[:, -1]).nonzero().squeeze(1)  # [R]
    if beyond.numel():
        ranks[beyond] = (lp[beyond] > chosen[beyond]).sum(dim=1) + 1
    return ranks

