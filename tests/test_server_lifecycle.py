"""Process lifecycle: the CLI (ready line, SIGTERM with in-flight requests), a dying engine
process, and an engine that cannot start."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.harness import (
    children,
    engine_counts,
    group,
    read_ready_url,
    running,
    serve,
    server_config,
    sse_events,
    start_cli,
    wait_for,
)
from tlt_serve.config import CaptureConfig
from tlt_serve.engine.capture import header_metadata
from tlt_serve.server.common.bridge import Bridge, EngineStartError

LONG = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}


def test_a_start_killed_while_building_the_kernels_does_not_block_the_next(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL every process of a bf16 server while it compiles the CPU kernels (torch's
    build ``lock`` file is left behind), then start again: it builds and serves."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    first = start_cli(str(tiny_model_dir), "--dtype", "bfloat16", env=env)
    try:
        lock = wait_for(lambda: next((tmp_path / "ext").glob("tlt_serve_bf16_*/lock"), None),
                        timeout=120, interval=0.02)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    # The compilers of the dead build go too (they are in its process group).
    wait_for(lambda: not group(first.pid), 30, "the killed build's processes to exit")
    assert lock.exists()  # what made every later start wait forever
    second = start_cli(str(tiny_model_dir), "--dtype", "bfloat16", env=env)
    try:
        url = read_ready_url(second, timeout=600)
        with httpx.Client(base_url=url, timeout=60) as http:
            out = http.post("/generate", json={"text": "hi", "sampling_params": {
                "max_new_tokens": 4, "temperature": 0}})
            assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
            info = http.get("/get_server_info").json()
        assert info["engine_info"]["dtype"] == "bfloat16"
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(60)
    assert not lock.exists()
    assert [p.name for p in lock.parent.glob("*.so")]  # it built the kernels, not gave up


def test_cli_serves_and_sigterm_aborts_in_flight(tiny_model_dir) -> None:
    proc = start_cli(str(tiny_model_dir), "--api-key", "k")
    try:
        url = read_ready_url(proc)
        headers = {"Authorization": "Bearer k"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            assert http.get("/health").status_code == 200
            out = http.post("/generate", json={"text": "hi", "sampling_params": {
                "max_new_tokens": 3, "temperature": 0}}).json()
            assert len(out["output_ids"]) == 3
            http.post("/pause_generation", json={"mode": "in_place"})
            events: list = []

            def stream() -> None:
                body = {"text": "hi", "sampling_params": LONG, "stream": True}
                with httpx.Client(base_url=url, headers=headers, timeout=60) as c, c.stream(
                    "POST", "/generate", json=body
                ) as resp:
                    events.extend(sse_events(resp.iter_lines()))

            t = threading.Thread(target=stream, daemon=True)
            t.start()
            wait_for(lambda: engine_counts(http)[1] == 1)
            engines = children(proc.pid)
            assert engines, "the engine runs in its own process"
            proc.send_signal(signal.SIGTERM)
            t.join(30)
        assert events and events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        # uvicorn re-raises the signal after its graceful shutdown: -SIGTERM is the clean exit.
        assert proc.wait(60) in (0, -signal.SIGTERM)
        wait_for(lambda: not [pid for pid in engines if running(pid)])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stdout is not None
    assert "k" not in re.findall(r"Bearer \S+", proc.stdout.read())


def test_cli_bad_model_exits_nonzero(tmp_path) -> None:
    proc = start_cli(str(tmp_path / "missing"))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "engine failed to start" in out


def test_engine_start_failure_is_reported_not_hung(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a directory that is not a model
    client = Bridge(server_config(tmp_path).engine, "critical")
    with pytest.raises(EngineStartError):
        client.start(timeout=120)
    client.shutdown()


def test_a_helper_the_engine_starts_holds_none_of_its_pipes(tiny_model_dir) -> None:
    """Lending captured features by reference starts torch's shared-memory manager from the
    engine process: a helper that outlives it. It holds none of the engine's descriptors but
    stdio: held, the engine's end of the pipe and its exit sentinel would stay open after the
    engine exits, and the front end would wait out its shutdown timeout, blind to the exit."""
    import psutil

    served = serve(tiny_model_dir, capture=CaptureConfig(enabled=True))
    try:
        engine = psutil.Process(served.bridge._proc.pid)
        with served.http() as http:
            http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 4}})
            blob = http.get("/drafter/samples", params={"share": "true"}).content
        assert "features_ref" in header_metadata(blob)
        helpers = [p for p in engine.children() if p.name() == "torch_shm_manager"]
        assert helpers
        ours = open_descriptors(engine.pid)
        for helper in helpers:
            held = ours & open_descriptors(helper.pid)
            assert not held, f"{helper.name()} holds the engine's {sorted(held)}"
    finally:
        served.stop()
    assert served.bridge._proc.exitcode == 0


def open_descriptors(pid: int) -> set[str]:
    """What the descriptors of ``pid`` above stderr point at (``pipe:[inode]``, ...)."""
    out = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        if int(name) > 2:
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/{pid}/fd/{name}"))
    return out


def test_engine_death_fails_requests_and_health(tiny_model_dir) -> None:
    served = serve(tiny_model_dir)
    try:
        with served.http() as http:
            http.post("/pause_generation", json={"mode": "in_place"})
            results: dict[str, object] = {}

            def blocking() -> None:
                with served.http() as c:
                    results["blocking"] = c.post("/generate", json={"text": "a",
                                                                    "sampling_params": LONG})

            def streaming() -> None:
                body = {"text": "b", "sampling_params": LONG, "stream": True}
                with served.http() as c, c.stream("POST", "/generate", json=body) as resp:
                    results["stream"] = sse_events(resp.iter_lines())

            threads = [threading.Thread(target=f, daemon=True) for f in (blocking, streaming)]
            for t in threads:
                t.start()
            wait_for(lambda: engine_counts(http)[1] == 2)
            served.bridge._proc.kill()  # the engine process dies mid-service
            for t in threads:
                t.join(30)
            blocked = results["blocking"]
            assert isinstance(blocked, httpx.Response) and blocked.status_code == 503
            events = results["stream"]
            assert isinstance(events, list) and events[-1]["error"]["code"] == 503
            wait_for(lambda: http.get("/health").status_code == 503)
            resp = http.post("/generate", json={"text": "c"})
            assert resp.status_code == 503 and "engine" in resp.json()["error"]["message"]
    finally:
        served.stop()
