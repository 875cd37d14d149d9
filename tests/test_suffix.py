"""The suffix index and the history proposer, against brute force."""

from __future__ import annotations

import random
from array import array
from collections import Counter

import pytest

from tlt_serve.engine.request import Request
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative.suffix import SuffixConfig, SuffixStore, draft_tree
from tlt_serve.speculative.suffix_proposer import SuffixDrafts


def brute_match(seqs: list[list[int]], context: list[int], key_len: int, max_match: int
                ) -> tuple[int, Counter[int]]:
    """Longest suffix match (>= key_len, <= max_match) and the followers that have it."""
    best, followers = 0, Counter[int]()
    for seq in seqs:
        for pos in range(key_len, len(seq)):
            n = 0
            while n < max_match and n < pos and n < len(context) and \
                    seq[pos - 1 - n] == context[-1 - n]:
                n += 1
            if n < key_len:
                continue
            if n > best:
                best, followers = n, Counter([seq[pos]])
            elif n == best:
                followers[seq[pos]] += 1
    return best, followers


def test_longest_match_and_follower_counts_equal_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        vocab = rng.choice([3, 5, 50])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
        store = SuffixStore(key_len=2)
        for s in seqs:
            store.add(s)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        m = store.match(context, max_match=6, max_candidates=10_000, max_kept=10_000)
        length, followers = brute_match(seqs, context, 2, 6)
        assert m.length == length
        assert Counter(seq[pos] for seq, pos, _ in m.at) == followers


def test_removal_leaves_the_index_a_rebuild_would_have() -> None:
    rng = random.Random(1)
    seqs = [[rng.randrange(6) for _ in range(50)] for _ in range(5)]
    store = SuffixStore(key_len=3)
    sids = [store.add(s[:20]) for s in seqs]
    for sid, s in zip(sids, seqs, strict=True):
        store.extend(sid, s[20:])  # grown in pieces, interleaved
    for sid in sids[:3]:
        store.remove(sid)
    fresh = SuffixStore(key_len=3)
    fresh._next = store._next
    for sid, s in zip(sids[3:], seqs[3:], strict=True):
        fresh._next = sid
        fresh.add(s)

    def norm(index: dict) -> dict:
        return {k: sorted([v] if isinstance(v, int) else v) for k, v in index.items()}

    assert norm(store.index) == norm(fresh.index)
    assert store.num_tokens == 100


def test_draft_tree_probabilities_are_count_ratios() -> None:
    store = SuffixStore(key_len=2)
    for tail in ([7, 8], [7, 8], [7, 9], [5, 1]):
        store.add([1, 2, 3, *tail])
    m = store.match([1, 2, 3], max_match=8, max_candidates=100)
    assert m.length == 3 and len(m.at) == 4
    d = draft_tree(m, depth=2, budget=10, topk=4, min_prob=0.0)
    nodes = {(p, t): prob for t, p, prob in zip(d.tokens, d.parents, d.probs, strict=True)}
    assert nodes[(0, 7)] == 0.75 and nodes[(0, 5)] == 0.25
    seven = d.tokens.index(7) + 1
    assert nodes[(seven, 8)] == 0.5 and nodes[(seven, 9)] == 0.25
    assert d.tokens[0] == 7  # most probable first; parents precede children
    assert all(p < i for i, p in enumerate(d.parents, start=1))
    chain = draft_tree(m, depth=4, budget=4, topk=1, min_prob=0.4)
    assert chain.tokens == [7, 8] and chain.probs == [0.75, 0.5]
    cut = draft_tree(m, depth=4, budget=4, topk=1, min_prob=0.6)
    assert cut.tokens == [7]


def test_smoothing_discounts_few_occurrences() -> None:
    store = SuffixStore(key_len=2)
    store.add([1, 2, 3, 7, 8])
    m = store.match([1, 2, 3], max_match=8, max_candidates=100)
    d = draft_tree(m, depth=4, budget=4, topk=1, min_prob=0.3, smoothing=0.5)
    assert d.tokens == [7, 8] and d.probs == pytest.approx([2 / 3, 4 / 9])  # then 8 ends it
    for _ in range(3):
        store.add([1, 2, 3, 7, 8])
    m = store.match([1, 2, 3], max_match=8, max_candidates=100)
    d = draft_tree(m, depth=2, budget=2, topk=1, min_prob=0.0, smoothing=0.5)
    assert d.probs == pytest.approx([4 / 4.5, (4 / 4.5) ** 2])  # four agreeing: near 1


def test_discounted_sequences_count_their_weight() -> None:
    store = SuffixStore(key_len=2)
    for tail in ([7], [7], [7]):
        store.add([1, 2, 3, *tail])
    store.discount(0.25)  # three old occurrences of 7 weigh 0.75
    store.add([1, 2, 3, 9])  # one new occurrence of 9 weighs 1
    m = store.match([1, 2, 3], max_match=8, max_candidates=100)
    d = draft_tree(m, depth=1, budget=2, topk=2, min_prob=0.0, smoothing=0.25)
    assert d.tokens == [9, 7] and d.probs == pytest.approx([1 / 2, 0.75 / 2])
    store.discount(0.0)  # nothing indexed counts: no draft clears a positive price
    m = store.match([1, 2, 3], max_match=8, max_candidates=100)
    assert draft_tree(m, depth=1, budget=2, topk=2, min_prob=0.01).tokens == []


