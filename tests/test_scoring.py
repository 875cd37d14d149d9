"""Scoring given sequences: prompt logprobs from the native engine equal HF's teacher-forced
logprobs in fp32, in batches of mixed lengths, from any start, with top logprobs and ranks,
with nothing generated (max_new_tokens 0) or with generation after, for samples sharing a
prefill, and with the prefix cache holding the prompt (it never supplies a scored position)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.harness import PROMPTS, make_llm
from tlt_serve import LLM, SamplingParams
from tlt_serve.engine.request import PromptLogprobs
from tlt_serve.sampling_params import ParamError

TOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, rows=6, prefill=96)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def teacher_forced(hf, ids: list[int]) -> torch.Tensor:
    """[L - 1, V]: row p - 1 is the distribution of token p given tokens < p."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check(scored: PromptLogprobs | None, hf, ids: list[int], start: int, k: int) -> None:
    assert scored is not None and scored.start == start
    ref = teacher_forced(hf, ids)
    assert len(scored.logprobs) == len(scored.ranks) == len(scored.top) == len(ids) - start
    for j, p in enumerate(range(start, len(ids))):
        if p == 0:
            assert scored.logprobs[j] is None and scored.ranks[j] is None and scored.top[j] == []
            continue
        want = ref[p - 1]
        assert scored.logprobs[j] == pytest.approx(float(want[ids[p]]), abs=TOL)
        assert scored.ranks[j] == int((want > want[ids[p]]).sum()) + 1
        values, order = want.topk(k)
        assert [t for t, _ in scored.top[j]] == order.tolist()
        assert [lp for _, lp in scored.top[j]] == pytest.approx(values.tolist(), abs=TOL)


def test_prompt_logprobs_equal_teacher_forcing_in_a_mixed_batch(llm: LLM, hf) -> None:
    prompts = [llm.tokenizer.encode(PROMPTS[i % 5] * (1 + i % 3)) for i in range(9)]
    params = [SamplingParams(max_new_tokens=i % 3, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=(0, 3, 20)[i % 3],
                             prompt_logprobs_start=(0, 1, len(prompts[i]) // 2)[i % 3])
              for i in range(9)]
    results = llm.generate(prompts, params)
    for ids, p, res in zip(prompts, params, results, strict=True):
        (sample,) = res.samples
        check(sample.prompt_logprobs, hf, ids, p.prompt_logprobs_start, p.prompt_logprobs)
        assert len(sample.token_ids) == p.max_new_tokens
        assert sample.finish is not None and sample.finish.type == "length"


def test_samples_of_a_prompt_share_its_scores_and_generate_as_without(llm: LLM, hf) -> None:
    ids = llm.tokenizer.encode(PROMPTS[1] * 2)
    plain = SamplingParams(max_new_tokens=6, temperature=0.8, seed=5, n=3)
    scored = SamplingParams(max_new_tokens=6, temperature=0.8, seed=5, n=3, prompt_logprobs=2)
    (without,) = llm.generate([ids], plain)
    (res,) = llm.generate([ids], scored)
    assert [s.token_ids for s in res.samples] == [s.token_ids for s in without.samples]
    for s in res.samples:
        check(s.prompt_logprobs, hf, ids, 0, 2)


def test_a_cached_prefix_never_supplies_a_scored_position(llm: LLM, hf) -> None:
    ids = llm.tokenizer.encode(PROMPTS[2] * 3)
    llm.generate([ids], SamplingParams(max_new_tokens=4, temperature=0.0))  # kept by the cache
    again = llm.generate([ids], SamplingParams(max_new_tokens=0, temperature=0.0))
    assert again[0].samples[0].cached_tokens == len(ids) - 1  # the cache holds it
    start = 10
    (res,) = llm.generate([ids], SamplingParams(max_new_tokens=0, prompt_logprobs=1,
                                                prompt_logprobs_start=start))
    (sample,) = res.samples
    assert 0 < sample.cached_tokens <= start - 1  # reused up to the first scored position
    check(sample.prompt_logprobs, hf, ids, start, 1)


def test_a_start_past_the_prompt_is_refused_naming_it(llm: LLM) -> None:
    with pytest.raises(ParamError, match="prompt_logprobs_start"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=0, prompt_logprobs_start=3))
    with pytest.raises(ParamError, match="prompt_logprobs"):  # over max_logprobs (20)
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=21))


