"""Mixed steps: requests admitted while others run prefill in the same forward as the running
ones decode. The batch the scheduler forms (plain Python), and on a tiny model in fp32 that
outputs equal those of separate prefill steps: greedy and seeded, with speculation, n > 1, a
scored prompt, the prefix cache, captured features."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.harness import PROMPTS
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import (
    CacheConfig,
    CaptureConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from tlt_serve.engine.request import Request
from tlt_serve.engine.scheduler import MIXED_PADDING, Sampled, Scheduler


def _scheduler(budget: int, mixed: int = 4096) -> Scheduler:
    return Scheduler(8, 4096, budget, frozenset({0}), lambda *_: None, mixed=mixed)


def _admit(sched: Scheduler, rid: str, length: int) -> None:
    sched.add(Request(rid, [1] * length, SamplingParams(max_new_tokens=50), None))


def _step(sched: Scheduler):
    batch = sched.schedule()
    assert batch is not None
    n = len(batch.samplers)
    sched.postprocess(batch, Sampled([5] * n, [0.0] * n, None), "v")
    return batch


def test_arrivals_prefill_beside_the_running_rows_within_the_padding_budget() -> None:
    sched = _scheduler(budget=64)
    for i in range(2):
        _admit(sched, f"a{i}", 10)
    first = _step(sched)  # nothing runs yet: a plain prefill
    assert first.decodes == 0 and first.is_prefill and len(first.forward) == 2
    _admit(sched, "b", 12)
    mixed = _step(sched)
    assert mixed.is_prefill and mixed.decodes == 2
    assert [r.rid for r in mixed.forward] == ["a0", "a1", "b"] == [r.rid for r in
                                                                  mixed.samplers]
    assert mixed.logit_index == [0, 1, 2] and [r.rid for r in mixed.prefilling] == ["b"]
    assert [r.row for r in mixed.forward] == [0, 1, 2]
    decode = _step(sched)
    assert not decode.is_prefill and decode.decodes == 3
    # 3 running rows + a prompt of 64: padded 4 x 64 = 256 <= MIXED_PADDING x 64: mixed
    _admit(sched, "c", 64)
    assert _step(sched).decodes == 3
    # 4 running rows + a prompt of 60 > the padding budget: a prefill step of its own
    _admit(sched, "d", MIXED_PADDING * 64 // 5 + 10)
    alone = _step(sched)
    assert alone.decodes == 0 and [r.rid for r in alone.forward] == ["d"]
    off = _scheduler(64, mixed=0)
    _admit(off, "x", 4)
    _step(off)
    _admit(off, "y", 4)
    assert _step(off).decodes == 0
    short = _scheduler(64, mixed=8)  # prompt parts of up to 8 tokens mix (a padded forward)
    _admit(short, "x", 4)
    _step(short)
    for rid, length in (("y", 8), ("z", 9), ("w", 3)):
        _admit(short, rid, length)
    with_y = _step(short)
    assert with_y.decodes == 1 and [r.rid for r in with_y.prefilling] == ["y"]
    alone = _step(short)  # z is too long to mix: it and w prefill alone
    assert alone.decodes == 0 and [r.rid for r in alone.forward] == ["z", "w"]


def test_a_prompt_counts_only_what_the_prefix_cache_lacks() -> None:
    """With the cache's estimate the budget counts computed tokens: prompts that are mostly
    cached fit several to a step."""
    sched = Scheduler(8, 4096, 64, frozenset({0}), lambda *_: None,
                      cached=lambda r: len(r.prompt_ids) - 8, mixed=4096)
    for i in range(4):
        _admit(sched, f"p{i}", 200)
    assert len(_step(sched).forward) == 4  # 4 x 8 computed tokens, not 4 x 200


def _llm(path: Path, mixed: bool, spec: SpecConfig | None = None, prefix: bool = False,
         capture: bool = False) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", max_model_len=256),
        cache=CacheConfig(max_num_seqs=8, prefix_cache=prefix),
        scheduler=SchedulerConfig(mixed_steps=mixed),
        spec=spec or SpecConfig(), capture=CaptureConfig(enabled=capture)))


def _staggered(llm: LLM, seeded: bool) -> dict[str, tuple[list[int], list[float], object]]:
    """Requests arriving while others run: one more every third step, a group of n = 2 and a
    scored prompt among them. Returns each sample's tokens, logprobs and prompt logprobs."""
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] * 2
    eng = llm.engine
    out: dict[str, tuple[list[int], list[float], object]] = defaultdict(lambda: ([], [], None))
    step = 0
    while prompts or eng.has_work():
        if prompts and step % 3 == 0:
            i = len(prompts)
            params = SamplingParams(
                max_new_tokens=12 + i, temperature=0.8 if seeded else 0.0, top_p=0.9,
                seed=i if seeded else None, ignore_eos=True, logprobs=True,
                n=2 if i == 7 else 1, prompt_logprobs=2 if i == 5 else -1)
            eng.add_request(f"r{i}", prompts.pop(), params)
        for o in eng.step():
            tokens, logprobs, scored = out[o.rid]
            out[o.rid] = (tokens + o.token_ids, logprobs + o.logprobs,
                          o.prompt_logprobs if o.prompt_logprobs is not None else scored)
        step += 1
    return dict(out)


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for rid in a:
        assert a[rid][0] == b[rid][0], rid
        torch.testing.assert_close(a[rid][1], b[rid][1], atol=1e-4, rtol=0)
    scored = [rid for rid in a if a[rid][2] is not None]
    assert scored == ["r5"] and b["r5"][2] is not None
    torch.testing.assert_close(a["r5"][2].logprobs[1:], b["r5"][2].logprobs[1:], atol=1e-4,
                               rtol=0)
    assert a["r5"][2].ranks == b["r5"][2].ranks


@pytest.mark.parametrize("method", ["off", "suffix"])
@pytest.mark.parametrize("seeded", [False, True])
def test_mixed_steps_give_the_outputs_of_separate_prefill_steps(tiny_model_dir, method,
                                                                seeded) -> None:
    spec = SpecConfig(method=method)
    mixed, apart = _llm(tiny_model_dir, True, spec), _llm(tiny_model_dir, False, spec)
    _same(_staggered(mixed, seeded), _staggered(apart, seeded))
    assert mixed.engine.stats.mixed_steps > 0 and apart.engine.stats.mixed_steps == 0
    assert mixed.engine.stats.prefill_steps == apart.engine.stats.prefill_steps


def test_mixed_steps_with_the_prefix_cache_and_capture(tiny_model_dir) -> None:
    """Arrivals that take a cached prefix beside decoding rows: the outputs and the captured
    samples (tokens, features) of separate prefill steps without the cache."""
    mixed = _llm(tiny_model_dir, True, prefix=True, capture=True)
    apart = _llm(tiny_model_dir, False, prefix=False, capture=True)
    for seeded in (False, True):
        _same(_staggered(mixed, seeded), _staggered(apart, seeded))
    assert mixed.engine.stats.mixed_steps > 0
    assert mixed.engine.prefix is not None and mixed.engine.prefix.stats().hit_tokens > 0
    got, want = mixed.engine.capture.take(0, 1 << 40), apart.engine.capture.take(0, 1 << 40)
    key = lambda s: s.tokens.tolist()  # noqa: E731  (finishing order differs)
    got, want = sorted(got, key=key), sorted(want, key=key)
    assert len(got) == len(want) > 0
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x.tokens, y.tokens)
        torch.testing.assert_close(x.features, y.features, atol=1e-5, rtol=0)
