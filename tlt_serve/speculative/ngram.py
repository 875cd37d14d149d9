"""Model-free drafts by suffix matching (prompt lookup / n-gram speculation).

The last n tokens of a request's context are looked up among earlier token sequences; the
tokens that followed the most recent earlier occurrence become the draft. Longest n wins
(longer context, more specific evidence); for equal n the request's own history wins over live
siblings (other samples of the same prompt), which win over the corpus of finished outputs.

Defaults ``min_n=2, max_n=4`` (a judgement, not yet measured on traffic): a single repeated
token (n=1) is weak evidence on a 49k vocab and would propose on almost every step, spending
verify compute that is only nearly free at batch 1; a longer n only narrows which earlier
occurrence is copied, while each extra n costs one more index entry per token. Both are knobs
of ``NgramConfig``.

Cost, with r = max_n - min_n + 1: ``append`` is O(r * max_n) per token (r dict writes of
n-tuples), independent of history length; a lookup is O(r * max_n) per source plus O(k) to copy
the draft; eviction deletes an evicted sequence's entries at the same cost per token, so each
corpus token costs O(r * max_n) over its life. Memory: at most r entries per indexed token.
Measured in CPython (r = 3, random tokens): <= ~0.5 KB and ~3 us per appended token, ~2 us per
lookup. The corpus is capped by ``max_corpus_tokens``; a request's own index by its length.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Match:
    """A suffix match: ``n`` tokens matched; the follower is ``seq``'s token at ``pos``."""

    n: int
    seq: int
    pos: int


