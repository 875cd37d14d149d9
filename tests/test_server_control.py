"""Abort, client disconnects, pause/continue and cache flushes against a real engine process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.harness import Served, engine_counts, generated_tokens, scrape, sse_events, wait_for

LONG = {"max_new_tokens": 240, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with served.http() as client:
        yield client
    # Every test leaves the engine idle and unpaused for the next one.
    with served.http() as client:
        client.post("/continue_generation")
        wait_for(lambda: engine_counts(client) == (0, 0, 0))


class Background:
    """A blocking HTTP call in a thread (the test thread keeps steering the server)."""

    def __init__(self, served: Served, path: str, body: dict[str, Any]) -> None:
        self.result: httpx.Response | None = None
        self.thread = threading.Thread(target=self._run, args=(served, path, body), daemon=True)
        self.thread.start()

    def _run(self, served: Served, path: str, body: dict[str, Any]) -> None:
        with served.http() as client:
            self.result = client.post(path, json=body)

    def join(self, timeout: float = 30) -> httpx.Response:
        self.thread.join(timeout)
        assert self.result is not None, "request did not complete"
        return self.result


def test_abort_streaming_request_returns_partial_output(served, http) -> None:
    body = {"text": "hello", "sampling_params": LONG, "rid": "abort-stream", "stream": True}
    with served.http() as streamer, streamer.stream("POST", "/generate", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first
        assert http.post("/abort_request", json={"rid": "abort-stream"}).json()["success"]
        events = sse_events(lines)
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= last["meta_info"]["completion_tokens"] < 240
    assert len(last["output_ids"]) == last["meta_info"]["completion_tokens"]


def test_abort_blocking_request_and_abort_all(served, http) -> None:
    http.post("/pause_generation", json={"mode": "in_place"})
    calls = [Background(served, "/generate", {"text": "hi", "sampling_params": LONG, "rid": r})
             for r in ("ab-1", "ab-2")]
    wait_for(lambda: engine_counts(http)[1] == 2)  # both queued behind the pause
    http.post("/abort_request", json={"rid": "ab-1"})
    first = calls[0].join().json()
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    assert first["output_ids"] == []
    http.post("/continue_generation")
    wait_for(lambda: generated_tokens(http) > 0 and engine_counts(http)[0] == 1)
    http.post("/abort_request", json={"abort_all": True})
    second = calls[1].join().json()
    assert second["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(second["output_ids"]) < 240


def test_streaming_disconnect_frees_the_request(served, http) -> None:
    http.post("/pause_generation", json={"mode": "in_place"})
    body = {"text": "hello", "sampling_params": LONG, "stream": True}
    with served.http() as streamer, streamer.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        wait_for(lambda: engine_counts(http) == (0, 1, 1))
    # The connection is closed: the server must abort the request and free its slot.
    wait_for(lambda: engine_counts(http) == (0, 0, 0))


def test_streaming_disconnect_mid_generation(served, http) -> None:
    before = generated_tokens(http)
    body = {"text": "hello", "sampling_params": LONG, "stream": True}
    with served.http() as streamer, streamer.stream("POST", "/generate", json=body) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    wait_for(lambda: engine_counts(http) == (0, 0, 0))
    assert generated_tokens(http) - before < 240


def test_blocking_disconnect_frees_the_request(served, http) -> None:
    http.post("/pause_generation", json={"mode": "in_place"})
    with served.http(timeout=1.0) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/generate", json={"text": "hi", "sampling_params": LONG})
    wait_for(lambda: engine_counts(http) == (0, 0, 0))


def test_pause_in_place_keeps_requests_and_continue_finishes_them(served, http) -> None:
    body = {"text": "pause me", "sampling_params": {**LONG, "max_new_tokens": 120}}
    reference = http.post("/generate", json=body).json()
    call = Background(served, "/generate", body)
    wait_for(lambda: generated_tokens(http) > 0 and engine_counts(http)[0] == 1, interval=0.001)
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    frozen = generated_tokens(http)
    time.sleep(0.3)
    assert generated_tokens(http) == frozen  # no steps while paused
    assert engine_counts(http)[0] == 1 and call.thread.is_alive()
    assert http.post("/flush_cache").status_code == 400  # a request still holds KV
    # vLLM's load gauges, as prime-rl's concurrency control scrapes them
    rows = http.get("/get_server_info").json()["engine_info"]["max_num_seqs"]
    m = scrape(http)
    assert m.value("vllm:num_requests_running", engine="0") == 1
    assert m.value("vllm:num_requests_waiting") == 0
    assert m.value("vllm:kv_cache_usage_perc") == pytest.approx(1 / rows)
    http.post("/continue_generation")
    out = call.join().json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == reference["output_ids"]  # its KV survived the pause


def test_pause_abort_returns_partials_and_queues_new_requests(served, http) -> None:
    call = Background(served, "/generate", {"text": "x", "sampling_params": LONG})
    wait_for(lambda: generated_tokens(http) > 0 and engine_counts(http)[0] == 1)
    assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    aborted = call.join().json()
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(aborted["output_ids"]) < 240
    queued = Background(served, "/generate", {"text": "y", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}})
    wait_for(lambda: engine_counts(http)[1] == 1)
    time.sleep(0.2)
    assert queued.thread.is_alive()  # paused: waits, is not refused
    # What slime does next (pause, flush, update): the waiting request holds no KV
    assert http.post("/flush_cache").status_code == 200
    http.post("/continue_generation")
    assert len(queued.join().json()["output_ids"]) == 4


def test_health_generate_while_paused(http) -> None:
    http.post("/pause_generation", json={"mode": "in_place"})
    resp = http.get("/health_generate")
    assert resp.status_code == 200 and resp.json()["paused"] is True
