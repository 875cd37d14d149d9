"""Limits and keys: a separate admin key for the admin routes, a per-request timeout that
returns the partial output, and a cap on request bodies (413 before buffering)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from tests.harness import Served, assert_error, engine_counts, serve, server_config, wait_for
from tlt_serve.config import ConfigError
from tlt_serve.flags import parse as parse_serve_flags
from tlt_serve.sampling_params import ParamError
from tlt_serve.server.common import jobs
from tlt_serve.server.common.uploads import MAX_UPLOADS, TensorUploads
from tlt_serve.server.control import routes as control_routes

USER, ADMIN = "user-key", "admin-key"
TIMEOUT_S = 1.5
MAX_BODY = 4096
OK_SP = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    s = serve(tiny_model_dir, api_key=USER, max_num_seqs=2, server_kw={
        "admin_key": ADMIN, "request_timeout_s": TIMEOUT_S, "max_body_bytes": MAX_BODY})
    yield s
    s.stop()


def as_(served: Served, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=served.base_url, headers=headers, timeout=60)


ADMIN_CALLS = [
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", None),
    ("POST", "/flush_cache", None),
    ("POST", "/abort_request", {"rid": "nobody"}),
    ("POST", "/update_weight_version", {"new_version": "v-admin"}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/destroy_weights_update_group", {}),
    ("GET", "/drafter/gate", None),
    ("GET", "/drafter/samples", None),
    ("POST", "/pause_drafter_training", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_admin_routes_need_the_admin_key(served: Served, method, path, body) -> None:
    with as_(served, USER) as user, as_(served, None) as anon, as_(served, ADMIN) as admin:
        denied = user.request(method, path, json=body)
        assert_error(denied, 403, None)
        assert "admin key" in denied.json()["error"]["message"]
        assert_error(anon.request(method, path, json=body), 401, None)
        assert admin.request(method, path, json=body).status_code not in (401, 403)
        admin.post("/continue_generation")


def test_user_and_admin_keys_both_open_user_routes(served: Served) -> None:
    body = {"text": "hi", "sampling_params": OK_SP}
    with as_(served, USER) as user, as_(served, ADMIN) as admin, as_(served, None) as anon:
        assert user.post("/generate", json=body).status_code == 200
        assert admin.post("/generate", json=body).status_code == 200
        assert_error(anon.post("/generate", json=body), 401, None)
        assert anon.get("/health").status_code == 200
        info = user.get("/get_server_info")
        assert info.status_code == 200 and info.json()["admin_key"] == "<set>"
        assert USER not in info.text and ADMIN not in info.text


def test_admin_key_alone_guards_only_the_admin_routes(tiny_model_dir) -> None:
    s = serve(tiny_model_dir, server_kw={"admin_key": ADMIN})
    try:
        with as_(s, None) as anon, as_(s, ADMIN) as admin:
            assert anon.post("/generate", json={"text": "hi", "sampling_params": OK_SP}
                             ).status_code == 200
            assert_error(anon.post("/flush_cache"), 401, None)
            assert admin.post("/flush_cache").status_code == 200
    finally:
        s.stop()


def test_request_timeout_returns_the_partial_output(served: Served) -> None:
    """A request still queued (paused engine) or running after the timeout is aborted; the
    caller gets what it has so far, and nothing is left in flight."""
    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with as_(served, ADMIN) as http:
        http.post("/pause_generation", json={"mode": "in_place"})
        try:
            t0 = time.monotonic()
            out = http.post("/generate", json={"text": "hi", "sampling_params": long})
            waited = time.monotonic() - t0
        finally:
            http.post("/continue_generation")
        assert out.status_code == 200, out.text
        meta = out.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and out.json()["output_ids"] == []
        assert TIMEOUT_S <= waited < TIMEOUT_S + 10
        short = http.post("/generate", json={"text": "hi", "sampling_params": OK_SP}).json()
        assert short["meta_info"]["finish_reason"]["type"] == "length"
        wait_for(lambda: engine_counts(http) == (0, 0, 0))


def test_bodies_over_the_limit_get_413(served: Served) -> None:
    big = {"input_ids": [1] * MAX_BODY, "sampling_params": OK_SP}
    with as_(served, USER) as http:
        assert_error(http.post("/generate", json=big), 413, "body")

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"input_ids": ['
            for _ in range(MAX_BODY // 4):
                yield b"1, 1, "
            yield b'1], "sampling_params": {"max_new_tokens": 2}}'

        assert_error(http.post("/generate", content=chunks()), 413, "body")
        ok = http.post("/generate", json={"input_ids": [1] * 50, "sampling_params": OK_SP})
        assert ok.status_code == 200
    with as_(served, ADMIN) as admin:  # weight uploads stream to disk: no body cap
        resp = admin.post("/update_weights_from_tensor", content=b"\0" * (2 * MAX_BODY))
        assert resp.status_code == 400 and "413" not in resp.text


def test_cli_limit_flags(capsys) -> None:
    cfg = parse_serve_flags(["--admin-key", "a", "--api-key", "u", "--request-timeout", "30",
                      "--max-body-mb", "2", "--max-waiting", "16", "--max-logprobs", "-1"])
    assert (cfg.admin_key, cfg.api_key, cfg.request_timeout_s) == ("a", "u", 30.0)
    assert cfg.max_body_bytes == 2 << 20 and cfg.engine.scheduler.max_waiting == 16
    assert cfg.engine.model.max_logprobs == -1
    with pytest.raises(SystemExit):
        parse_serve_flags(["--max-logprobs", "-2"])
    assert "--max-logprobs: max_logprobs: must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(("kw", "field"), [
    ({"request_timeout_s": 0.0}, "request_timeout"),
    ({"max_body_bytes": 10}, "max_body_mb"),
    ({"admin_key": "same"}, "admin_key"),
])
def test_bad_limits_name_the_field(tmp_path, kw, field) -> None:
    cfg = server_config(tmp_path, api_key="same", server_kw=kw)
    with pytest.raises(ConfigError, match=f"^{field}:"):
        cfg.validate()


def test_abandoned_uploads_do_not_pile_up(tmp_path) -> None:
    uploads = TensorUploads(str(tmp_path))
    for k in range(MAX_UPLOADS + 3):  # each starts a multi-chunk upload and never finishes
        uploads.begin_chunk(f"u{k}", 0, 2).write_bytes(b"x" * 10)
        uploads.end_chunk(f"u{k}")
    assert len(list(tmp_path.iterdir())) == MAX_UPLOADS
    with pytest.raises(ParamError, match="has not started"):
        uploads.begin_chunk("u0", 1, 2)  # the oldest went first
    path = uploads.begin_chunk(f"u{MAX_UPLOADS + 2}", 1, 2)  # the newest is still there
    assert path.read_bytes() == b"x" * 10
    uploads.discard_all()
    assert not list(tmp_path.iterdir())


def test_a_busy_engine_gives_503_or_stale_stats_not_500(served: Served, monkeypatch) -> None:
    """When an engine step outlasts the stats timeout (a big prefill on a loaded CPU),
    /get_server_info falls back to the last pushed stats and says so; /health_generate
    answers 503 with Retry-After."""
    with as_(served, USER) as http:
        assert http.post("/generate", json={"text": "hi", "sampling_params": OK_SP}
                         ).status_code == 200  # the engine has pushed stats at least once
        monkeypatch.setattr(control_routes, "STATS_TIMEOUT_S", 0.0)
        info = http.get("/get_server_info")
        assert info.status_code == 200 and info.json()["stats_stale"] is True
        busy = http.get("/health_generate")
        assert_error(busy, 503, None)
        assert busy.headers["retry-after"] == "1"
        assert http.get("/metrics").status_code == 200
        monkeypatch.undo()
        assert http.get("/get_server_info").json()["stats_stale"] is False


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "hi", "stream": True, "sampling_params": OK_SP}),
    ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 2}),
])
def test_queued_streams_get_keepalive_comments(served: Served, monkeypatch, path, body) -> None:
    """A stream waiting in the queue sends SSE comments (proxies with idle timeouts keep it);
    here the request timeout then ends it, and it still closes properly."""
    monkeypatch.setattr(jobs, "SSE_KEEPALIVE_S", 0.2)
    with as_(served, ADMIN) as http:
        http.post("/pause_generation", json={"mode": "in_place"})
        try:
            with http.stream("POST", path, json=body) as resp:
                lines = [line for line in resp.iter_lines() if line]
        finally:
            http.post("/continue_generation")
        wait_for(lambda: engine_counts(http) == (0, 0, 0))
    comments = [line for line in lines if line.startswith(":")]
    assert len(comments) >= 3 and set(comments) == {": keep-alive"}
    assert lines.index(comments[0]) == 0 and lines[-1] == "data: [DONE]"


def test_leaving_a_queued_stream_during_keepalives_frees_it(served: Served, monkeypatch) -> None:
    monkeypatch.setattr(jobs, "SSE_KEEPALIVE_S", 0.1)
    body = {"text": "hi", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with as_(served, ADMIN) as http:
        http.post("/pause_generation", json={"mode": "in_place"})
        try:
            with as_(served, USER) as c, c.stream("POST", "/generate", json=body) as resp:
                lines = resp.iter_lines()  # held: dropping it would close the response
                assert next(line for line in lines if line) == ": keep-alive"
                assert engine_counts(http)[1:] == (1, 1)  # queued, in flight
            wait_for(lambda: engine_counts(http) == (0, 0, 0))  # gone before it ever ran
        finally:
            http.post("/continue_generation")


def test_sse_events_stay_on_one_line_for_line_readers() -> None:
    """Generated text can hold U+0085 / U+2028 / U+2029: JSON keeps them raw, but httpx's
    iter_lines (str.splitlines) breaks lines there; the soak smoke test once got an event
    cut in two. Escaped, the event is one line and decodes to the same text."""
    text = "a\x85b\u2028c\u2029d\x0be\x1cf"
    event = jobs.sse_event(msgspec.json.encode({"text": text}))
    lines = [line for line in httpx._decoders.LineDecoder().decode(event.decode()) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["text"] == text
