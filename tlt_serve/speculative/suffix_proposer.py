"""Drafts from rollout history: a suffix index per prompt plus a cross-prompt corpus.

RL samples the same prompt n times side by side and again every epoch, so what was written
for a prompt before is the best free draft for it. Histories are keyed by the prompt's token
ids, whichever way the samples arrive (the n samples of one request, requests that repeat a
prompt, the same prompt in a later epoch). A prompt's history holds the prompt itself, its
live samples (each growing as it decodes, visible to its siblings at once) and its finished
samples, oldest evicted first past ``max_store_tokens``; histories of prompts nobody runs are
evicted least recently used past ``max_total_tokens``. Finished outputs of every prompt also
join a bounded corpus, consulted when it matches longer than the prompt's own history.

Each sequence starts with the last ``max_match`` prompt tokens, so a match can reach back
across the start of the output, and a request's own sequence is its lookup context.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tlt_serve.engine.draft_tree import DraftTree
from tlt_serve.engine.request import Request
from tlt_serve.speculative.suffix import Draft, Match, SuffixConfig, SuffixStore, draft_tree


@dataclass
class _History:
    """One prompt's samples, live and finished."""

    store: SuffixStore
    finished: deque[int] = field(default_factory=deque)  # sequence ids, oldest first
    live: int = 0


@dataclass
class _Live:
    history: _History
    sid: int
    synced: int  # output tokens already indexed


class SuffixDrafts:
    name = "suffix"
    needs_features = False

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = cfg = config or SuffixConfig()
        cfg.validate()
        self.histories: OrderedDict[bytes, _History] = OrderedDict()  # least recent first
        self.corpus = SuffixStore(cfg.key_len)
        self._live: dict[str, _Live] = {}
        self._total = 0  # tokens in every history's store (kept, not summed per release)

    @property
    def num_tokens(self) -> int:
        """Tokens indexed: every history and the corpus."""
        return self.corpus.num_tokens + self._total

    # ---- the proposer interface -----------------------------------------------------------
    def observe(self, req: Request, features: torch.Tensor) -> None:
        pass

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """A chain per request: the most frequent continuation, as deep as its estimated
        acceptance stays above the price of a row at this batch size (at most ``ks[b]``)."""
        price = self.price(len(reqs))
        return [self.draft(r, k, k, 1, price).tokens for r, k in zip(reqs, ks, strict=True)]

    def propose_scored(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Chains down to ``min_prob`` whatever the batch size, with each draft's estimated
        acceptance (falling along it): the caller cuts them at its own price."""
        return [self.draft(r, k, k, 1) for r, k in zip(reqs, ks, strict=True)]

    def price(self, batch_size: int) -> float:
        """The estimated acceptance a verified row must reach in a step of ``batch_size``
        requests: ``min_prob`` per request. A row costs about the same at any batch size
        (the verify forward is compute-bound past a few rows), while what a plain step
        yields grows with the batch."""
        return min(1.0, self.config.min_prob * batch_size)

    def propose_tree(
        self, reqs: Sequence[Request], depth: int, topk: int, budgets: Sequence[int]
    ) -> list[DraftTree]:
        """A tree per request over its most probable continuations (``budgets[b]`` nodes)."""
        trees, price = [], self.price(len(reqs))
        for r, budget in zip(reqs, budgets, strict=True):
            d = self.draft(r, min(depth, budget), budget, topk, price)
            trees.append(DraftTree(tuple(d.tokens), tuple(d.parents)))
        return trees

    def release(self, req: Request) -> None:
        """The request ended: its sample joins its prompt's history and the corpus, whether
        or not it ever drafted (most samples of a rollout end while the batch is too large
        to speculate, and are the history the tail drafts from)."""
        live = self._live.get(req.rid) or self._start(req)
        del self._live[req.rid]
        self._sync(req, live)
        h, cfg = live.history, self.config
        h.live -= 1
        h.finished.append(live.sid)
        seq = h.store.seqs[live.sid]
        if len(seq) > cfg.max_match:  # it wrote something: the corpus gets it too
            self.corpus.add(seq)
        while h.store.num_tokens > cfg.max_store_tokens and len(h.finished) > 1:
            before = h.store.num_tokens
            h.store.remove(h.finished.popleft())
            self._total -= before - h.store.num_tokens
        while self.corpus.num_tokens > cfg.max_corpus_tokens and len(self.corpus.seqs) > 1:
            self.corpus.remove(next(iter(self.corpus.seqs)))
        self._evict_histories()

    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    def weights_changed(self) -> None:
        """Everything indexed so far was written by the old weights: its occurrences count
        ``stale_weight`` times what they did. The weight is per sequence, so a sample still
        running counts at the discount for its later tokens too (RL updates weights between
        rollouts, when none runs)."""
        for h in self.histories.values():
            h.store.discount(self.config.stale_weight)
        self.corpus.discount(self.config.stale_weight)

    # ---- drafting -------------------------------------------------------------------------
    def draft(self, req: Request, depth: int, budget: int, topk: int,
              min_prob: float | None = None) -> Draft:
        """The request's draft tree (``min_prob``: the config's unless given)."""
        cfg = self.config
        match, context = self.lookup(req)
        depth = min(depth, math.ceil(cfg.spec_factor * match.length))
        cut = cfg.min_prob if min_prob is None else min_prob
        return draft_tree(match, depth, budget, topk, cut, own=context,
                          smoothing=cfg.smoothing)

    def lookup(self, req: Request) -> tuple[Match, Sequence[int]]:
        """The longest match of the request's sequence (its prompt's history first, the
        corpus where that matches longer) and the sequence itself."""
        live = self._live.get(req.rid) or self._start(req)
        self._sync(req, live)
        cfg = self.config
        context = live.history.store.seqs[live.sid]
        match = live.history.store.match(context, cfg.max_match, cfg.max_candidates)
        if match.length < cfg.max_match:
            wider = self.corpus.match(context, cfg.max_match, cfg.max_candidates)
            if wider.length > match.length:
                match = wider
        return match, context

    def _start(self, req: Request) -> _Live:
        key = array("i", req.prompt_ids).tobytes()
        h = self.histories.get(key)
        before = 0
        if h is None:
            h = self.histories[key] = _History(SuffixStore(self.config.key_len))
            h.store.add(req.prompt_ids)
        else:
            before = h.store.num_tokens
        self.histories.move_to_end(key)
        h.live += 1
        sid = h.store.add(req.prompt_ids[-self.config.max_match :])
        self._total += h.store.num_tokens - before
        live = self._live[req.rid] = _Live(h, sid, 0)
        return live

    def _sync(self, req: Request, live: _Live) -> None:
        new = req.output_ids[live.synced :]
        if new:
            live.history.store.extend(live.sid, new)
            live.synced += len(new)
            self._total += len(new)

    def _evict_histories(self) -> None:
        """Least recently used prompts with nothing running go first."""
        for key in list(self.histories):
            if self._total <= self.config.max_total_tokens:
                return
            h = self.histories[key]
            if h.live == 0:
                self._total -= h.store.num_tokens
                del self.histories[key]
