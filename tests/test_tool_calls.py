"""Tool calls on chat completions: the tools rendered by the chat template, the answer parsed
(Hermes ``<tool_call>`` blocks, Llama 3 JSON) into ``tool_calls`` whole and streamed, tool
results sent back as ``role: tool``; driven by the official SDK against tiny models trained to
call a tool, under own templates of both formats and the real Qwen2.5 and Llama 3.2 templates
(as TRL ships them: those need trl, required in CI); the default model through the whole
route with forced calls. Constrained decoding: forced calls and structured outputs."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import transformers

from tests.harness import Served, serve, skip_unless_required
from tests.tool_model import (
    ASK,
    ASK_TWO,
    FAMILIES,
    HELLO,
    HELLO_ANSWER,
    HERMES_TEMPLATE,
    LLAMA_TEMPLATE,
    RESULT,
    TOOLS,
    answered,
    make_tool_model,
    render,
)
from tlt_serve.server.openai.tools import new_parser, parse_all, resolve_parser, template_parser

# ---- parsers ------------------------------------------------------------------------------

HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "t", "arguments": {}}\n</tool_call>\n')


@pytest.mark.parametrize(("kind", "text", "content", "calls"), [
    ("hermes", HERMES_TWO, "Let me look.", [("w", {"city": "Paris"}), ("t", {})]),
    ("hermes", '<tool_call>{"name": "w", "arguments": "{\\"x\\": 1}"}</tool_call>', "",
     [("w", {"x": 1})]),  # arguments written as a JSON string
    ("hermes", '<tool_call>\n{"name": "w", "arguments": {"x": [1, 2]}}', "",
     [("w", {"x": [1, 2]})]),  # cut off before </tool_call>, its JSON whole
    ("hermes", 'a < b <tool_call>{bad}</tool_call> tail ',
     'a < b <tool_call>{bad}</tool_call> tail ', []),  # not a call: content, kept whole
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}'
     '</tool_call>', []),  # no name
    ("hermes", "Just text, no call.\n", "Just text, no call.\n", []),
    ("hermes", '<tool_call>\n{"name": "w", "argum', '<tool_call>\n{"name": "w", "argum', []),
    ("llama3_json", '{"name": "w", "parameters": {"city": "Paris"}}; {"name": "t", '
     '"arguments": {}}', "", [("w", {"city": "Paris"}), ("t", {})]),
    ("llama3_json", '<|python_tag|>{"name": "w", "parameters": {"é": "ü"}}\n', "",
     [("w", {"é": "ü"})]),
    ("llama3_json", ' The answer is {"a": 1}', ' The answer is {"a": 1}', []),
    ("llama3_json", '{"answer": 1}', '{"answer": 1}', []),
    ("llama3_json", '{"name": "w", "parameters": {"c', '{"name": "w", "parameters": {"c', []),
    ("llama3_json", '{"name": "w", "parameters": {}} and more', ' and more',
     [("w", {})]),
])
def test_a_streamed_answer_parses_as_the_whole_one(kind, text, content, calls) -> None:
    """Every split of the text into three deltas tells the content and calls the whole text
    does, and those are the expected ones."""
    whole = parse_all(new_parser(kind), text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            parser = new_parser(kind)
            told = parser.feed(text[:i])
            told.add(parser.feed(text[i:j]))
            told.add(parser.feed(text[j:]))
            told.add(parser.finish())
            assert (told.content, told.calls) == (whole.content, whole.calls), (i, j)


def test_the_parser_is_picked_by_the_chat_template() -> None:
    assert template_parser(HERMES_TEMPLATE) == "hermes"
    assert template_parser(LLAMA_TEMPLATE) == "llama3_json"
    assert template_parser({"default": "x", "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert template_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_parser(None) is None
    real = {name: fam for name, fam in FAMILIES.items() if fam.real}
    if importlib.util.find_spec("trl") is not None:
        for fam in real.values():  # the real templates show their formats
            assert template_parser(fam.template_text()) == fam.fmt
    assert resolve_parser("auto", HERMES_TEMPLATE) == "hermes"
    assert resolve_parser("llama3_json", HERMES_TEMPLATE) == "llama3_json"
    assert resolve_parser("none", HERMES_TEMPLATE) is None


# ---- served -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def tool_served(request, tmp_path_factory) -> Iterator[Served]:
    """A server (auto parser) on a model of the family, trained to call get_weather."""
    if FAMILIES[request.param].real and importlib.util.find_spec("trl") is None:
        skip_unless_required("the real templates come with trl (bash scripts/install.sh "
                             "--trl)", "TLT_REQUIRE_TRL")
    model = make_tool_model(tmp_path_factory.mktemp("tools") / request.param, request.param)
    s = serve(model, max_model_len=1024)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sdk(tool_served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_served.base_url + "/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def tok(tool_served: Served) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tool_served.model_dir)


def _chat(sdk: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return sdk.chat.completions.create(model=sdk.models.list().data[0].id, messages=messages,
                                       temperature=0, max_tokens=120, extra_body=extra, **kw)


def _calls(tool_calls: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def test_a_call_is_parsed_into_tool_calls(sdk, tok) -> None:
    out = _chat(sdk, ASK, tools=TOOLS, n=2)
    assert out.prompt_token_ids == render(tok, ASK, TOOLS)  # the template saw the tools
    ids = set()
    for choice in out.choices:
        msg = choice.message
        assert choice.finish_reason == "tool_calls"
        assert msg.content is None
        assert _calls(msg.tool_calls) == [("get_weather", {"city": "Paris"})]
        assert msg.tool_calls[0].type == "function"
        ids.add(msg.tool_calls[0].id)
    assert len(ids) == 2  # every call has its own id


def test_parallel_calls_and_parallel_tool_calls_false(sdk) -> None:
    both = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    out = _chat(sdk, ASK_TWO, tools=TOOLS)
    assert _calls(out.choices[0].message.tool_calls) == both
    assert out.choices[0].finish_reason == "tool_calls"
    one = _chat(sdk, ASK_TWO, tools=TOOLS, parallel_tool_calls=False)
    assert _calls(one.choices[0].message.tool_calls) == both[:1]
    # the same tokens were written: only what is told differs
    assert one.choices[0].token_ids == out.choices[0].token_ids


def test_streamed_calls_equal_the_whole_answer(sdk) -> None:
    whole = _chat(sdk, ASK_TWO, tools=TOOLS)
    stream = _chat(sdk, ASK_TWO, tools=TOOLS, stream=True)
    calls: dict[int, dict[str, str]] = {}
    content, finish, token_ids = "", None, []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            token_ids += choice.model_extra.get("token_ids") or []
            for tc in delta.tool_calls or []:  # as clients join them: by index
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += tc.id or ""
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    msg = whole.choices[0].message
    assert content == ""
    assert finish == "tool_calls"
    assert token_ids == whole.choices[0].token_ids
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        _calls(msg.tool_calls)
    assert all(c["id"] for c in calls.values())


def test_the_tool_result_goes_back_through_the_template(sdk, tok) -> None:
    """The second turn: the assistant's call and the tool's result, as the SDK sends them."""
    out = _chat(sdk, answered(), tools=TOOLS)
    assert out.prompt_token_ids == render(tok, answered(), TOOLS)
    choice = out.choices[0]
    assert choice.message.content == RESULT
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    streamed = _chat(sdk, answered(), tools=TOOLS, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == RESULT


def test_tool_choice_none_renders_the_tools_and_parses_nothing(sdk, tok, tool_served) -> None:
    out = _chat(sdk, ASK, tools=TOOLS, tool_choice="none")
    assert out.prompt_token_ids == render(tok, ASK, TOOLS)
    choice = out.choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert "get_weather" in choice.message.content  # the call's text, as content


def test_without_tools_an_answer_is_content(sdk) -> None:
    out = _chat(sdk, HELLO)
    assert out.choices[0].message.content == HELLO_ANSWER
    assert out.choices[0].finish_reason == "stop"


def test_tool_choice_required_calls_a_tool_whole_and_streamed(sdk) -> None:
    """Constrained to a JSON list of calls of the tools given, whatever the model prefers
    (here, the greeting it learned); one call with ``parallel_tool_calls`` false."""
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    out = _chat(sdk, HELLO, **kw)
    choice = out.choices[0]
    calls = _calls(choice.message.tool_calls)
    assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time")
    if calls[0][0] == "get_weather":
        assert isinstance(calls[0][1]["city"], str)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    stream = _chat(sdk, HELLO, stream=True, **kw)
    told = [tc for c in stream for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in told] == calls


def test_a_named_tool_choice_calls_that_function(sdk) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(sdk, HELLO, tools=TOOLS, tool_choice=named)
    choice = out.choices[0]
    (name, args), = _calls(choice.message.tool_calls)
    assert name == "get_weather" and set(args) == {"city"} and isinstance(args["city"], str)
    assert choice.finish_reason == "stop"  # as OpenAI's for a named function


# ---- structured outputs -------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                   "tag": {"type": "string", "enum": ["a", "bb"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


def test_response_format_json_schema(http) -> None:
    """A random model's answer, constrained: JSON matching the schema, greedy or seeded."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 3}):
        r = http.post("/v1/chat/completions", json={
            "messages": HELLO, "response_format": fmt, "max_tokens": 40, **extra})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            assert choice["finish_reason"] == "stop"
    r = http.post("/v1/chat/completions", json={
        "messages": HELLO, "response_format": {"type": "json_object"}, "max_tokens": 60,
        "temperature": 0})
    assert r.status_code == 200
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {
        "json_schema": json.dumps(SCHEMA), "max_new_tokens": 40, "temperature": 0}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), SCHEMA)


