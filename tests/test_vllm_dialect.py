"""vLLM's RL routes on one port beside the SGLang and OpenAI dialects (a real server, the
tiny model, fp32): ``/inference/v1/generate`` answers what ``/generate`` answers (tokens,
logprobs, prompt logprobs, seeded samples), streamed or whole; ``cache_salt`` keeps cached
prefixes apart, ``/reset_prefix_cache`` empties the cache, ``/pause`` (keep / abort) +
``/resume`` + ``/is_paused``, ``/update_weights {weight_dir}`` serves the new weights and
``/reload_weights`` the first ones, ``/liveness``; what is not served is a 400 naming the
field."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import generated_tokens, sse_events, wait_for

PROMPT = [5, 9, 23, 41, 7, 7, 100, 3]


def gen(http, **body) -> dict:
    r = http.post("/inference/v1/generate", json={"token_ids": PROMPT, **body})
    assert r.status_code == 200, r.text
    out: dict = r.json()
    return out


def test_generate_equals_the_sglang_dialect(http) -> None:
    sp = {"max_tokens": 6, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1,
          "ignore_eos": True}
    out = gen(http, sampling_params=sp, return_token_ids=True)
    ref = http.post("/generate", json={
        "input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
        "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True}}).json()
    (choice,) = out["choices"]
    meta = ref["meta_info"]
    assert choice["token_ids"] == ref["output_ids"] and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert [[t["token_id"] for t in c["top_logprobs"]] for c in content] == [
        [t for _, t, _ in top] for top in meta["output_top_logprobs"]]
    assert all(c["rank"] == 1 for c in content)  # greedy: each token is its position's best
    # Sampled, vLLM's order: the sampled token first, then the best others, max(k, 1) in all
    for k in (1, 3):
        hot = {"max_tokens": 16, "temperature": 2.0, "seed": 4, "logprobs": k,
               "ignore_eos": True}
        steps = gen(http, sampling_params=hot)["choices"][0]["logprobs"]["content"]
        for c in steps:
            tops = c["top_logprobs"]
            assert len(tops) == k and tops[0] == {
                "token_id": c["token_id"], "logprob": c["logprob"], "rank": c["rank"],
                "token": f"token_id:{c['token_id']}"}
            assert c["token"] == f"token_id:{c['token_id']}"  # as prime-rl's client checks
            assert all(t["token_id"] != c["token_id"] for t in tops[1:])
            assert [t["logprob"] for t in tops[1:]] == sorted(
                (t["logprob"] for t in tops[1:]), reverse=True)
        assert any(c["rank"] != 1 for c in steps), "T = 2 should sample below the top"
    plp = out["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT) == len(out["prompt_token_ids"])
    assert [plp[p][str(PROMPT[p])]["logprob"] for p in range(1, len(PROMPT))] == [
        lp for lp, _, _ in meta["input_token_logprobs"][1:]]
    assert out["usage"]["prompt_tokens"] == len(PROMPT)
    assert out["usage"]["completion_tokens"] == 6
    seeded = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 2, "ignore_eos": True}
    a = gen(http, sampling_params=seeded)
    b = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 11, "n": 2,
        "ignore_eos": True}}).json()
    assert [c["token_ids"] for c in a["choices"]] == [s["output_ids"] for s in b]


def test_cache_salt_keeps_cached_prefixes_apart_and_reset_empties_them(http) -> None:
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    sp = {"max_tokens": 2, "temperature": 0}

    def cached(salt: str | None) -> int:
        body = {"token_ids": prompt, "sampling_params": sp}
        if salt is not None:
            body["cache_salt"] = salt
        r = http.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert cached("alice") == 0
    assert cached("alice") == len(prompt) - 1  # her own prefix, reused
    assert cached("bob") == 0 and cached(None) == 0  # not anyone else's
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert cached("alice") == 0
    assert http.get("/get_world_size").json() == {"world_size": 1}


def test_prime_rl_train_sampling_params_run_to_the_context_and_salt_the_cache(http) -> None:
    """prime-rl's train client merges its ``extra_body`` into ``sampling_params`` and sends
    no ``max_tokens``: vLLM then generates up to ``max_model_len`` (not SamplingParams' 16),
    and the salt it puts there keeps cached prefixes apart."""
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]

    def run(salt: str) -> dict:
        sp = {"temperature": 0.0, "top_p": 1.0, "logprobs": 1, "top_k": -1, "min_p": 0.0,
              "return_token_ids": True, "cache_salt": salt, "stop_token_ids": [],
              "skip_special_tokens": False, "routed_experts_prompt_start": 0,
              "ignore_eos": True}
        r = http.post("/inference/v1/generate", json={"token_ids": prompt,
                                                     "sampling_params": sp})
        assert r.status_code == 200, r.text
        out: dict = r.json()
        return out

    first = run("policy-3")
    (choice,) = first["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == max_len - len(prompt) > 16
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    cached = [run(s)["usage"]["prompt_tokens_details"]["cached_tokens"]
              for s in ("policy-3", "policy-4")]
    assert cached == [len(prompt) - 1, 0]


def test_pause_keep_holds_requests_until_resume(http) -> None:
    """Paused (keep), the engine steps nothing: a request sent meanwhile waits, and runs
    whole after ``/resume`` (requests running at the pause keep their KV: the SGLang
    dialect's in-place pause, tests/test_server_control.py)."""
    sp = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).json() == {
        "status": "paused"}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(gen, http, sampling_params=sp)
        assert http.get("/is_paused").json() == {"is_paused": True}
        time.sleep(0.5)
        assert not held.done()
        assert http.post("/resume").json() == {"status": "resumed"}
        out = held.result(timeout=120)
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert len(out["choices"][0]["token_ids"]) == 40
    bad = http.post("/pause", params={"mode": "retract"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"


def test_in_flight_update_splits_a_sample_into_version_spans(http, tiny_model_factory) -> None:
    """prime-rl's in-flight policy update: ``/pause`` (keep), ``/update_weights``, ``/resume``.
    The running sample goes on under the new weights, and its tokens carry vLLM's
    weight-version spans: [0, k) under the old weights, [k, end) under the new."""
    n = 240  # of the 248 the context leaves: the pause lands while it runs
    sp = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
    old = http.get("/get_weight_version").json()["weight_version"]
    try:
        with ThreadPoolExecutor(1) as pool:
            start = generated_tokens(http)
            running = pool.submit(gen, http, sampling_params=sp)
            wait_for(lambda: generated_tokens(http) > start, timeout=30, interval=0.001)
            assert http.post("/pause", params={"mode": "keep"}).status_code == 200
            r = http.post("/update_weights",
                          json={"weight_dir": str(tiny_model_factory(seed=3))})
            assert r.status_code == 200, r.text
            assert http.post("/resume").status_code == 200
            out = running.result(timeout=120)
    finally:
        http.post("/resume")
        assert http.post("/reload_weights").status_code == 200
    new = r.json()["weight_version"]
    (first, second) = out["choices"][0]["weight_versions"]
    assert first["version"] == old and first["start"] == 0 and 0 < first["end"] < n
    assert second == {"version": new, "start": first["end"], "end": n}
    assert out["weight_version"] == new


def test_pause_wait_lets_running_requests_finish_and_holds_new_ones(http) -> None:
    """``wait``: the answer comes once what runs has finished (whole, not frozen or cut);
    a request sent meanwhile waits for ``/resume``."""
    sp = {"max_tokens": 160, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(gen, http, sampling_params=sp)
        wait_for(lambda: http.get("/get_server_info").json()["stats"]["running"] > 0
                 or running.done(), timeout=30)
        r = http.post("/pause", params={"mode": "wait"})
        assert r.status_code == 200 and r.json() == {"status": "paused"}
        # Not frozen (it would wait for /resume) nor cut: it ends, whole, while paused.
        assert len(running.result(timeout=60)["choices"][0]["token_ids"]) == 160
        assert http.get("/is_paused").json() == {"is_paused": True}
        held = pool.submit(gen, http, sampling_params={**sp, "max_tokens": 4})
        time.sleep(0.5)
        assert not held.done()
        assert http.post("/resume").json() == {"status": "resumed"}
        assert len(held.result(timeout=120)["choices"][0]["token_ids"]) == 4


def test_update_weights_from_a_directory_serves_them(http, tiny_model_factory,
                                                     tmp_path) -> None:
    sp = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = gen(http, sampling_params=sp)
    other = tiny_model_factory(seed=3)
    r = http.post("/update_weights", json={"weight_dir": str(other)})
    assert r.status_code == 200, r.text
    after = gen(http, sampling_params=sp)
    assert after["weight_version"] == r.json()["weight_version"] != before["weight_version"]
    assert after["choices"][0]["weight_versions"] == [
        {"version": after["weight_version"], "start": 0, "end": 8}]
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    for body, field in (({"update_info": {"names": ["w"]}}, "update_info"), ({}, "weight_dir"),
                        ({"weight_dir": "/nonexistent"}, "weight_dir")):
        bad = http.post("/update_weights", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    # prime-rl's NCCL broadcast: a step directory with only its marker, the weights on the wire
    (tmp_path / "NCCL_READY").touch()
    nccl = http.post("/update_weights", json={"weight_dir": str(tmp_path)})
    assert nccl.status_code == 400 and "filesystem broadcast" in nccl.json()["error"]["message"]
    lora = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(other)})
    assert lora.status_code == 400 and "LoRA" in lora.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": -1}}, "sampling_params.max_tokens"),
    ({"token_ids": [1], "sampling_params": {"logprobs": 50}}, "sampling_params.logprobs"),
    # vLLM's -1 is the whole vocabulary, over the default --max-logprobs (not "none")
    ({"token_ids": [1, 2], "sampling_params": {"prompt_logprobs": -1}},
     "sampling_params.prompt_logprobs"),
    ({"token_ids": [1], "sampling_params": {"repetition_penalty": 1.2}},
     "sampling_params.repetition_penalty"),
    ({"token_ids": [1], "output_mode": "text"}, "output_mode"),
    ({"token_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"token_ids": [1], "model": "gpt-9"}, "model"),
])
def test_bad_bodies_are_400_naming_the_field(http, body, param) -> None:
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text



def test_streamed_generate_equals_whole(http) -> None:
    sp = {"max_tokens": 7, "temperature": 0, "logprobs": 1, "prompt_logprobs": 0,
          "ignore_eos": True}
    whole = gen(http, sampling_params=sp)
    body = {"token_ids": PROMPT, "sampling_params": sp, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/inference/v1/generate", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0][
        "token_ids"]
    assert [lp["logprob"] for c in chunks for lp in c["choices"][0]["logprobs"]["content"]] == [
        lp["logprob"] for lp in whole["choices"][0]["logprobs"]["content"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["weight_versions"] == whole["choices"][0]["weight_versions"]
    assert next(c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c) == whole[
        "prompt_logprobs"]
    assert events[-1]["usage"]["completion_tokens"] == 7


def test_liveness_and_reload_weights_back_to_the_start(http, tiny_model_factory) -> None:
    assert http.get("/liveness").json() == {"status": "alive"}
    sp = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    assert http.post("/reload_weights").status_code == 200  # whatever ran before
    start = gen(http, sampling_params=sp)["choices"][0]["token_ids"]
    assert http.post("/update_weights", json={"weight_dir": str(tiny_model_factory(seed=4))}
                     ).status_code == 200
    assert gen(http, sampling_params=sp)["choices"][0]["token_ids"] != start
    r = http.post("/reload_weights")
    assert r.status_code == 200, r.text
    assert gen(http, sampling_params=sp)["choices"][0]["token_ids"] == start
