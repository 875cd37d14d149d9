"""What SGLang-speaking routers and RL frameworks send and read, against a real server: the
fields sglang-router adds to every request it forwards, slime's and AReaL's extras, SGLang's
load and server-info reports; then a real sglang-router in front of the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.harness import Served, need_router, wait_for

# The fields sglang-router 0.3.2 writes into every /generate it forwards (model: null).
ROUTER_GENERATE_FIELDS = {
    "model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False,
    "return_bytes": False, "return_entropy": False,
}
PROMPT = [5, 9, 23, 7, 11, 2]


def greedy(n: int = 8, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **kw}


def generate(http: httpx.Client, **body) -> dict:
    r = http.post("/generate", json={"input_ids": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_fields_the_router_adds_are_accepted_at_their_values(http) -> None:
    plain = generate(http, sampling_params=greedy(), return_logprob=True)
    routed = generate(http, sampling_params=greedy(), return_logprob=True,
                      **ROUTER_GENERATE_FIELDS)
    assert routed["output_ids"] == plain["output_ids"]
    assert generate(http, sampling_params=greedy(), model="any-name", no_logs=True)[
        "output_ids"] == plain["output_ids"]
    for field in ("background", "return_bytes", "return_entropy"):
        r = http.post("/generate", json={"input_ids": PROMPT, field: True})
        assert r.status_code == 400 and field in r.json()["error"]["message"]


def model_name(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_openai_fields_the_router_adds(http) -> None:
    completion = {
        "model": model_name(http), "prompt": "hi", "max_tokens": 4, "temperature": 0, "echo": False,
        "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
        "return_hidden_states": False,
    }
    r = http.post("/v1/completions", json=completion)
    assert r.status_code == 200, r.text
    chat = {
        "model": model_name(http), "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 4, "temperature": 0, "no_stop_trim": False,
        "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
        "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
    }
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**chat, "continue_final_message": True})
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]


def test_slime_sampling_extras(http) -> None:
    """slime sends no_stop_trim: true, spaces_between_special_tokens: false and, with
    top_p < 1, custom_params; the first keeps a matched stop string in the text."""
    free = generate(http, sampling_params=greedy(12))
    stop = free["text"][len(free["text"]) // 2 :][:2]
    assert stop.strip(), "the tiny model's greedy text should not be blank here"
    extras = {"spaces_between_special_tokens": False,
              "custom_params": {"return_top_p_token_ids": True}}
    trimmed = generate(http, sampling_params=greedy(12, stop=[stop], **extras))
    kept = generate(http, sampling_params=greedy(12, stop=[stop], no_stop_trim=True, **extras))
    assert kept["output_ids"] == trimmed["output_ids"]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"] == trimmed["text"] + stop and free["text"].startswith(kept["text"])
    stop_tok = free["output_ids"][3]
    outs = [generate(http, sampling_params=greedy(12, stop_token_ids=[stop_tok], no_stop_trim=k))
            for k in (False, True)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == free["output_ids"][:4]
    assert outs[1]["text"].startswith(outs[0]["text"])  # + the stop token's text, if any


def test_null_sampling_fields_are_their_defaults(http) -> None:
    """SGLang reads a null as the default (slime's agent adapter copies an OpenAI-style
    body's nulls through); a null max_new_tokens runs to the end of the context."""
    nulls = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "n": None,
             "frequency_penalty": None, "presence_penalty": None, "repetition_penalty": None,
             "min_new_tokens": None}
    seeded = {"max_new_tokens": 8, "sampling_seed": 7}
    assert generate(http, sampling_params={**seeded, **nulls})["output_ids"] == generate(
        http, sampling_params=seeded)["output_ids"]
    room = http.get("/get_model_info").json()["max_model_len"] - len(PROMPT)
    whole = generate(http, sampling_params={"max_new_tokens": None, "temperature": 0,
                                            "ignore_eos": True})
    assert len(whole["output_ids"]) == room
    assert whole["meta_info"]["finish_reason"]["type"] == "length"
    # below SGLang's 1e-6 a temperature is greedy, logprobs too (not of logits / 1e-7)
    def lps(temperature: float) -> list[float]:
        out = generate(http, return_logprob=True, sampling_params={
            "max_new_tokens": 8, "temperature": temperature, "sampling_seed": 3})
        return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    assert lps(1e-7) == lps(0.0) and min(lps(0.0)) < -0.01