def test_history_written_by_old_weights_drafts_at_a_discount() -> None:
    drafts = SuffixDrafts(SuffixConfig(key_len=2, max_match=4, stale_weight=0.5))
    prompt = [1, 2, 3, 4]
    drafts.release(_req("old", prompt, [10, 11, 12, 13]))
    before = drafts.propose_scored([_req("a", prompt, [10, 11])], [2])[0]
    drafts.weights_changed()
    after = drafts.propose_scored([_req("b", prompt, [10, 11])], [2])[0]
    assert before.tokens == after.tokens == [12, 13]
    # One occurrence: 1 / (1 + 0.5) while current; stale, it weighs 0.5, as much as the
    # smoothing: 0.5 / (0.5 + 0.5).
    assert before.probs[0] == pytest.approx(2 / 3) and after.probs[0] == pytest.approx(1 / 2)


def test_a_repeating_sequence_drafts_its_period_past_its_end() -> None:
    store = SuffixStore(key_len=2)
    loop = [4, 5, 6] * 3
    sid = store.add(loop)
    own = store.seqs[sid]
    m = store.match(own, max_match=32, max_candidates=100)
    d = draft_tree(m, depth=7, budget=7, topk=1, min_prob=0.0, own=own)
    assert d.tokens == [4, 5, 6, 4, 5, 6, 4]


def _req(rid: str, prompt: list[int], out: list[int]) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_new_tokens=64), None)
    r.output_ids = list(out)
    return r


def test_history_is_per_prompt_survives_requests_and_stays_bounded() -> None:
    cfg = SuffixConfig(key_len=2, max_match=4, max_store_tokens=60, max_corpus_tokens=40,
                       max_total_tokens=200, spec_factor=1.0)
    drafts = SuffixDrafts(cfg)
    prompt, other = [1, 2, 3, 4], [9, 9, 8]
    answer = [10, 11, 12, 13, 14, 15]
    first = _req("a", prompt, answer)
    drafts.propose([first], [4])
    drafts.release(first)  # finished: its output is history for this prompt
    again = _req("b", prompt, [10, 11])
    assert drafts.propose([again], [4]) == [[12, 13, 14, 15]]
    # Another prompt with the same two tokens finds them in the corpus (a 2-token match
    # drafts at most 2: spec_factor 1).
    stranger = _req("c", other, [10, 11])
    assert drafts.propose([stranger], [3]) == [[12, 13]]
    # A live sibling's tokens are visible at once.
    sib = _req("d", prompt, [10, 11, 12, 20, 21, 22, 23])
    drafts.propose([sib], [1])
    late = _req("e", prompt, [20, 21])
    assert drafts.propose([late], [2]) == [[22, 23]]
    for r in (again, stranger, sib, late):
        drafts.release(r)
    for i in range(100):  # many more prompts and samples: memory stays bounded
        r = _req(f"x{i}", [i, i + 1, i + 2], list(range(i, i + 20)))
        drafts.propose([r], [2])
        drafts.release(r)
        kept = sum(h.store.num_tokens for h in drafts.histories.values())
        assert drafts.num_tokens == kept + drafts.corpus.num_tokens  # the running count
        assert drafts.num_tokens <= cfg.max_total_tokens + 60 + 40
        assert all(h.store.num_tokens <= 60 + 40 for h in drafts.histories.values())
    assert drafts.corpus.num_tokens <= cfg.max_corpus_tokens
    assert not drafts._live


def test_a_sample_that_never_drafted_still_becomes_history() -> None:
    """Most samples of a rollout end while the batch is too large to speculate: released
    without ever being asked for a draft, they must still feed their siblings' tail."""
    drafts = SuffixDrafts(SuffixConfig(key_len=2, max_match=4))
    prompt = [1, 2, 3, 4]
    drafts.release(_req("early", prompt, [10, 11, 12, 13, 14]))
    tail = _req("tail", prompt, [10, 11])
    assert drafts.propose([tail], [3]) == [[12, 13, 14]]
    drafts.release(tail)
    assert not drafts._live and drafts.histories[bytes(array("i", prompt))].live == 0


def test_a_row_is_priced_per_request_of_the_step() -> None:
    """A chain from one earlier occurrence: estimates 2/3, 4/9, 8/27, ... (smoothing 0.5). At
    batch 1 it is cut below 0.1, at batch 4 below 0.4; propose_scored leaves the cut to its
    caller (min_prob whatever the batch)."""
    drafts = SuffixDrafts(SuffixConfig(key_len=2, max_match=8, min_prob=0.1))
    prompt = [1, 2, 3, 4]
    drafts.release(_req("old", prompt, list(range(10, 30))))
    one = [_req("a", prompt, [10, 11])]
    four = [_req(f"b{i}", prompt, [10, 11]) for i in range(4)]
    assert drafts.propose(one, [8]) == [list(range(12, 17))]  # (2/3)^5 = 0.13, ^6 < 0.1
    assert drafts.propose(four, [8] * 4) == [[12, 13]] * 4  # (2/3)^2 = 0.44, ^3 < 0.4
    assert [d.tokens for d in drafts.propose_scored(four, [8] * 4)] == [list(range(12, 17))] * 4
    trees = drafts.propose_tree(four, 8, 2, [8] * 4)
    assert [t.tokens for t in trees] == [(12, 13)] * 4
