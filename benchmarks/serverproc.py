"""Start ``tlt-serve serve`` in a subprocess on a free port for a benchmark, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: Sequence[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``tlt-serve serve *args`` on a free port; returns once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "tlt_serve.server.cli", "serve", "--port", str(port),
           "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up: {' '.join(cmd)}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running_server(args: Sequence[str]) -> Iterator[str]:
    proc, url = start_server(args)
    try:
        yield url
    finally:
        stop_server(proc)