@pytest.mark.parametrize(("body", "field"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_response_formats_are_refused_by_name(http, body, field) -> None:
    r = http.post("/v1/chat/completions", json={"messages": HELLO, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_constrained_output_is_the_same_with_speculation(tiny_model_dir) -> None:
    """A constrained request decodes without drafts: greedy and seeded outputs equal plain
    decoding's beside speculating requests."""
    from tests.harness import make_llm
    from tlt_serve import SamplingParams
    from tlt_serve.config import SpecConfig

    schema = json.dumps(SCHEMA)
    params = [SamplingParams(max_new_tokens=40, temperature=0, json_schema=schema),
              SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, json_schema=schema),
              SamplingParams(max_new_tokens=24, temperature=0)]
    prompts = ["Hello there", "The quick brown fox", "def add(a, b):"]
    plain = make_llm(tiny_model_dir).generate(prompts, params)
    spec = make_llm(tiny_model_dir, SpecConfig(method="ngram")).generate(prompts, params)
    for a, b in zip(plain, spec, strict=True):
        assert a.samples[0].token_ids == b.samples[0].token_ids
    assert json.loads(plain[0].samples[0].text)["tag"] in ("a", "bb")
    from tlt_serve.sampling_params import ParamError

    llm = make_llm(tiny_model_dir)
    with pytest.raises(ParamError, match="json_schema"):  # the offline API, unchecked before
        llm.generate(["Hi"], SamplingParams(json_schema='{"type": "nonsense"}'))
    assert llm.generate(["Hi"], SamplingParams(max_new_tokens=3))[0].samples[0].token_ids


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tools_are_refused_by_name(tool_served, body, field) -> None:
    with tool_served.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_a_call_sent_back_must_be_json(tool_served) -> None:
    messages = answered()
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with tool_served.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
        ok = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5})
    assert ok.status_code == 200  # the server goes on


def test_auto_needs_a_parser(http) -> None:
    """The default tiny model's template shows no tool format: 'auto' is refused, 'none'
    renders."""
    r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions",
                  json={"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3})
    assert r.status_code == 200


def test_the_default_model_through_the_whole_route() -> None:
    """The embedded default model (its template shows no tool format) with
    ``--tool-call-parser hermes``: forced calls come back parsed, whole and streamed."""
    from tlt_serve.models.provision import resolve_model_path

    s = serve(resolve_model_path("smollm2-135m"), max_model_len=1024,
              server_kw={"tool_call_parser": "hermes"})
    try:
        sdk = openai.OpenAI(base_url=s.base_url + "/v1", api_key="-", max_retries=0)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):
            kw = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
            whole = _chat(sdk, ASK, **kw).choices[0]
            calls = _calls(whole.message.tool_calls)
            assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time"), whole
            stream = _chat(sdk, ASK, stream=True, **kw)
            told = [tc for c in stream for ch in c.choices for tc in ch.delta.tool_calls or []]
            assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in told] == \
                calls
        with s.http() as http:  # 'auto' is served: the parser was named at start
            r = http.post("/v1/chat/completions",
                          json={"messages": ASK, "tools": TOOLS, "max_tokens": 8})
        assert r.status_code == 200, r.text
    finally:
        s.stop()



def test_chat_template_kwargs_reach_the_template(tiny_model_factory) -> None:
    """vLLM's and SGLang's ``chat_template_kwargs``: variables the template reads (here, as
    Qwen3's, ``enable_thinking`` false opens the answer with an empty think block); what
    the request itself passes the template is refused by name."""
    model = tiny_model_factory("llama", seed=5)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    tok.chat_template = tok.chat_template + (
        "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}")
    tok.save_pretrained(model)
    s = serve(model)
    try:
        with s.http() as http:
            def prompt(**extra: Any) -> list[int]:
                r = http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "return_token_ids": True, **extra})
                assert r.status_code == 200, r.text
                out: list[int] = r.json()["prompt_token_ids"]
                return out

            plain = prompt()
            quiet = prompt(chat_template_kwargs={"enable_thinking": False})
            assert prompt(chat_template_kwargs={"enable_thinking": True}) == plain
            assert tok.decode(quiet) == tok.decode(plain) + "<think>\n\n</think>\n\n"
            bad = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"add_generation_prompt": False}})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"
    finally:
        s.stop()
