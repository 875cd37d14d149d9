"""Engine behaviour on a tiny random model (fp32): exactness, sampling, stops, aborts, weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.harness import PROMPTS, make_llm
from tlt_serve import LLM, SamplingParams
from tlt_serve.backends.native.updates import EngineUpdates
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tlt_serve.contract.controls import ControlError, WeightsUpdated
from tlt_serve.engine.outputs import RequestResult
from tlt_serve.models.loader import iter_safetensors
from tlt_serve.sampling_params import ParamError

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return make_llm(tiny_model_dir, rows=6, prefill=64)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_greedy_alone_equals_hf(llm: LLM, hf) -> None:
    for text in PROMPTS:
        ids = llm.tokenizer.encode(text)
        (res,) = llm.generate([ids], GREEDY)
        assert res.samples[0].token_ids == hf_greedy(hf, ids, 24), text


def test_greedy_in_mixed_batch_equals_hf(llm: LLM, hf) -> None:
    """16 requests, different lengths and settings, more than the 6 KV rows: queueing,
    prefill batches split by the token budget, and rows compacted as requests finish."""
    prompts, params = [], []
    for i in range(16):
        prompts.append(llm.tokenizer.encode(PROMPTS[i % 5] * (1 + i % 3)))
        if i % 2 == 0:
            params.append(
                SamplingParams(max_new_tokens=5 + 2 * i, temperature=0.0, ignore_eos=True)
            )
        else:
            params.append(
                SamplingParams(
                    max_new_tokens=3 + i,
                    temperature=0.7 + 0.05 * i,
                    top_p=0.9,
                    top_k=20 + i,
                    min_p=0.01,
                    n=1 + i % 3,
                    seed=i,
                    ignore_eos=True,
                )
            )
    results = llm.generate(prompts, params)
    for prompt, p, res in zip(prompts, params, results, strict=True):
        assert len(res.samples) == p.n
        for s in res.samples:
            assert len(s.token_ids) == p.max_new_tokens
            assert s.finish is not None and s.finish.type == "length"
        if p.greedy:
            assert res.samples[0].token_ids == hf_greedy(hf, prompt, p.max_new_tokens)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_logprobs_are_targets(llm: LLM, hf) -> None:
    ids = llm.tokenizer.encode(PROMPTS[2])
    p = SamplingParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    s = llm.generate([ids], p)[0].samples[0]
    full = torch.tensor([ids + s.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(full).logits[0, len(ids) - 1 : -1], dim=-1)
    expected = ref.gather(1, torch.tensor(s.token_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
    for row, top in zip(ref, s.top_logprobs, strict=True):
        assert [t for t, _ in top] == row.topk(3).indices.tolist()


def test_temperature_scales_reported_logprobs(llm: LLM, hf) -> None:
    ids = llm.tokenizer.encode(PROMPTS[0])
    p = SamplingParams(max_new_tokens=4, temperature=0.5, seed=3, ignore_eos=True, logprobs=True)
    s = llm.generate([ids], p)[0].samples[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + s.token_ids])).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits / 0.5, dim=-1).gather(1, torch.tensor(s.token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(s.logprobs), ref.squeeze(1), atol=1e-4, rtol=0)


def test_seeds_reproducible_and_distinct(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[1])

    def sample(seed: int, batch_noise: bool) -> list[int]:
        p = SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        extra = [SamplingParams(max_new_tokens=9, temperature=1.0, ignore_eos=True)] * 3
        prompts = [ids] + ([ids[:3], ids[:5], ids] if batch_noise else [])
        res = llm.generate(prompts, [p] + (extra if batch_noise else []))
        return res[0].samples[0].token_ids

    a = sample(7, False)
    assert a == sample(7, True)  # same seed, other requests in the batch: same output
    assert a != sample(8, False)


def test_n_samples_share_prefill_and_differ(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[3])
    p = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=11, ignore_eos=True)
    if llm.engine.prefix is not None:
        llm.engine.prefix.clear()  # earlier tests ran this prompt: the leader would reuse it
    before = llm.engine.stats.prefill_steps
    res = llm.generate([ids], p)[0]
    assert llm.engine.stats.prefill_steps - before == 1
    assert [s.cached_tokens for s in res.samples] == [0] + [len(ids)] * 3
    assert len({tuple(s.token_ids) for s in res.samples}) == 4
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, n=3, ignore_eos=True)
    outs = llm.generate([ids], greedy)[0].samples
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def test_stop_conditions(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[0])
    free = llm.generate([ids], GREEDY)[0].samples[0]
    stop_tok = free.token_ids[5]
    s = llm.generate(
        [ids], SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[stop_tok])
    )
    first = free.token_ids.index(stop_tok)
    assert s[0].samples[0].token_ids == free.token_ids[: first + 1]
    assert s[0].samples[0].finish.matched == stop_tok

    stop_str = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    if stop_str.strip():
        r = llm.generate([ids], SamplingParams(max_new_tokens=24, temperature=0.0, stop=[stop_str]))
        out = r[0].samples[0]
        assert out.finish.type == "stop" and out.finish.matched == stop_str
        assert stop_str not in out.text and free.text.startswith(out.text)


def test_stop_text_trimmed_or_kept(llm: LLM) -> None:
    """A stop token's text and a stop string leave the text (as SGLang and vLLM trim them)
    unless include_stop_in_text (SGLang's no_stop_trim) keeps them; token ids are the same."""
    ids = llm.tokenizer.encode(PROMPTS[0])
    free = llm.generate([ids], GREEDY)[0].samples[0]
    stop_tok = next(t for t in free.token_ids[2:] if llm.tokenizer.decode([t]).strip())
    first = free.token_ids.index(stop_tok)
    upto = llm.tokenizer.decode(free.token_ids[:first])
    with_tok = llm.tokenizer.decode(free.token_ids[: first + 1])
    for keep, want in ((False, upto), (True, with_tok)):
        params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[stop_tok],
                                include_stop_in_text=keep)
        out = llm.generate([ids], params)[0].samples[0]
        assert out.token_ids == free.token_ids[: first + 1] and out.text == want

    stop_str = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop_str.strip(), "the fixture's greedy text should not be blank here"
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop=[stop_str],
                            include_stop_in_text=True)
    out = llm.generate([ids], params)[0].samples[0]
    assert out.finish.matched == stop_str and out.text.endswith(stop_str)
    assert free.text.startswith(out.text) and out.text.count(stop_str) == 1