# ---- over HTTP: both dialects ----------------------------------------------------------------


def test_generate_scores_given_sequences_as_sglang(served, hf) -> None:
    seqs = [[5, 9, 23, 41, 7, 7, 100, 3, 18], [11, 4, 4, 90, 2]]
    with served.http() as http:
        r = http.post("/generate", json={
            "input_ids": seqs, "return_logprob": True, "logprob_start_len": [0, 2],
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 200, r.text
        default = http.post("/generate", json={
            "input_ids": seqs[0], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    for ids, start, out in zip(seqs, (0, 2), r.json(), strict=True):
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
        ref = teacher_forced(hf, ids)
        entries = meta["input_token_logprobs"]
        assert [t for _, t, _ in entries] == ids[start:]
        for (lp, _, _), tops, p in zip(entries, meta["input_top_logprobs"], range(start, len(ids)),
                                        strict=True):
            if p == 0:
                assert lp is None and tops is None
                continue
            assert lp == pytest.approx(float(ref[p - 1, ids[p]]), abs=TOL)
            assert [t for _, t, _ in tops] == ref[p - 1].topk(2).indices.tolist()
    # Without logprob_start_len no prompt token is scored (only the output's logprobs).
    assert "input_token_logprobs" not in default["meta_info"]
    assert len(default["meta_info"]["output_token_logprobs"]) == 2


def test_completions_prompt_logprobs_as_vllm(served, hf) -> None:
    """As TRL's VLLMClient.get_sequence_logprobs asks: token-id prompts, one new token,
    ``prompt_logprobs`` = k: per position the token's entry (with its rank) and the top k."""
    seqs = [[5, 9, 23, 41, 7, 7, 100], [11, 4, 4, 90]]
    with served.http() as http:
        r = http.post("/v1/completions", json={
            "prompt": seqs, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    for ids, choice in zip(seqs, r.json()["choices"], strict=True):
        ref = teacher_forced(hf, ids)
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for p in range(1, len(ids)):
            want = ref[p - 1]
            mine = plp[p][str(ids[p])]
            assert mine["logprob"] == pytest.approx(float(want[ids[p]]), abs=TOL)
            assert mine["rank"] == int((want > want[ids[p]]).sum()) + 1
            ranked = sorted(plp[p].items(), key=lambda kv: kv[1]["rank"])
            assert [int(t) for t, e in ranked if e["rank"] <= 3] == want.topk(3).indices.tolist()


def test_echo_returns_the_prompt_and_its_logprobs(served, hf) -> None:
    """``echo`` with ``logprobs`` through the official SDK: the prompt's text and tokens come
    first (its first token without a logprob), streamed or not, also with nothing new."""
    import openai

    sdk = openai.OpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0)
    model = sdk.models.list().data[0].id
    ids = [5, 9, 23, 41, 7]
    kw = {"model": model, "prompt": ids, "echo": True, "logprobs": 1, "temperature": 0}
    whole = sdk.completions.create(max_tokens=3, **kw).choices[0]
    prompt_text = served_decode(served, ids)
    assert whole.text.startswith(prompt_text)
    lps = whole.logprobs
    assert len(lps.tokens) == len(ids) + 3 and lps.token_logprobs[0] is None
    assert lps.top_logprobs[0] is None
    ref = teacher_forced(hf, ids)
    for p in range(1, len(ids)):
        assert lps.token_logprobs[p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=TOL)
    assert lps.text_offset == sorted(lps.text_offset)
    chunks = list(sdk.completions.create(max_tokens=3, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lps.token_logprobs
    only = sdk.completions.create(max_tokens=0, **kw).choices[0]
    assert only.text == prompt_text and only.logprobs.token_logprobs == lps.token_logprobs[:5]


def served_decode(served, ids: list[int]) -> str:
    with served.http() as http:
        return http.post("/detokenize", json={"tokens": ids}).json()["text"]


def test_chat_prompt_logprobs_and_tokens_as_ids(served) -> None:
    with served.http() as http:
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3,
            "temperature": 0, "prompt_logprobs": 0, "logprobs": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = body["prompt_token_ids"]
    plp = body["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(plp[1:], prompt[1:], strict=True))
    choice = body["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["token_ids"]]
    with served.http() as http:
        bad = http.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_scoring_beside_a_drafter_and_capture(tiny_model_dir: Path, tiny_drafter_dir: Path,
                                              hf) -> None:
    """A drafter catching up from prompt features and capture keeping them: scored requests
    (nothing generated, or generating) mixed with plain ones leave outputs as without
    scoring, and the scores are teacher forcing's."""
    from tlt_serve.config import CacheConfig, CaptureConfig, EngineConfig, ModelConfig, SpecConfig

    engine = LLM(config=EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(max_num_seqs=8),
        spec=SpecConfig(method="drafter", drafter=str(tiny_drafter_dir),
                        min_draft_confidence=0.0),
        capture=CaptureConfig(enabled=True)))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)] * 5
    before = engine.generate(prompts, plain)
    mixed = [plain[0], SamplingParams(max_new_tokens=0, prompt_logprobs=1), plain[2],
             SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0, prompt_logprobs_start=2), plain[4]]
    after = engine.generate(prompts, mixed)
    for i in (0, 2, 3, 4):
        assert after[i].samples[0].token_ids == before[i].samples[0].token_ids
    assert after[1].samples[0].token_ids == []
    check(after[1].samples[0].prompt_logprobs, hf, prompts[1], 0, 1)
    check(after[3].samples[0].prompt_logprobs, hf, prompts[3], 2, 0)


def test_ranks_from_the_probe_equal_a_full_count() -> None:
    """The rank shortcut (read off the top P where the token is among them) against a full
    count, rows inside and beyond the probe, ties at its edge included."""
    from tlt_serve.engine.scoring import _ranks

    g = torch.Generator().manual_seed(0)
    lp = torch.randn(64, 500, generator=g).round(decimals=1)  # many ties
    for probe_size in (1, 8, 64):
        chosen = lp.gather(1, torch.randint(0, 500, (64, 1), generator=g))
        probe = lp.topk(probe_size, dim=-1).values
        assert _ranks(lp, chosen, probe).tolist() == ((lp > chosen).sum(dim=1) + 1).tolist()


def test_the_cpu_scoring_kernel_is_log_softmax_and_a_full_count() -> None:
    """The two-pass kernel prompt logprobs take on a CPU: each row's maximum and log-sum of
    exponentials give torch's log-softmax within fp32 rounding, and the target's rank is
    exactly a full count, with ties, rows whose width is not a multiple of 8, the largest and
    the smallest logit as targets; bad input refused by name."""
    from tests.harness import own_kernels
    from tlt_serve.kernels import sampling_kernels

    own_kernels()  # a skip without them (a failure where they are required)
    own = sampling_kernels()
    assert own is not None
    fused = own.scores
    g = torch.Generator().manual_seed(1)
    for V in (1, 7, 8, 500, 49_157):
        logits = (torch.randn(33, V, generator=g) * 8).round(decimals=1)  # many ties
        targets = torch.randint(0, V, (33,), generator=g)
        targets[0], targets[1] = logits[0].argmax(), logits[1].argmin()
        mx, logsum, rank = fused(logits, targets)
        chosen = logits.gather(1, targets.unsqueeze(1))
        want = torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close((chosen.squeeze(1) - mx) - logsum, want, atol=2e-6, rtol=1e-6)
        assert torch.equal(mx, logits.amax(dim=1))
        assert rank.tolist() == ((logits > chosen).sum(dim=1) + 1).tolist(), V
    with pytest.raises(RuntimeError, match="target out of range"):
        fused(torch.zeros(2, 5), torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        fused(torch.zeros(2, 5, dtype=torch.float16), torch.tensor([0, 1]))


def test_the_cpu_scoring_kernel_reads_bf16_rows_as_their_widening() -> None:
    """bf16 logits (the head's product where torch's bf16 GEMM rounds them) are widened row by
    row in cache: maxima, log-sums and ranks bit for bit those of the same rows widened to
    fp32 first, at widths with and without a tail of fewer than 8."""
    from tests.harness import own_kernels
    from tlt_serve.kernels import sampling_kernels

    own_kernels()
    own = sampling_kernels()
    assert own is not None
    g = torch.Generator().manual_seed(2)
    for V in (1, 13, 1024, 49_157):
        logits = (torch.randn(19, V, generator=g) * 6).to(torch.bfloat16)  # ties in bf16
        targets = torch.randint(0, V, (19,), generator=g)
        for got, want in zip(own.scores(logits, targets), own.scores(logits.float(), targets),
                             strict=True):
            assert torch.equal(got, want), V


def test_bf16_head_logits_into_the_buffer_are_the_widened_ones(tiny_model_dir: Path) -> None:
    """Where the head's product is torch's bf16 GEMM, scoring's logits go into one reused bf16
    buffer: the same values ``logits`` widens to fp32; where it is not (the own kernel's rows,
    an fp32 copy of the weights), ``logits`` ignores the buffer and returns fp32."""
    from tlt_serve.models.loader import build_model

    model = build_model(tiny_model_dir, torch.bfloat16, 64)
    model.set_fp32_batch_matmul(False)
    head = model.lm_head
    rows = head.matvec_rows + 5 if head.matvec is not None else 9
    hidden = torch.randn(rows, head.weight.shape[1]).to(torch.bfloat16)
    out = torch.empty(rows + 3, head.weight.shape[0], dtype=torch.bfloat16)
    with torch.inference_mode():
        assert head.rounds_to_bf16(rows, torch.bfloat16)
        got = model.logits(hidden, out)
        assert got.dtype == torch.bfloat16 and got.data_ptr() == out.data_ptr()
        assert torch.equal(got.float(), model.logits(hidden))
        if head.matvec is not None:  # few rows: the own kernel's fp32, unrounded
            assert not head.rounds_to_bf16(2, torch.bfloat16)
            assert model.logits(hidden[:2], out).dtype == torch.float32
        model.set_fp32_batch_matmul(True)
        assert not head.rounds_to_bf16(rows, torch.bfloat16)
        assert model.logits(hidden, out).dtype == torch.float32


def test_bf16_scores_through_the_buffer_equal_those_of_widened_logits(tiny_model_dir: Path,
                                                                      monkeypatch) -> None:
    """A bf16 engine scoring a prompt over several chunks: logprobs, ranks and top logprobs
    through the reused bf16 buffer equal, bit for bit, those of fp32 logits a chunk at a
    time (the path before the buffer)."""
    from tlt_serve.engine import scoring

    llm = make_llm(tiny_model_dir, rows=4, dtype="bfloat16", prefill=256)
    model = llm.engine.model
    model.set_fp32_batch_matmul(False)
    # chunks past the own kernel's rows (torch's GEMM into the buffer) and a last one within
    # them (the kernel's fp32)
    monkeypatch.setattr(scoring, "MAX_CHUNK", model.lm_head.matvec_rows + 6)
    chunk, out = scoring._chunks(model, torch.empty(1, 1, dtype=torch.bfloat16))
    assert out is not None and out.dtype == torch.bfloat16
    prompt = (llm.tokenizer.encode(" ".join(PROMPTS)) * 8)[:200]
    assert 2 * chunk < len(prompt) - 1 < 2 * chunk + model.lm_head.matvec_rows
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=2)
    buffered = llm.generate([prompt], params)[0].samples[0].prompt_logprobs
    monkeypatch.setattr(scoring, "_chunks", lambda m, h: (chunk, None))
    widened = llm.generate([prompt], params)[0].samples[0].prompt_logprobs
    assert buffered is not None and widened is not None
    assert buffered.logprobs == widened.logprobs and buffered.ranks == widened.ranks
    assert buffered.top == widened.top


def test_scores_across_chunks_of_logits_equal_teacher_forcing(llm: LLM, hf, monkeypatch) -> None:
    """Logits are formed a few positions at a time (``CHUNK_BYTES``): with chunks of 3
    positions a prompt's logprobs, ranks and top logprobs cross many chunk edges and still
    equal HF's teacher-forced ones; the engine's fp32 model scores with the CPU kernel."""
    from tlt_serve.engine import scoring
    from tlt_serve.engine.sampler import own_kernels

    assert own_kernels(torch.device("cpu")) is not None
    V = llm.engine.model.lm_head.weight.shape[0]
    monkeypatch.setattr(scoring, "CHUNK_BYTES", 3 * 4 * V)
    prompt = llm.tokenizer.encode(PROMPTS[2] * 2)
    assert len(prompt) > 12
    out = llm.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=3,
                                                prompt_logprobs_start=1))
    check(out[0].samples[0].prompt_logprobs, hf, prompt, 1, 3)