def test_areal_generate_bodies(http) -> None:
    """The /generate bodies AReaL 1.0.4 builds (SGLangBackend.build_generation_request;
    tests/test_areal.py runs AReaL itself): every sampling field at its GenerationHyperparameters
    default, top_k 1e8 (no cut), image_data [] for a text model. Its compute_logp scoring
    body asks for prompt logprobs (logprob_start_len, input_token_logprobs): the prompt's
    tokens from there on, as a scoring from position 0 gives them (tests/test_scoring.py:
    equal to teacher forcing)."""
    sampling = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 8, "temperature": 0.0,
                "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
                "frequency_penalty": 0.0}
    areal = generate(http, image_data=[], sampling_params=sampling, return_logprob=True,
                     stream=False)
    plain = generate(http, sampling_params=greedy(), return_logprob=True)
    assert areal["output_ids"] == plain["output_ids"]
    assert areal["meta_info"]["output_token_logprobs"] == plain["meta_info"][
        "output_token_logprobs"]
    stop_tok = plain["output_ids"][2]
    end = plain["output_ids"].index(stop_tok) + 1
    assert "</answer>" not in plain["text"]
    stopped = generate(http, image_data=[], return_logprob=True, stream=False,
                       sampling_params={**sampling, "stop_token_ids": [stop_tok],
                                        "stop": ["</answer>"]})
    assert stopped["output_ids"] == plain["output_ids"][:end]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    score = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
             "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 0,
             "stream": False}
    r = http.post("/generate", json=score)
    assert r.status_code == 200, r.text
    whole = generate(http, input_ids=PROMPT, sampling_params={"max_new_tokens": 0},
                     return_logprob=True, logprob_start_len=0)
    got = r.json()["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == PROMPT[2:]
    assert [lp for lp, _, _ in got] == pytest.approx(
        [lp for lp, _, _ in whole["meta_info"]["input_token_logprobs"][2:]], abs=1e-5)


def test_server_info_and_load_reports(http) -> None:
    info = http.get("/server_info").json()
    assert info == {**http.get("/get_server_info").json(), "stats": info["stats"],
                    "stats_stale": info["stats_stale"]}
    assert info["tp_size"] == info["dp_size"] == 1 and info["enable_memory_saver"] is False
    assert info["dtype"] == info["engine_info"]["dtype"]  # slime's --fp16 check reads it
    assert info["served_model_name"] and info["model_path"]
    load = http.get("/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_running_reqs": 0,
                     "num_waiting_reqs": 0, "num_tokens": 0}]
    assert http.get("/v1/loads").json() == {"loads": load}


def test_init_group_port_must_be_a_port(http) -> None:
    body = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}
    for port in ("abc", "0", "70000", "²"):
        r = http.post("/init_weights_update_group", json={**body, "master_port": port})
        assert r.status_code == 400 and "master_port" in r.json()["error"]["message"]


# ---- a real sglang-router in front -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def router(served: Served) -> Iterator[str]:
    need_router()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--worker-urls", served.base_url,
         "--prometheus-port", str(free_port()), "--policy", "round_robin",
         "--disable-circuit-breaker", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/readiness", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout=60, interval=0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_behind_sglang_router(router, http) -> None:
    """Every dialect through sglang-router 0.3.2 answers as the server does directly."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0,
                                                     "sampling_seed": 3, "n": 2},
            "return_logprob": True, "rid": "routed-1"}
    direct = http.post("/generate", json={**body, "rid": "direct-1"}).json()
    with httpx.Client(base_url=router, timeout=60) as rc:
        routed = rc.post("/generate", json=body)
        assert routed.status_code == 200, routed.text
        assert [o["output_ids"] for o in routed.json()] == [o["output_ids"] for o in direct]
        assert [o["meta_info"]["output_token_logprobs"] for o in routed.json()] == [
            o["meta_info"]["output_token_logprobs"] for o in direct]
        chat = {"model": model_name(http), "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0}
        assert rc.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"] == \
            http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        completion = {"model": model_name(http), "prompt": "hi", "max_tokens": 4, "temperature": 0}
        assert rc.post("/v1/completions", json=completion).json()["choices"][0]["text"] == \
            http.post("/v1/completions", json=completion).json()["choices"][0]["text"]
        flushed = rc.post("/flush_cache").json()
        assert flushed["workers_flushed"] == 1
        workers = rc.get("/workers").json()["workers"]
        assert [w["url"] for w in workers] == [str(http.base_url).rstrip("/")]
        assert workers[0]["model_id"] != "unknown"  # named from the top-level server info
