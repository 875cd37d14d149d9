"""Bad input is a 4xx naming the field (never a 500), and the server keeps serving.

This module's server requires an API key, so it also covers authentication.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.harness import MAX_MODEL_LEN, Served, assert_error, serve

KEY = "s3cret-key"
OK_SP = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    s = serve(tiny_model_dir, api_key=KEY, max_num_seqs=2)
    yield s
    s.stop()


def test_auth_required_except_health(served: Served) -> None:
    with httpx.Client(base_url=served.base_url) as anon:
        assert anon.get("/health").status_code == 200
        for path in ("/get_model_info", "/v1/models", "/metrics"):
            resp = anon.get(path)
            assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert anon.post("/generate", json={"text": "hi"}).status_code == 401
        wrong = anon.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, None)
        assert KEY not in wrong.text
        good = anon.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert good.status_code == 200
    with served.http() as http:
        assert KEY not in http.get("/get_server_info").text


BAD_GENERATE = [
    ({"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": "hi", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
    ({"text": "hi", "bogus": 1}, "bogus"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"text": "hi", "sampling_params": {"top_k": -5}}, "sampling_params.top_k"),
    ({"text": "hi", "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "hi", "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ({"text": "hi", "sampling_params": {"sampling_seed": -1}}, "sampling_params.sampling_seed"),
    ({"text": "hi", "sampling_params": {"frequency_penalty": 0.5}},
     "sampling_params.frequency_penalty"),
    ({"text": "hi", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"text": "hi", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": [[1, 2], [3]], "return_logprob": True, "logprob_start_len": [1, 1]},
     "logprob_start_len"),
    ({"input_ids": [1, 2, 100000]}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1] * MAX_MODEL_LEN}, "input_ids"),
    ({"input_ids": [[1, 2], [3, 99999]]}, "input_ids[1]"),
    ({"input_ids": [1, [2]]}, "input_ids"),
    ({"input_ids": "abc"}, "input_ids"),
    ({}, "text"),
    ({"text": "hi", "input_ids": [1]}, "text"),
    ({"text": ["a", "b"], "rid": "one"}, "rid"),
    ({"text": ["a", "b"], "sampling_params": [OK_SP]}, "sampling_params"),
]


@pytest.mark.parametrize(("body", "param"), BAD_GENERATE)
def test_bad_generate_bodies(http, body, param) -> None:
    assert_error(http.post("/generate", json=body), 400, param)
    assert http.post("/generate", json={"text": "hi", "sampling_params": OK_SP}).status_code == 200


def test_malformed_json_and_wrong_shapes(http) -> None:
    assert_error(http.post("/generate", content=b"{not json"), 400, "body")
    assert_error(http.post("/generate", content=b"[1, 2]"), 400, None)
    assert_error(http.post("/generate", content=b'{"text": "hi"'), 400, "body")
    assert http.post("/generate", json={"text": "hi", "sampling_params": OK_SP}).status_code == 200


def test_unknown_route_and_method(http) -> None:
    assert_error(http.get("/nope"), 404, None)
    assert_error(http.get("/generate"), 405, None)


def test_duplicate_rid_is_refused(http) -> None:
    http.post("/pause_generation", json={"mode": "in_place"})
    try:
        body = {"text": "hi", "rid": "dup", "stream": True, "sampling_params": OK_SP}
        with (
            httpx.Client(base_url=http.base_url, headers=http.headers, timeout=30) as other,
            other.stream("POST", "/generate", json=body) as resp,
        ):
            assert resp.status_code == 200
            again = http.post("/generate", json={"text": "hi", "rid": "dup"})
            assert_error(again, 400, "rid")
            http.post("/continue_generation")
            assert "[DONE]" in resp.read().decode()
    finally:
        http.post("/continue_generation")


def test_queue_full_is_503_with_retry_after(served: Served, http) -> None:
    """The engine refuses past max_waiting; the refusal travels back as a 503."""
    from dataclasses import replace

    small = replace(served.bridge.config.scheduler, max_waiting=1)
    engine = replace(served.bridge.config, scheduler=small)
    tiny = serve(served.model_dir, api_key=KEY, max_num_seqs=1, scheduler=engine.scheduler)
    try:
        with tiny.http() as c:
            c.post("/pause_generation", json={"mode": "in_place"})
            with (
                httpx.Client(base_url=tiny.base_url, headers=c.headers, timeout=30) as other,
                other.stream("POST", "/generate", json={"text": "a", "stream": True}),
            ):
                resp = c.post("/generate", json={"text": "b"})
                assert_error(resp, 503, None)
                assert resp.headers["retry-after"] == "1"
                c.post("/abort_request", json={"abort_all": True})
            c.post("/continue_generation")
            ok = c.post("/generate", json={"text": "c", "sampling_params": OK_SP})
            assert ok.status_code == 200
    finally:
        tiny.stop()


BAD_CONTROL = [
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/pause_generation", {"mdoe": "abort"}, "mdoe"),
    ("/abort_request", {}, "rid"),
    ("/abort_request", {"rid": 5}, "rid"),
    ("/update_weights_from_disk", {}, None),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, None),
    ("/update_weights_from_disk", {"model_path": "/x", "load_format": "gguf"}, "load_format"),
    ("/update_weight_version", {"new_version": ""}, "new_version"),
    ("/update_weight_version", {"new_version": "v\U0006718f"}, "new_version"),  # fuzz-found
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "v" * 129},
     "weight_version"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_CONTROL)
def test_bad_control_bodies(http, path, body, param) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    if param is not None:
        assert_error(resp, 400, param)
    assert http.get("/health").status_code == 200


def test_bad_tensor_upload_parameters(http) -> None:
    assert_error(http.post("/update_weights_from_tensor?chunk=2&num_chunks=2", content=b"x"),
                 400, "chunk")
    assert_error(http.post("/update_weights_from_tensor?chunk=1&num_chunks=3&upload_id=zz",
                           content=b"x"), 400, "chunk")
    assert_error(http.post("/update_weights_from_tensor?num_chunks=0", content=b"x"),
                 400, "num_chunks")
    assert_error(http.post("/update_weights_from_tensor?chunk=abc", content=b"x"), 400, "chunk")
