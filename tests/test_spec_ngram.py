"""The n-gram proposer alone: suffix matches, source priority, corpus cap, incremental == brute."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_serve.speculative.ngram import NgramConfig, NgramIndex, NgramProposer


def brute_own(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Longest suffix (hi..lo) found earlier with a follower; latest occurrence; cyclic copy."""
    L = len(tokens)
    for n in range(min(hi, L), lo - 1, -1):
        for p in range(L - 1, n - 1, -1):  # p: the follower's position, latest first
            if tokens[p - n : p] == tokens[L - n :]:
                out: list[int] = []
                for j in range(k):
                    out.append(tokens[p + j] if p + j < L else out[p + j - L])
                return out
    return []


def brute_corpus(seqs: list[list[int]], context: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(context)), lo - 1, -1):
        for seq in reversed(seqs):  # newest sequence first, then latest position in it
            for p in range(len(seq) - 1, n - 1, -1):
                if seq[p - n : p] == context[len(context) - n :]:
                    return seq[p : p + k]
    return []


def own(tokens: list[int], k: int, lo: int = 2, hi: int = 4) -> list[int]:
    index = NgramIndex(lo, hi)
    index.add_sequence(tokens)
    return index.propose(k)


def test_repetitive_sequence_gives_its_continuation() -> None:
    assert own([5, 6, 7, 8, 5, 6, 7], 3) == [8, 5, 6]  # [5, 6, 7] was followed by 8
    # Past the end of history the match implies a period (here 4): keep copying.
    assert own([5, 6, 7, 8, 5, 6, 7], 6) == [8, 5, 6, 7, 8, 5]
    assert own([1, 2, 9, 9, 9], 4) == [9, 9, 9, 9]  # a degenerate loop drafts a full chain


def test_longest_then_most_recent_match() -> None:
    # [2, 3] was followed by 4 then by 5; [1, 2, 3] only by 4: the longer match wins.
    assert own([1, 2, 3, 4, 0, 2, 3, 5, 0, 1, 2, 3], 1) == [4]
    assert own([1, 2, 3, 4, 0, 2, 3, 5, 0, 9, 2, 3], 1) == [5]  # equal n: the latest


def test_no_match_no_drafts() -> None:
    assert own([1, 2, 3, 4, 5], 4) == []
    assert own([7], 4) == []
    assert own([], 4) == []
    assert own([1, 2, 1, 2], 0) == []
    assert own([3, 1, 4, 1], 3, lo=2) == []  # only a 1-gram repeats; min_n = 2 ignores it
    assert own([3, 1, 4, 1], 3, lo=1) == [4, 1, 4]


def test_own_history_preferred_over_corpus_at_equal_length() -> None:
    p = NgramProposer(NgramConfig(min_n=2, max_n=3))
    p.add_to_corpus([1, 2, 3, 40, 41])
    p.add_request("a", [1, 2, 3, 50, 8, 1, 2, 3])
    assert p.propose("a", 2) == [50, 8]  # both hold [1, 2, 3]: the request's own wins


def test_longer_corpus_match_beats_shorter_own_match() -> None:
    p = NgramProposer(NgramConfig(min_n=2, max_n=3))
    p.add_to_corpus([8, 1, 2, 3, 60])
    p.add_request("c", [7, 2, 3, 50, 1, 2, 3])
    assert p.propose("c", 1) == [60]  # corpus [1, 2, 3] (n=3) over own [2, 3] (n=2)


def test_siblings_then_corpus_after_finish() -> None:
    p = NgramProposer()
    p.add_request("g#0", [1, 2], group="g")
    p.add_request("g#1", [1, 2], group="g")
    p.append("g#0", [10, 11, 12, 13])
    p.append("g#1", [10, 11])
    assert p.propose("g#1", 2) == [12, 13]  # from the live sibling
    assert p.propose("g#0", 2) == []  # its own history has no earlier [.., 12, 13]
    p.finish("g#0")
    p.finish("g#1", to_corpus=False)
    p.add_request("h", [5, 1, 2, 10])
    assert p.propose("h", 3) == [11, 12, 13]  # from the finished sample, via the corpus
    assert p.corpus.num_tokens == 6  # prompt tail (max_n tokens of context) + output


def test_corpus_cap_evicts_oldest() -> None:
    corpus = NgramIndex(2, 4, max_tokens=10)
    for start in (1, 6, 11):
        corpus.add_sequence(range(start, start + 5))
    assert corpus.num_tokens == 10 and len(corpus.sequence_ids) == 2
    assert corpus.match([0, 1, 2]) is None  # the first sequence is gone
    m = corpus.match([6, 7])
    assert m is not None and corpus.continuation(m, 3) == [8, 9, 10]
    p = NgramProposer(NgramConfig(max_corpus_tokens=4))
    p.add_to_corpus(list(range(100, 110)))  # longer than the cap: only its tail is kept
    assert p.corpus.num_tokens == 4


def test_finish_cleans_up_groups() -> None:
    p = NgramProposer()
    p.add_request("x", [1, 2, 3], group="g")
    p.finish("x", to_corpus=False)
    assert p.corpus.num_tokens == 0
    p.add_request("y", [1, 2, 3, 1, 2], group="g")
    assert p.propose("y", 2) == [3, 1]


tokens_st = st.lists(st.integers(0, 3), max_size=40)  # 4 symbols: plenty of matches


@settings(max_examples=150, deadline=None)
@given(
    chunks=st.lists(tokens_st.map(lambda t: t[:6]), max_size=12),
    lo=st.integers(1, 3),
    span=st.integers(0, 3),
    k=st.integers(1, 7),
)
def test_incremental_equals_rebuild_and_brute_force(
    chunks: list[list[int]], lo: int, span: int, k: int
) -> None:
    index = NgramIndex(lo, lo + span)
    index.add_sequence()
    seen: list[int] = []
    for chunk in chunks:
        index.append(chunk)
        seen += chunk
        expect = brute_own(seen, k, lo, lo + span)
        assert index.propose(k) == expect
        assert own(seen, k, lo, lo + span) == expect


@settings(max_examples=150, deadline=None)
@given(
    seqs=st.lists(tokens_st.map(lambda t: t[:15]), max_size=8),
    context=tokens_st,
    cap=st.integers(5, 40),
    k=st.integers(1, 5),
)
def test_corpus_equals_brute_force(
    seqs: list[list[int]], context: list[int], cap: int, k: int
) -> None:
    corpus = NgramIndex(1, 3, max_tokens=cap)
    live: list[list[int]] = []
    for seq in seqs:
        corpus.add_sequence(seq)
        live.append(seq)
        while sum(map(len, live)) > cap and len(live) > 1:
            live.pop(0)  # the oldest goes first
        m = corpus.match(context)
        got = [] if m is None else corpus.continuation(m, k)
        assert got == brute_corpus(live, context, k, 1, 3)
        assert [list(corpus.tokens(s)) for s in corpus.sequence_ids] == live
