"""A suffix index with occurrence counts over token sequences, and draft trees from it.

``SuffixStore`` indexes every position of its sequences by the ``key_len`` tokens before it
(one exact int key per position; token ids < 2**21). A lookup takes the most recent
``max_candidates`` occurrences of the context's last ``key_len`` tokens, extends each match
backwards (up to ``max_match`` tokens) and keeps the occurrences with the longest match: the
deepest node of a suffix tree over the sequences, found without building one. What followed
those occurrences is that node's subtree, counted on the fly: ``draft_tree`` expands it
best-first, a child's estimated acceptance being its parent's times the share of the
parent's occurrences it continues with (SuffixDecoding's count ratios, with ``smoothing`` added
to the parent's count: one lone occurrence promises 0.67, not 1; an occurrence counts its
sequence's weight, which ``discount`` lowers once its writer changed), and stops where the
estimate falls below ``min_prob`` or the node budget is spent. A chain is the
budget-``depth``, one-child case. Smoothed, the estimates are calibrated on RL rollouts of
the default model: drafted nodes estimated at 0.1-0.2 / 0.5-0.6 / 0.9-1.0 were accepted 13% /
38% / 92% of the time (unsmoothed, nodes estimated above 0.9 were accepted 29% of the time),
so ``min_prob`` is a price per verified row.

Cost (CPython, measured by ``benchmarks.history index``): ``extend`` is O(key_len) per
token: one dict write; a lookup is O(max_candidates * max_match) to find the longest match plus
O(candidates * depth) to count the continuations, independent of how much is indexed.
Memory per indexed token: 4 bytes of token, plus, for a position whose key was seen before,
8 bytes in that key's occurrence array, and for a new key one dict entry (an int key and an int
value, ~100 bytes), and per sequence one weight. Rollouts of one prompt repeat most keys.

A sequence is removed exactly (its occurrences leave every key's array), so memory is bounded
by the tokens the caller keeps.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

KEY_BITS = 21
Occurrence = tuple[Sequence[int], int, float]  # sequence, follower position, weight
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


@dataclass(frozen=True)
class SuffixConfig:
    key_len: int = 2  # tokens a match needs at least (and the index key)
    max_match: int = 32  # a match is measured backwards up to this many tokens
    max_candidates: int = 128  # most recent occurrences of the key a lookup reads
    min_prob: float = 0.1  # a draft node's estimated acceptance must reach this (per request)
    smoothing: float = 0.5  # added to a node's occurrence count (one occurrence: 1 / 1.5)
    spec_factor: float = 4.0  # a draft is at most spec_factor * match length tokens deep
    max_store_tokens: int = 1 << 16  # one prompt's history (live sequences always kept)
    max_corpus_tokens: int = 1 << 17  # the cross-prompt corpus of finished outputs
    max_total_tokens: int = 1 << 22  # every prompt's history together
    # What an occurrence written before the target's weights last changed counts, per
    # update since (1: history is as good as new; 0: only what the current weights wrote).
    stale_weight: float = 0.25

    def validate(self) -> None:
        if not 1 <= self.key_len <= 63 // KEY_BITS:
            raise ValueError(f"key_len: must be in [1, {63 // KEY_BITS}], got {self.key_len}")
        if self.max_match < self.key_len:
            raise ValueError("max_match: must be >= key_len")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob: must be in [0, 1], got {self.min_prob}")
        if self.smoothing < 0.0:
            raise ValueError(f"smoothing: must be >= 0, got {self.smoothing}")
        if not 0.0 <= self.stale_weight <= 1.0:
            raise ValueError(f"stale_weight: must be in [0, 1], got {self.stale_weight}")


@dataclass(frozen=True)
class Match:
    """The longest match found: its length and the occurrences (sequence, follower position,
    the sequence's weight) that have it, most recent first."""

    length: int
    at: list[Occurrence]


def _key(tokens: Sequence[int], end: int, n: int) -> int:
    k = 0
    for t in tokens[end - n : end]:
        k = k << KEY_BITS | t
    return k


class SuffixStore:
    """Sequences (each growing at its end) and the index of their positions."""

    def __init__(self, key_len: int = 3) -> None:
        self.key_len = key_len
        self.seqs: dict[int, array[int]] = {}  # id -> tokens, oldest first
        self.weights: dict[int, float] = {}  # id -> what its occurrences count (new: 1)
        self.index: dict[int, int | array[int]] = {}  # key -> packed (id, pos): one or many
        self.num_tokens = 0
        self._next = 0

    def add(self, tokens: Iterable[int] = ()) -> int:
        sid = self._next
        self._next += 1
        self.seqs[sid] = array("i")
        self.weights[sid] = 1.0
        self.extend(sid, tokens)
        return sid

    def discount(self, factor: float) -> None:
        """Scale what every sequence indexed so far counts (the writer changed)."""
        for sid in self.weights:
            self.weights[sid] *= factor

    def extend(self, sid: int, tokens: Iterable[int]) -> None:
        """Append to sequence ``sid``; each new token is indexed as the follower of the
        ``key_len`` tokens before it."""
        seq, n, index = self.seqs[sid], self.key_len, self.index
        before = len(seq)
        for t in tokens:
            end = len(seq)
            if end >= n:
                key, packed = _key(seq, end, n), sid << _POS_BITS | end
                old = index.get(key)
                if old is None:
                    index[key] = packed
                elif isinstance(old, int):
                    index[key] = array("q", (old, packed))
                else:
                    old.append(packed)
            seq.append(t)
        self.num_tokens += len(seq) - before

    def remove(self, sid: int) -> None:
        """Forget a sequence and every occurrence in it."""
        seq, n, index = self.seqs.pop(sid), self.key_len, self.index
        del self.weights[sid]
        self.num_tokens -= len(seq)
        for end in range(n, len(seq)):
            key = _key(seq, end, n)
            old = index.get(key)
            if isinstance(old, int):
                if old >> _POS_BITS == sid:
                    del index[key]
            elif old is not None:
                kept = array("q", (p for p in old if p >> _POS_BITS != sid))
                if len(kept) > 1:
                    index[key] = kept
                elif kept:
                    index[key] = kept[0]
                else:
                    del index[key]

    def match(self, context: Sequence[int], max_match: int, max_candidates: int,
              max_kept: int = 32) -> Match:
        """The occurrences whose preceding tokens match the longest suffix of ``context``
        (the ``max_kept`` most recent of them)."""
        n, end = self.key_len, len(context)
        if end < n:
            return Match(0, [])
        if not isinstance(context, array):  # slices must compare like with like
            context = array("i", context[-max_match:])
            end = len(context)
        hits = self.index.get(_key(context, end, n))
        if hits is None:
            return Match(0, [])
        recent = (hits,) if isinstance(hits, int) else hits[-max_candidates:]
        best = 0
        at: list[Occurrence] = []
        for packed in reversed(recent):
            sid, pos = packed >> _POS_BITS, packed & _POS_MASK
            seq = self.seqs[sid]
            # The longest L in [n, hi] with seq[pos-L:pos] == context[end-L:]: equal suffixes
            # nest, so a binary search over slice comparisons (run in C) finds it.
            lo, hi = n, min(max_match, pos, end)
            if hi < best:
                continue
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if seq[pos - mid : pos] == context[end - mid : end]:
                    lo = mid
                else:
                    hi = mid - 1
            if lo > best:
                best, at = lo, [(seq, pos, self.weights[sid])]
            elif lo == best and len(at) < max_kept:
                at.append((seq, pos, self.weights[sid]))
            if best == max_match and len(at) >= max_kept:
                break  # nothing longer exists; enough occurrences to count
        return Match(best, at)


@dataclass(frozen=True)
class Draft:
    """Draft nodes in topological order: token, parent (0 = root, nodes 1..N), and the
    estimated probability that the target accepts the path down to the node."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]


def draft_tree(
    match: Match, depth: int, budget: int, topk: int, min_prob: float,
    own: Sequence[int] | None = None, smoothing: float = 0.0,
) -> Draft:
    """The most probable continuations of ``match``: at most ``budget`` nodes, ``depth`` deep,
    ``topk`` children per node. ``own``: the requesting sequence itself; an occurrence in it
    that runs past its end continues into the draft (a repeating loop drafts its period).
    ``smoothing`` is added to each node's count of continuing occurrences: a child's share
    is ``count / (continuing + smoothing)``, so that few occurrences promise less."""
    out = Draft([], [], [])
    if not match.at or budget <= 0 or depth <= 0:
        return out
    # Heap of (-prob, tiebreak, node id, depth, occurrences, path tokens).
    heap: list[tuple[float, int, int, int, list[Occurrence], list[int]]] = []
    order = itertools.count()  # ties pop in push order
    push = functools.partial(_push_children, heap, order, topk=topk, min_prob=min_prob,
                             own=own, smoothing=smoothing)
    push(match.at, 1.0, 0, 0, [])
    while heap and len(out.tokens) < budget:
        neg, _, parent, d, at, path = heapq.heappop(heap)
        out.tokens.append(path[-1])
        out.parents.append(parent)
        out.probs.append(-neg)
        node = len(out.tokens)
        if d + 1 < depth:
            push(at, -neg, node, d + 1, path)
    return out


def _push_children(
    heap: list, order: itertools.count, at: list[Occurrence], prob: float,
    node: int, d: int, path: list[int], *, topk: int, min_prob: float,
    own: Sequence[int] | None, smoothing: float,
) -> None:
    """Push a node's children: its occurrences grouped by the token that follows, each
    group counting its occurrences' weights."""
    groups: dict[int, list[Occurrence]] = {}
    counts: dict[int, float] = {}
    for seq, pos, w in at:
        if pos < len(seq):
            t = seq[pos]
        elif seq is own and pos - len(seq) < len(path):
            t = path[pos - len(seq)]
        else:
            continue
        groups.setdefault(t, []).append((seq, pos + 1, w))
        counts[t] = counts.get(t, 0.0) + w
    total = sum(counts.values()) + smoothing  # occurrences that go on
    ranked = sorted(groups.items(), key=lambda kv: -counts[kv[0]])[:topk]
    for token, nxt in ranked:
        p = prob * counts[token] / total if total else 0.0
        if p >= min_prob:
            heapq.heappush(heap, (-p, next(order), node, d, nxt, [*path, token]))
