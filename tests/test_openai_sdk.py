"""The official ``openai`` SDK, unchanged, against /v1 (completions and chat, streaming, n,
logprobs, vLLM extras); greedy outputs equal the offline engine's."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.harness import MAX_MODEL_LEN, Served, serve, sse_events
from tlt_serve import LLM, SamplingParams

KEY = "sdk-key"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    s = serve(tiny_model_dir, api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def sdk(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(sdk: openai.OpenAI) -> str:
    return sdk.models.list().data[0].id


def test_models_list(sdk, served) -> None:
    models = sdk.models.list().data
    assert len(models) == 1 and models[0].id == str(served.model_dir)


def test_completion_greedy_matches_offline(sdk, model, llm) -> None:
    ref = llm.generate("The quick brown fox", SamplingParams(max_new_tokens=10, temperature=0))
    out = sdk.completions.create(model=model, prompt="The quick brown fox", max_tokens=10,
                                 temperature=0, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == ref[0].samples[0].text
    assert choice.model_extra["token_ids"] == ref[0].samples[0].token_ids
    assert choice.model_extra["prompt_token_ids"] == ref[0].prompt_ids
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(ref[0].prompt_ids)
    assert out.usage.completion_tokens == len(ref[0].samples[0].token_ids)
    assert out.model_extra["weight_version"] == "0"


def test_completion_token_prompts_batch_and_n(sdk, model, llm) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    out = sdk.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0, n=2)
    ref = llm.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [r.samples[0].text for r in ref for _ in range(2)]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16


def test_completion_logprobs(sdk, model, llm) -> None:
    out = sdk.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0,
                                 logprobs=2)
    ref = llm.generate("hello", SamplingParams(max_new_tokens=5, temperature=0))
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref[0].samples[0].logprobs, abs=1e-5)
    assert len(lp.tokens) == 5 and len(lp.top_logprobs) == 5 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text


def test_completion_stream(sdk, model) -> None:
    full = sdk.completions.create(model=model, prompt="hello", max_tokens=8, temperature=0)
    chunks = list(sdk.completions.create(model=model, prompt="hello", max_tokens=8,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    # A loaded machine may deliver every token in one chunk: then no chunk precedes it.
    assert finishes[-1] == full.choices[0].finish_reason and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_greedy_matches_offline(sdk, model, llm) -> None:
    ref = llm.chat([MESSAGES], SamplingParams(max_new_tokens=10, temperature=0))
    out = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10,
                                      temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref[0].samples[0].text
    assert out.usage.prompt_tokens == len(ref[0].prompt_ids)


def test_chat_n_seed_and_logprobs(sdk, model) -> None:
    kw = dict(model=model, messages=MESSAGES, max_completion_tokens=8, n=2, seed=5,
              logprobs=True, top_logprobs=3)
    a = sdk.chat.completions.create(**kw)
    b = sdk.chat.completions.create(**kw)
    assert len(a.choices) == 2
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for choice in a.choices:
        content = choice.logprobs.content
        assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.logprob <= 0 for t in content)


def test_chat_stream_with_usage(sdk, model) -> None:
    full = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                       temperature=0, n=2)
    stream = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                         temperature=0, n=2, stream=True,
                                         stream_options={"include_usage": True})
    texts, roles, finishes = {0: "", 1: ""}, set(), {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles.add(c.delta.role)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert "assistant" in roles
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_harmless_defaults_accepted(sdk, model) -> None:
    out = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, frequency_penalty=0, presence_penalty=0,
        logit_bias=None, user="me", response_format={"type": "text"},
    )
    assert out.choices[0].message.content is not None


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"temperature": -1}, "temperature"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
])
def test_unsupported_values_are_400_naming_the_field(sdk, model, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=MESSAGES, **kwargs)
    err = info.value.body
    assert err["param"] == param and info.value.status_code == 400


def test_completion_rejects_bad_logprobs(sdk, model) -> None:
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=model, prompt="hi", max_tokens=2, logprobs=99)


def test_unknown_model_is_404(sdk) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="gpt-5", prompt="hi", max_tokens=2)


def test_wrong_key_is_401(served) -> None:
    bad = openai.OpenAI(base_url=served.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_raw_sse_format(served, model) -> None:
    with served.http() as http, http.stream("POST", "/v1/chat/completions", json={
        "model": model, "messages": MESSAGES, "max_tokens": 3, "stream": True,
        "return_token_ids": True,
    }) as resp:
        events = sse_events(resp.iter_lines())
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "prompt_token_ids" in events[0]
    ids = [t for e in events[1:] for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(ids) == 3


def test_completion_max_tokens_below_zero_is_400(served, model) -> None:
    with served.http() as http:
        resp = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_max_tokens_past_the_context_is_400_naming_the_field(served, sdk, model) -> None:
    """As OpenAI and vLLM: a completion that cannot fit after the prompt is refused, not cut."""
    with served.http() as http:
        prompt_len = http.post("/tokenize", json={"prompt": "hi"}).json()["count"]
    room = MAX_MODEL_LEN - prompt_len
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=model, prompt="hi", max_tokens=1_000_000_000)
    assert info.value.body["param"] == "max_tokens"
    assert f"{MAX_MODEL_LEN} - {prompt_len}" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=model, prompt="hi", max_tokens=room + 1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10**9)
    assert info.value.body["param"] == "max_completion_tokens"
    out = sdk.completions.create(model=model, prompt="hi", max_tokens=room, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == room and out.choices[0].finish_reason == "length"


def test_generate_stops_an_oversized_max_new_tokens_at_the_context_end(served) -> None:
    """/generate (SGLang dialect) keeps it: the output ends at max_model_len, finish length."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 1_000_000_000, "temperature": 0, "ignore_eos": True}}
    with served.http() as http:
        out = http.post("/generate", json=body)
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert meta["completion_tokens"] == MAX_MODEL_LEN - 3
    assert meta["finish_reason"]["type"] == "length"
