"""SGLang-native /generate over a real engine process: equality with the offline engine,
batching, n>1, streaming, logprobs, seeds, stops, and the generic endpoints."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.harness import MAX_MODEL_LEN, scrape, sse_events
from tlt_serve import LLM, SamplingParams
from tlt_serve.contract.controls import GetStats

PROMPTS = ["The quick brown fox", "def add(a, b):", "What is 12 + 7?"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)


def greedy(max_new_tokens: int = 16, **kw) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **kw}


def test_greedy_text_matches_offline_engine(http, llm) -> None:
    ref = llm.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0))
    for prompt, expected in zip(PROMPTS, ref, strict=True):
        body = {"text": prompt, "sampling_params": greedy(), "return_logprob": True}
        out = http.post("/generate", json=body).json()
        sample = expected.samples[0]
        assert out["output_ids"] == sample.token_ids
        assert out["text"] == sample.text
        lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert [e[1] for e in out["meta_info"]["output_token_logprobs"]] == sample.token_ids
        assert lps == pytest.approx(sample.logprobs, abs=1e-5)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(expected.prompt_ids)
        assert meta["completion_tokens"] == len(sample.token_ids)
        assert meta["weight_version"] == "0"
        assert meta["finish_reason"]["type"] in ("stop", "length")


def test_concurrent_requests_match_offline(served, llm) -> None:
    """Whatever the batch composition, fp32 greedy outputs are the offline ones."""
    ids = [[5 + i, 40 + i, 77 + 2 * i] for i in range(12)]
    ref = llm.generate(ids, SamplingParams(max_new_tokens=12, temperature=0))

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=60) as client:
            reqs = [client.post("/generate", json={"input_ids": p, "sampling_params": greedy(12)})
                    for p in ids]
            return [r.json() for r in await asyncio.gather(*reqs)]

    outs = asyncio.run(run())
    assert [o["output_ids"] for o in outs] == [r.samples[0].token_ids for r in ref]


def test_batch_and_n_order_is_prompt_major(http, llm) -> None:
    ids = [[5, 6, 7], [8, 9, 10, 11]]
    body = {"input_ids": ids, "sampling_params": greedy(6, n=2)}
    outs = http.post("/generate", json=body).json()
    assert isinstance(outs, list) and len(outs) == 4
    ref = llm.generate(ids, SamplingParams(max_new_tokens=6, temperature=0))
    expected = [r.samples[0].token_ids for r in ref for _ in range(2)]
    assert [o["output_ids"] for o in outs] == expected
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 4, 4]
    assert outs[0]["meta_info"]["id"].endswith("#0") and outs[1]["meta_info"]["id"].endswith("#1")


def test_batch_with_rids_and_per_prompt_params(http) -> None:
    body = {
        "text": ["hello", "world"],
        "rid": ["a-1", "a-2"],
        "sampling_params": [greedy(2), greedy(3)],
    }
    outs = http.post("/generate", json=body).json()
    assert [o["meta_info"]["id"] for o in outs] == ["a-1", "a-2"]
    assert [len(o["output_ids"]) for o in outs] == [2, 3]


def test_single_prompt_is_an_object_and_n_gives_a_list(http) -> None:
    one = http.post("/generate", json={"text": "hi", "sampling_params": greedy(2)}).json()
    assert isinstance(one, dict)
    many = http.post("/generate", json={"text": "hi", "sampling_params": greedy(2, n=3)}).json()
    assert isinstance(many, list) and len(many) == 3


def test_stream_is_cumulative_and_ends_like_the_blocking_call(http) -> None:
    body = {"text": PROMPTS[0], "sampling_params": greedy(10), "return_logprob": True}
    full = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert len(events) >= 2
    for prev, cur in zip(events, events[1:], strict=False):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert cur["text"].startswith(prev["text"])
        assert prev["meta_info"]["finish_reason"] is None
    last = events[-1]
    assert last["output_ids"] == full["output_ids"] and last["text"] == full["text"]
    assert last["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    # the second call reuses the first's prompt KV (the prefix cache): equal up to rounding
    got, want = (m["meta_info"]["output_token_logprobs"] for m in (last, full))
    assert [t[1:] for t in got] == [t[1:] for t in want]
    assert [t[0] for t in got] == pytest.approx([t[0] for t in want], abs=1e-5)


def test_stream_batch_events_carry_an_index(http) -> None:
    body = {"input_ids": [[5, 6], [7, 8]], "sampling_params": greedy(4, n=2), "stream": True}
    with http.stream("POST", "/generate", json=body) as resp:
        events = sse_events(resp.iter_lines())
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(len(e["output_ids"]) == 4 for e in finals.values())


def test_top_logprobs_and_token_text(http) -> None:
    body = {"text": "hello", "sampling_params": greedy(5), "return_logprob": True,
            "top_logprobs_num": 3, "return_text_in_logprobs": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == 5 and all(len(t) == 3 for t in tops)
    for (lp, tok, text), top in zip(meta["output_token_logprobs"], tops, strict=True):
        assert isinstance(text, str)
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)  # greedy picks the top-1
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)


def test_seeds_are_reproducible(http) -> None:
    def sample(seed: int) -> list[int]:
        sp = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": seed}
        return http.post("/generate", json={"text": "hello", "sampling_params": sp}).json()[
            "output_ids"
        ]

    assert sample(123) == sample(123)
    assert len({tuple(sample(s)) for s in (1, 2, 3, 4)}) > 1


def test_top_k_beyond_the_vocabulary_is_no_cut(http) -> None:
    """AReaL sends top_k 10**8 (SGLang's "all tokens" is 2**30): the same seeded samples and
    logprobs as no top-k at all."""
    def sample(top_k: int) -> tuple[list[int], list[float]]:
        sp = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5, "top_k": top_k}
        meta_out = http.post("/generate", json={"text": "hello", "sampling_params": sp,
                                                "return_logprob": True}).json()
        return meta_out["output_ids"], [lp for lp, _, _ in
                                        meta_out["meta_info"]["output_token_logprobs"]]

    assert sample(10**8) == sample(2**30) == sample(-1)


def test_n_samples_with_a_seed_differ_but_reproduce(http) -> None:
    sp = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 9, "n": 3}
    body = {"text": "hi", "sampling_params": sp}
    a = [o["output_ids"] for o in http.post("/generate", json=body).json()]
    b = [o["output_ids"] for o in http.post("/generate", json=body).json()]
    assert a == b and len({tuple(x) for x in a}) > 1


def test_stop_token_ids_and_stop_strings(http) -> None:
    base = http.post("/generate", json={"text": PROMPTS[2], "sampling_params": greedy(12)}).json()
    stop_tok = base["output_ids"][3]
    cut = base["output_ids"].index(stop_tok)
    out = http.post("/generate", json={
        "text": PROMPTS[2], "sampling_params": greedy(12, stop_token_ids=[stop_tok])
    }).json()
    assert out["output_ids"] == base["output_ids"][: cut + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        out = http.post("/generate", json={
            "text": PROMPTS[2], "sampling_params": greedy(12, stop=[stop])
        }).json()
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in out["text"] and text.startswith(out["text"])


def test_tokenize_detokenize_roundtrip(http, llm) -> None:
    tok = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert tok["tokens"] == llm.tokenizer.encode("The quick brown fox")
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["text"] == text["prompt"] == "The quick brown fox"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_info_health_and_metrics(http) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] and info["max_model_len"] == MAX_MODEL_LEN
    assert info["model_source"]["kind"] == "directory"  # the tiny test model's HF directory
    assert http.get("/get_weight_version").json() == {"weight_version": "0"}
    server = http.get("/get_server_info").json()
    assert server["engine_info"]["vocab_size"] > 0 and server["api_key"] is None
    m = scrape(http)
    for name in ("tlt_serve_requests_total", "tlt_serve_generation_tokens_total",
                 "tlt_serve_num_requests_running", "tlt_serve_num_requests_waiting",
                 "tlt_serve_batch_occupancy", "tlt_serve_step_time_seconds_count",
                 "tlt_serve_capture_buffer_bytes"):
        m.value(name)
    assert m.value("tlt_serve_step_time_seconds_bucket", le="+Inf") == m.value(
        "tlt_serve_step_time_seconds_count")
    assert m.value("tlt_serve_engine_alive") == 1
    assert m.value("tlt_serve_trainer_state", state="off") == 1
    assert m.value("tlt_serve_weight_version_info", version="0") == 1
    assert "tlt_serve_drafter_version" not in m.families  # no drafter serves


def test_flush_cache_when_idle(http) -> None:
    resp = http.post("/flush_cache")
    assert resp.status_code == 200 and resp.json()["success"]


def test_bridge_generate_and_call_api(served, http, llm) -> None:
    """Bridge used directly (on the server's loop): outputs of all n samples, RPCs."""
    http.get("/health_generate")  # makes sure the client is bound to the server's loop
    loop = served.bridge.loop
    assert loop is not None
    params = SamplingParams(max_new_tokens=5, temperature=0, n=2)

    async def run() -> tuple[list, dict]:
        outs = [o async for o in served.bridge.generate("bridge-1", [5, 6, 7], params)]
        return outs, await served.bridge.call(GetStats())

    outs, stats = asyncio.run_coroutine_threadsafe(run(), loop).result(30)
    ref = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5, temperature=0))
    for sub in ("bridge-1#0", "bridge-1#1"):
        assert [t for o in outs if o.rid == sub for t in o.token_ids] == ref[0].samples[0].token_ids
        assert [o.finished for o in outs if o.rid == sub][-1]
    assert stats.running == 0