class NgramIndex:
    """n-gram -> its most recent follower, over token sequences, updated as they grow.

    Sequences are added in order and only the newest one grows (``append``). An n-gram is
    indexed once a token follows it, so the suffix of the newest sequence only matches EARLIER
    occurrences. With ``max_tokens`` the oldest sequences are evicted (never the newest) while
    the total exceeds it. Entries are only written by ``add_sequence`` / ``append``.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4, max_tokens: int | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self._follow: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (seq id, pos)
        self._next_id = 0
        self._total = 0

    @property
    def num_tokens(self) -> int:
        return self._total

    @property
    def sequence_ids(self) -> list[int]:
        """Live sequence ids, oldest first."""
        return list(self._seqs)

    def tokens(self, seq: int) -> Sequence[int]:
        """The tokens of a live sequence (a view: do not mutate)."""
        return self._seqs[seq]

    def add_sequence(self, tokens: Iterable[int] = ()) -> int:
        """Start a new (newest) sequence holding ``tokens``; returns its id. May evict."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = []
        self.append(tokens)
        return sid

    def append(self, tokens: Iterable[int]) -> None:
        """Extend the newest sequence; only the n-grams ending at the old end are new."""
        sid = next(reversed(self._seqs))
        seq, lo, hi = self._seqs[sid], self.min_n, self.max_n
        start = len(seq)
        for t in tokens:
            end = len(seq)  # the new token's position: it follows the n-grams ending here
            for n in range(lo, min(hi, end) + 1):
                self._follow[tuple(seq[end - n : end])] = (sid, end)
            seq.append(int(t))
        self._total += len(seq) - start
        self._evict()

    def match(self, context: Sequence[int]) -> Match | None:
        """Longest suffix of ``context`` (max_n down to min_n) indexed here, most recent one."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            hit = self._follow.get(tuple(context[len(context) - n :]))
            if hit is not None:
                return Match(n, hit[0], hit[1])
        return None

    def continuation(self, m: Match, k: int, cyclic: bool = False) -> list[int]:
        """Up to k tokens from ``m.pos`` on in sequence ``m.seq``.

        ``cyclic``: the context IS that sequence, so a match at ``pos`` says it repeats with
        period ``len - pos``; past the end, keep copying from the draft itself (ext[pos + j] =
        draft[pos + j - len]), which turns a short-period loop into a full k-token draft.
        """
        seq = self._seqs[m.seq]
        out = seq[m.pos : m.pos + k]
        period = len(seq) - m.pos
        while cyclic and len(out) < k:
            out.append(out[len(out) - period])
        return out

    def propose(self, k: int) -> list[int]:
        """Draft for the newest sequence from its own history (empty when nothing matches)."""
        if not self._seqs or k <= 0:
            return []
        newest = next(reversed(self._seqs))
        m = self.match(self._seqs[newest])
        return [] if m is None else self.continuation(m, k, cyclic=m.seq == newest)

    def _evict(self) -> None:
        if self.max_tokens is None:
            return
        while self._total > self.max_tokens and len(self._seqs) > 1:
            sid, seq = self._seqs.popitem(last=False)
            self._total -= len(seq)
            # Exact removal: an entry still naming the evicted (oldest) sequence has no later
            # occurrence anywhere, since every later one would have overwritten it.
            for end in range(1, len(seq)):
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    gram = tuple(seq[end - n : end])
                    hit = self._follow.get(gram)
                    if hit is not None and hit[0] == sid:
                        del self._follow[gram]


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 2
    max_n: int = 4
    max_corpus_tokens: int = 1 << 17  # <= ~65 MB of index: ~4 groups of 8 x 4k-token samples


class NgramProposer:
    """Per-request own-history indexes, live sibling groups and a bounded corpus.

    Lifecycle per request: ``add_request`` (prompt, optional group) -> ``append`` accepted
    tokens after every step -> ``propose`` before a verify -> ``finish`` (moves its output,
    with ``max_n`` prompt tokens of context, into the corpus). The corpus evicts the oldest
    sequences first once over ``max_corpus_tokens``; ``add_to_corpus`` also feeds it outside
    traffic (e.g. previous-epoch rollouts of the same prompts).
    """

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = cfg = config or NgramConfig()
        self.corpus = NgramIndex(cfg.min_n, cfg.max_n, cfg.max_corpus_tokens)
        self._own: dict[str, NgramIndex] = {}
        self._prompt_len: dict[str, int] = {}
        self._group_of: dict[str, str] = {}
        self._groups: dict[str, list[str]] = {}

    def add_request(self, rid: str, token_ids: Sequence[int], group: str | None = None) -> None:
        index = NgramIndex(self.config.min_n, self.config.max_n)
        index.add_sequence(token_ids)
        self._own[rid] = index
        self._prompt_len[rid] = len(token_ids)
        if group is not None:
            self._group_of[rid] = group
            self._groups.setdefault(group, []).append(rid)

    def append(self, rid: str, token_ids: Iterable[int]) -> None:
        """Record tokens the request committed (accepted drafts + correction / bonus)."""
        self._own[rid].append(token_ids)

    def propose(self, rid: str, k: int) -> list[int]:
        """Up to k draft tokens for ``rid`` (possibly none); reads only, mutates nothing."""
        own = self._own[rid]
        if k <= 0:
            return []
        (sid,) = own.sequence_ids
        context = own.tokens(sid)
        best, source = own.match(context), own
        group = self._group_of.get(rid)
        siblings = [self._own[s] for s in self._groups[group] if s != rid] if group else []
        for index in [*siblings, self.corpus]:
            if best is not None and best.n == self.config.max_n:
                break  # nothing can beat it; ties keep the earlier source
            m = index.match(context)
            if m is not None and (best is None or m.n > best.n):
                best, source = m, index
        if best is None:
            return []
        return source.continuation(best, k, cyclic=source is own)

    def finish(self, rid: str, to_corpus: bool = True) -> None:
        """Forget a request; by default its output joins the corpus (tail if over the cap)."""
        index = self._own.pop(rid)
        start = max(0, self._prompt_len.pop(rid) - self.config.max_n)
        group = self._group_of.pop(rid, None)
        if group is not None:
            self._groups[group].remove(rid)
            if not self._groups[group]:
                del self._groups[group]
        (sid,) = index.sequence_ids
        if to_corpus:
            self.add_to_corpus(index.tokens(sid)[start:])

    def add_to_corpus(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) > self.config.min_n:
            self.corpus.add_sequence(token_ids[-self.config.max_corpus_tokens :])
