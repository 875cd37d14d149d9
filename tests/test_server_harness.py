"""A real server for the HTTP tests, plus tests of the harness's own pieces.

``serve()`` starts the engine process (tiny fp32 model) and uvicorn on a free port in a
background thread; test modules wrap it in a module-scoped fixture so the engine starts
once per module.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from tlt_serve.flags import parse as parse_serve_flags
from tlt_serve.server.app import build_app
from tlt_serve.server.common.bridge import Bridge

MAX_MODEL_LEN = 256


@dataclass
class Served:
    base_url: str
    bridge: Bridge
    server: uvicorn.Server
    thread: threading.Thread
    model_dir: Path
    api_key: str | None

    def http(self, timeout: float = 60.0, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.bridge.shutdown()


def server_config(
    model_dir: Path,
    api_key: str | None = None,
    server_kw: dict[str, Any] | None = None,
    **engine_kw: Any,
) -> ServerConfig:
    engine = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(max_num_seqs=engine_kw.pop("max_num_seqs", 8)),
        **engine_kw,
    )
    return ServerConfig(
        engine=engine, port=0, api_key=api_key, log_level="warning", **(server_kw or {})
    )


def serve(
    model_dir: Path,
    api_key: str | None = None,
    server_kw: dict[str, Any] | None = None,
    **engine_kw: Any,
) -> Served:
    """``server_kw``: other ServerConfig fields (admin_key, request_timeout_s, ...)."""
    config = server_config(model_dir, api_key, server_kw, **engine_kw)
    bridge = Bridge(config.engine, "warning", config.request_timeout_s)
    bridge.start()
    app = build_app(config, bridge)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            bridge.shutdown()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Served(f"http://127.0.0.1:{port}", bridge, server, thread, model_dir, api_key)


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parse ``data: ...`` lines until ``[DONE]`` (which must come)."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return events
        events.append(json.loads(data))
    raise AssertionError("stream ended without data: [DONE]")


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def engine_counts(http: httpx.Client) -> tuple[int, int, int]:
    """(running, waiting, in-flight in the front end), fresh from the engine."""
    info = http.get("/get_server_info").json()
    return info["stats"]["running"], info["stats"]["waiting"], info["in_flight"]


class Scrape:
    """One ``/metrics`` scrape, parsed by prometheus-client's own parser."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, missing: float | None = None, **labels: str) -> float:
        """Sum of the samples named ``sample`` whose labels include ``labels``; a missing
        series fails the test unless ``missing`` gives its value."""
        found = [
            s.value
            for f in self.families.values()
            for s in f.samples
            if s.name == sample and labels.items() <= s.labels.items()
        ]
        if not found and missing is not None:
            return missing
        assert found, f"{sample}{labels} not in /metrics ({sorted(self.families)})"
        return float(sum(found))

    def labels(self, sample: str, label: str) -> set[str]:
        """The values ``label`` takes across the samples named ``sample``."""
        return {s.labels[label] for f in self.families.values() for s in f.samples
                if s.name == sample and label in s.labels}


def scrape(http: httpx.Client) -> Scrape:
    resp = http.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return Scrape(resp.text)


# ---- the harness's own pieces ---------------------------------------------------------------


def test_cli_parses_into_a_frozen_server_config() -> None:
    cfg = parse_serve_flags([
        "--model", "m", "--port", "1234", "--dtype", "float32", "--api-key", "k",
        "--max-model-len", "512", "--max-num-seqs", "4", "--seed", "7", "--log-level", "debug",
    ])
    assert (cfg.port, cfg.api_key, cfg.log_level) == (1234, "k", "debug")
    assert cfg.engine.model.model == "m" and cfg.engine.model.dtype == "float32"
    assert cfg.engine.model.max_model_len == 512 and cfg.engine.cache.max_num_seqs == 4
    assert cfg.engine.seed == 7


def test_cli_defaults() -> None:
    cfg = parse_serve_flags([])
    assert (cfg.host, cfg.port, cfg.engine.model.dtype) == ("127.0.0.1", 30000, "bfloat16")
    assert cfg.engine.model.model == "smollm2-135m"


def test_sse_parser_requires_done() -> None:
    assert sse_events(iter(['data: {"a": 1}', "", "data: [DONE]"])) == [{"a": 1}]