def test_eos_stops_unless_ignored(tiny_model_dir) -> None:
    llm = make_llm(tiny_model_dir, rows=2)
    ids = llm.tokenizer.encode(PROMPTS[0])
    free = llm.generate([ids], GREEDY)[0].samples[0]
    eos = free.token_ids[3]  # pretend this token is EOS
    llm.engine.scheduler.eos_ids = frozenset({eos})
    out = llm.generate([ids], SamplingParams(max_new_tokens=24, temperature=0.0))[0].samples[0]
    assert out.finish.type == "stop" and out.token_ids[-1] == eos
    out = llm.generate([ids], GREEDY)[0].samples[0]
    assert out.token_ids == free.token_ids and out.finish.type == "length"


def test_abort_returns_partial_output(llm: LLM) -> None:
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[1])
    eng.add_request("a", ids, SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    eng.add_request("b", ids, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    eng.add_request("c", ids, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    got: dict[str, RequestResult] = {r: RequestResult(r, ids) for r in "abc"}
    for _ in range(4):
        for out in eng.step():
            got[out.rid].add(out)
    (aborted,) = eng.abort("a")
    got["a"].add(aborted)
    assert got["a"].finish.type == "abort" and len(got["a"].token_ids) == 4  # prefill + 3
    while eng.has_work():
        for out in eng.step():
            got[out.rid].add(out)
    assert got["b"].token_ids == got["c"].token_ids and len(got["b"].token_ids) == 5
    assert eng.abort("a") == [] and eng.abort("nope") == []


def test_bad_prompts_are_refused(llm: LLM) -> None:
    with pytest.raises(ParamError, match="input_ids"):
        llm.engine.add_request("x", [], GREEDY)
    with pytest.raises(ParamError, match="outside vocabulary"):
        llm.engine.add_request("x", [1, 10**6], GREEDY)
    with pytest.raises(ParamError, match="limit"):
        llm.engine.add_request("x", [1] * 300, GREEDY)
    with pytest.raises(ParamError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ParamError, match="top_p"):
        SamplingParams(top_p=0)
    assert not llm.engine.has_work()


def test_length_capped_by_max_model_len(tiny_model_dir) -> None:
    llm = make_llm(tiny_model_dir, rows=2, max_len=32)
    ids = llm.tokenizer.encode(PROMPTS[4])[:20]
    out = llm.generate([ids], SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    s = out[0].samples[0]
    assert s.finish.type == "length" and len(ids) + len(s.token_ids) == 32


def test_weight_update_changes_outputs_and_version(tiny_model_dir, tiny_model_factory) -> None:
    llm = make_llm(tiny_model_dir, rows=2)
    ids = llm.tokenizer.encode(PROMPTS[2])
    before = llm.generate([ids], GREEDY)[0].samples[0]
    assert before.weight_version == "0"
    other = tiny_model_factory("llama", seed=1)
    bad = [("model.norm.weight", torch.ones(3))]
    updates = EngineUpdates(llm.engine)
    with pytest.raises(ControlError, match="model.norm.weight"):
        updates.load(bad, "v-bad")
    assert llm.engine.weight_version == "0"
    assert llm.generate([ids], GREEDY)[0].samples[0].token_ids == before.token_ids

    res = updates.load(iter_safetensors(other), "step-1")
    assert res.weight_version == llm.engine.weight_version == "step-1"
    after = llm.generate([ids], GREEDY)[0].samples[0]
    assert after.weight_version == "step-1" and after.token_ids != before.token_ids
    fresh = make_llm(other, rows=2).generate([ids], GREEDY)[0].samples[0]
    assert after.token_ids == fresh.token_ids


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_weight_update_from_distributed(tiny_model_dir, tiny_model_factory) -> None:
    """The trainer (rank 0, here the main thread) broadcasts tensors over gloo; the engine
    (rank 1) receives them between steps and applies them all or none."""
    import threading

    from tlt_serve.weight_sync import TensorSpec, WeightSyncGroup, specs_of

    llm = make_llm(tiny_model_dir, rows=2)
    updates = EngineUpdates(llm.engine)
    ids = llm.tokenizer.encode(PROMPTS[0])
    before = llm.generate([ids], GREEDY)[0].samples[0].token_ids
    port = _free_port()
    results = {}

    def engine_side(action) -> None:
        try:
            results[action.__name__] = action()
        except ControlError as err:
            results[action.__name__] = err

    def join():
        return updates.join_group("127.0.0.1", port, 1, 2, "gloo")

    def receive_and_load(specs, version):
        return updates.load(updates.receive(specs), version)

    t = threading.Thread(target=engine_side, args=(join,))
    t.start()
    trainer = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo")
    t.join()
    assert isinstance(results["join"], WeightsUpdated)

    # A spec whose shape does not fit is received, then refused as a whole.
    new = list(iter_safetensors(tiny_model_factory("llama", seed=1)))
    bad = [*new[:3], ("model.norm.weight", torch.ones(7))]

    def update_bad():
        return receive_and_load(specs_of(bad), "bad")

    t = threading.Thread(target=engine_side, args=(update_bad,))
    t.start()
    trainer.send(bad)
    t.join()
    refused = results["update_bad"]
    assert isinstance(refused, ControlError) and "model.norm.weight" in str(refused)
    assert llm.generate([ids], GREEDY)[0].samples[0].token_ids == before

    def update_good():
        return receive_and_load(specs_of(new), "rl-1")

    t = threading.Thread(target=engine_side, args=(update_good,))
    t.start()
    trainer.send(new)
    t.join()
    assert results["update_good"].weight_version == llm.engine.weight_version == "rl-1"
    after = llm.generate([ids], GREEDY)[0].samples[0]
    fresh = make_llm(tiny_model_factory("llama", seed=1), rows=2).generate([ids], GREEDY)
    assert after.token_ids == fresh[0].samples[0].token_ids != before
    assert after.weight_version == "rl-1"
    with pytest.raises(ControlError):
        receive_and_load([TensorSpec("x", "int8", (1,))], "v")


def test_extend_forward_scores_several_tokens_after_a_cached_prefix(tiny_model_dir, hf) -> None:
    """The verification shape: rows with different cached lengths each get several new
    tokens in one forward; every position's logits equal HF's on the full sequence."""
    llm = make_llm(tiny_model_dir, rows=4)
    eng = llm.engine
    prompts = [llm.tokenizer.encode(PROMPTS[2]), llm.tokenizer.encode(PROMPTS[0])]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=50, temperature=0.0))
    eng.step()  # one prefill for both: KV rows hold the prompts
    reqs = eng.scheduler.running
    new = [[r.last_token, 7, 11, 13][: 4 - i] for i, r in enumerate(reqs)]  # 4 and 3 tokens
    with torch.inference_mode():
        logits_all = eng.runner.verify(reqs, [t[1:] for t in new]).logits  # [B, K+1, V]
        for b, r in enumerate(reqs):
            logits = logits_all[b, : len(new[b])]
            full = torch.tensor([r.prompt_ids + new[b]])
            ref = hf(full).logits[0, len(r.prompt_ids) :]
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_queue_cap_counts_every_sample(tiny_model_dir) -> None:
    cfg = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64),
        cache=CacheConfig(max_num_seqs=2),
        scheduler=SchedulerConfig(max_waiting=3),
    )
    llm = LLM(config=cfg)
    ids = llm.tokenizer.encode(PROMPTS[0])
    with pytest.raises(OverflowError, match="queue full"):
        llm.engine.add_request("big", ids, SamplingParams(n=4, max_new_tokens=2))
    assert not llm.engine.has_work()  # refused as a whole, no sample queued
    assert llm.engine.add_request("ok", ids, SamplingParams(n=3, max_new_tokens=2)) == [
        "ok#0", "ok#1", "ok#2",
    ]
    with pytest.raises(OverflowError):
        llm.engine.add_request("one-more", ids, SamplingParams(max_new_tokens=2))
