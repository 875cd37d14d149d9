"""The prefix cache: which entry a prompt reuses, where a finished sequence's KV is kept and
what gives way (plain Python), and, on a tiny model in fp32, that outputs with it equal
outputs without it (greedy and seeded, speculation on, n > 1, repeated prompts, multi-turn
conversations), that KV computed under old weights is never reused, and that with a drafter
or capture (which need every prompt position's features) it keeps those beside the KV and
changes neither the drafts nor the captured samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import PROMPTS
from tlt_serve import LLM, SamplingParams
from tlt_serve.backends.native.updates import EngineUpdates
from tlt_serve.config import (
    CacheConfig,
    CaptureConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from tlt_serve.engine.prefix_cache import PrefixCache


class Copies:
    def __init__(self) -> None:
        self.done: list[tuple[int, int, int]] = []

    def __call__(self, src: int, dst: int, n: int) -> None:
        self.done.append((src, dst, n))


def test_admit_takes_the_longest_entry_and_leaves_the_last_prompt_token() -> None:
    copies = Copies()
    pc = PrefixCache(copies)
    pc.keep([1, 2, 3, 4, 5], row=7, version="0")
    pc.keep([1, 2, 9], row=6, version="0")
    assert copies.done == [] and sorted(pc.entries) == [6, 7]  # kept where they are
    got = pc.admit([(2, [1, 2, 3, 4, 5, 6]), (3, [1, 2, 3, 4, 5]), (4, [1, 2, 9, 9]),
                    (5, [7, 7]), (1, None)], "0", spare=range(6, 8))
    assert got == [5, 4, 3, 0, 0]  # the last prompt token is always computed
    assert sorted(copies.done) == [(6, 4, 3), (7, 2, 5), (7, 3, 4)]
    assert pc.admit([(2, [1, 2, 3, 4, 5, 6])], "1", spare=[]) == [0]  # other weights
    st = pc.stats()
    assert (st.entries, st.tokens, st.hits, st.hit_tokens, st.lookups) == (2, 8, 3, 12, 5)


def test_admit_reads_entries_in_admitted_rows_before_writing_them() -> None:
    """A step admitting into rows that hold entries: one found in place costs no copy; an
    entry a later row's request needs is read before its own row is written; the rest move
    to spare rows, else go; a copy cycle falls back to computing one prompt."""
    copies = Copies()
    pc = PrefixCache(copies)
    pc.keep([1, 2, 3], row=0, version="0")
    pc.keep([4, 5, 6], row=1, version="0")
    pc.keep([7, 8, 9], row=2, version="0")
    got = pc.admit([(0, [4, 5, 6, 0]), (1, [4, 5, 6, 1]), (2, [0])], "0", spare=[5])
    assert got == [3, 3, 0]
    # row 0's entry (needed by nobody) moved to the spare row first; row 1's stays in place
    # and is copied into row 0 before anything writes row 1; row 2's has nowhere to go
    assert copies.done == [(0, 5, 3), (1, 0, 3)] and sorted(pc.entries) == [5]
    cyc = PrefixCache(Copies())
    cyc.keep([1, 1], row=0, version="0")
    cyc.keep([2, 2], row=1, version="0")
    assert sorted(cyc.admit([(0, [2, 2, 0]), (1, [1, 1, 0])], "0", spare=[])) == [0, 2]
    # with row exchanges a cycle costs nothing computed: rows 0 -> 1 -> 2 -> 0 by two swaps
    swaps = Copies()
    rot = PrefixCache(Copies(), swap_rows=swaps)
    for row, t in enumerate(([1, 1], [2, 2], [3, 3])):
        rot.keep(t, row=row, version="0")
    got = rot.admit([(0, [3, 3, 0]), (1, [1, 1, 0]), (2, [2, 2, 0])], "0", spare=[])
    assert got == [2, 2, 2] and rot.entries == {}
    rows = {0: "a", 1: "b", 2: "c"}  # what each row holds: the swaps applied in order
    for a, b, _ in swaps.done:
        rows[a], rows[b] = rows[b], rows[a]
    assert rows == {0: "c", 1: "a", 2: "b"}  # each claim finds the entry it asked for
    pc.keep([3, 3, 3], row=0, version="0")
    pc.clear()
    assert pc.entries == {} and pc.admit([(0, [3, 3, 3, 3])], "0", spare=[]) == [0]


def test_keep_replaces_an_earlier_turn_and_skips_a_known_prefix() -> None:
    pc = PrefixCache(Copies())
    pc.keep([1, 2, 3], row=3, version="0")
    pc.keep([1, 2, 3, 4, 5], row=2, version="0")  # the next turn: the earlier entry goes
    assert list(pc.entries) == [2] and pc.entries[2].tokens == [1, 2, 3, 4, 5]
    pc.keep([1, 2], row=1, version="0")  # an entry starts with it: not kept
    pc.keep([1], row=0, version="1")  # other weights: kept beside
    assert sorted(pc.entries) == [0, 2]
    short = PrefixCache(Copies(), min_tokens=4)
    short.keep([1, 2, 3], row=3, version="0")
    assert short.entries == {}


def llm(path: Path, prefix: bool, spec: SpecConfig | None = None,
        capture: bool = False, mixed: bool = True) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", max_model_len=256),
        cache=CacheConfig(max_num_seqs=8, prefix_cache=prefix),
        scheduler=SchedulerConfig(mixed_steps=mixed),
        spec=spec or SpecConfig(), capture=CaptureConfig(enabled=capture)))


def params(seeded: bool, n: int = 1) -> SamplingParams:
    if seeded:
        return SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7, n=n,
                              ignore_eos=True, logprobs=True)
    return SamplingParams(max_new_tokens=24, temperature=0.0, n=n, ignore_eos=True,
                          logprobs=True)


def same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x.samples, y.samples, strict=True):
            assert s.token_ids == t.token_ids
            torch.testing.assert_close(s.logprobs, t.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["off", "ngram", "suffix"])
@pytest.mark.parametrize("seeded", [False, True])
def test_outputs_with_the_cache_equal_outputs_without(tiny_model_dir, method, seeded) -> None:
    """Repeated prompts as separate requests, n > 1, then every conversation's next turn
    (prompt + answer + a question): same tokens and logprobs; the later rounds reuse."""
    spec = SpecConfig(method=method)
    on, off = llm(tiny_model_dir, True, spec), llm(tiny_model_dir, False, spec)
    prompts = [on.tokenizer.encode(p) for p in PROMPTS]
    first_on, first_off = on.generate(prompts, params(seeded)), off.generate(prompts,
                                                                             params(seeded))
    same(first_on, first_off)
    assert all(r.samples[0].cached_tokens == 0 for r in first_on)
    question = on.tokenizer.encode(" And then?")
    turn = [p + r.samples[0].token_ids + question for p, r in zip(prompts, first_on,
                                                                   strict=True)]
    second = on.generate(turn, params(seeded))
    same(second, off.generate(turn, params(seeded)))
    for p, r in zip(prompts, second, strict=True):
        # the first turn's KV: its prompt and every answer token but the last (never fed)
        assert r.samples[0].cached_tokens >= len(p) + 24 - 1
    again = on.generate(prompts * 2, params(seeded, n=2))
    same(again, off.generate(prompts * 2, params(seeded, n=2)))
    # 20 samples through 8 rows: an entry in a row a step admits into, with no spare row
    # to move to, gives way; most prompts still find theirs
    reused = [min(s.cached_tokens for s in r.samples) for r in again]
    assert all(c in (0, len(p) - 1) for c, p in zip(reused, prompts * 2, strict=True))
    assert sum(c > 0 for c in reused) >= len(reused) // 2, reused
    assert on.engine.prefix is not None and on.engine.prefix.stats().hits >= 2 * len(PROMPTS)


@pytest.mark.parametrize("seeded", [False, True])
def test_separate_requests_of_one_prompt_share_its_prefill(tiny_model_dir, seeded) -> None:
    """A prompt's n samples sent as n requests (slime's pattern) in one step: the first
    computes the prompt, the others take its KV and logits (their prompt reported cached),
    with the outputs of computing each; a different cache salt, or a scored prompt, computes
    its own; without the cache every request computes its prompt."""
    on, off = llm(tiny_model_dir, True), llm(tiny_model_dir, False)
    prompts = [on.tokenizer.encode(p) for p in PROMPTS[:2]]
    batch = [p for p in prompts for _ in range(3)]  # within the 8 rows: one step
    got = on.generate(batch, params(seeded))
    same(got, off.generate(batch, params(seeded)))
    cached = [r.samples[0].cached_tokens for r in got]
    assert cached == [c for p in prompts for c in (0, len(p), len(p))], cached
    salted = [SamplingParams(max_new_tokens=4, cache_salt=salt) for salt in ("a", "b", "a")]
    mixed = on.generate([prompts[0]] * 3, salted)
    # salted apart from the entries above and from each other, but for the third
    assert [r.samples[0].cached_tokens for r in mixed] == [0, 0, len(prompts[0])]
    scored = on.generate([prompts[1]] * 2, SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    assert all(r.samples[0].prompt_logprobs is not None for r in scored)
    offs = off.generate(batch, params(seeded))
    assert all(r.samples[0].cached_tokens == 0 for r in offs)


@pytest.mark.parametrize("seeded", [False, True])
def test_prompts_opening_alike_take_the_prefix_from_a_running_row(tiny_model_dir,
                                                                   seeded) -> None:
    """Conversations opening with one long system prompt, sent together to an empty cache:
    the first computes it, the others wait a step and copy it from its row while it is still
    being answered (``SHARED_PREFIX``), with the outputs of computing each."""
    from tlt_serve.engine.scheduler import SHARED_PREFIX

    on, off = llm(tiny_model_dir, True), llm(tiny_model_dir, False)
    system = (on.tokenizer.encode(" ".join(PROMPTS)) * 3)[: SHARED_PREFIX + 16]
    prompts = [system + on.tokenizer.encode(q) for q in PROMPTS[1:4]]
    got = on.generate(prompts, params(seeded))
    same(got, off.generate(prompts, params(seeded)))
    cached = [r.samples[0].cached_tokens for r in got]
    assert cached[0] == 0 and all(c >= len(system) for c in cached[1:]), cached
    short = [system[: SHARED_PREFIX // 2] + on.tokenizer.encode(q) for q in PROMPTS[1:3]]
    fresh = llm(tiny_model_dir, True)  # an empty cache, a shared opening too short to wait
    assert [r.samples[0].cached_tokens for r in fresh.generate(short, params(seeded))] == [0, 0]


def test_no_kv_from_old_weights_and_no_reuse_when_features_are_needed(
    tiny_model_dir, tiny_drafter_dir
) -> None:
    on, off = llm(tiny_model_dir, True), llm(tiny_model_dir, False)
    prompts = [on.tokenizer.encode(p) for p in PROMPTS]
    on.generate(prompts, params(False))
    embed = on.engine.model.embed_tokens.weight.detach().clone()
    for eng in (on, off):
        EngineUpdates(eng.engine).load([("model.embed_tokens.weight", embed * 1.5)], "1")
    assert on.engine.prefix is not None and on.engine.prefix.entries == {}
    after = on.generate(prompts, params(False))
    same(after, off.generate(prompts, params(False)))
    assert all(r.samples[0].cached_tokens == 0 for r in after)
    # a request running across an update is not kept: its KV mixes two targets
    on.engine.add_request("x", prompts[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    on.engine.step()
    EngineUpdates(on.engine).load([("model.embed_tokens.weight", embed)], "2")
    while on.engine.has_work():
        on.engine.step()
    assert on.engine.prefix.entries == {}


@pytest.mark.parametrize("needs", ["drafter", "capture", "both"])
def test_a_drafter_and_capture_reuse_prefixes_with_their_features(
    tiny_model_dir, tiny_drafter_dir, needs
) -> None:
    """With a drafter (which catches up from every prompt position's features) or capture
    (which keeps them for training) the cache keeps the features beside the KV: repeated
    prompts, n > 1 and next turns reuse their prefixes, outputs equal outputs without the
    cache, the drafter drafts as much, and the captured samples (tokens, features) equal
    those captured without it."""
    spec = SpecConfig()
    if needs != "capture":
        spec = SpecConfig(method="drafter", drafter=str(tiny_drafter_dir),
                          min_draft_confidence=0.0)
    capture = needs != "drafter"
    # no mixed steps: a cached prompt would mix where the same prompt computed in full does
    # not, and the drafts are compared step for step
    on = llm(tiny_model_dir, True, spec, capture, mixed=False)
    off = llm(tiny_model_dir, False, spec, capture, mixed=False)
    assert on.engine.kv.features is not None and off.engine.kv.features is None
    prompts = [on.tokenizer.encode(p) for p in PROMPTS]
    question = on.tokenizer.encode(" And then?")
    for seeded in (False, True):
        first = on.generate(prompts, params(seeded))
        same(first, off.generate(prompts, params(seeded)))
        turn = [p + r.samples[0].token_ids + question for p, r in zip(prompts, first,
                                                                       strict=True)]
        second = on.generate(turn, params(seeded))
        same(second, off.generate(turn, params(seeded)))
        assert all(r.samples[0].cached_tokens >= len(p) + 23 for p, r in zip(prompts, second,
                                                                            strict=True))
        again = on.generate(prompts, params(seeded, n=2))
        same(again, off.generate(prompts, params(seeded, n=2)))
        assert any(s.cached_tokens > 0 for r in again for s in r.samples)
    if needs != "capture":
        a, b = on.engine.stats.spec, off.engine.stats.spec
        assert a.steps > 0 and (a.drafted, a.accepted) == (b.drafted, b.accepted)
    if capture:
        got, want = on.engine.capture.take(0, 1 << 40), off.engine.capture.take(0, 1 << 40)
        assert len(got) == len(want) == 8 * len(PROMPTS)  # 2 x (5 + 5 + 2 x 5)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x.tokens, y.tokens)
            torch.testing.assert_close(x.features, y.features, atol=1e-5, rtol=0)


def test_both_dialects_report_cached_tokens_and_flush_empties_the_cache(tiny_model_dir) -> None:
    """Over HTTP: a repeated prompt reports its cached tokens (SGLang ``meta_info``, OpenAI
    ``usage.prompt_tokens_details``) and the metrics count them; ``/flush_cache`` (idle)
    empties the cache: the next request computes everything."""
    from tests.harness import serve

    s = serve(tiny_model_dir)
    try:
        with s.http() as http:
            ids = list(range(5, 45))
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6,
                                                          "temperature": 0}}
            first = http.post("/generate", json=body).json()
            assert first["meta_info"]["cached_tokens"] == 0
            again = http.post("/generate", json=body).json()
            assert again["meta_info"]["cached_tokens"] == len(ids) - 1
            assert again["output_ids"] == first["output_ids"]
            chat = {"prompt": ids + first["output_ids"][:-1] + [7],
                    "max_tokens": 4, "temperature": 0}
            usage = http.post("/v1/completions", json=chat).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == len(ids) + 6 - 1
            metrics = http.get("/metrics").text
            assert "prefix_cache_hit_tokens_total" in metrics
            assert http.post("/flush_cache").status_code == 200
            flushed = http.post("/generate", json=body).json()
            assert flushed["meta_info"]["cached_tokens"] == 0
            assert flushed["output_ids"] == first["output_ids"]
    finally:
        s.stop()
