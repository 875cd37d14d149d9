"""sglang-router as a child process, set up for a fleet of tlt-serve replicas.

- ``--disable-circuit-breaker``: the router counts every 4xx as a worker failure and, after
  ten, stops sending that worker anything for a minute; a client's bad requests must not
  take a healthy replica out. Dead replicas are found by health checks instead.
- Health checks every second, a worker is out after two failures and back after one success.
- Retries stay on: a request that meets a connection error or a 5xx (a replica killed, or
  its queue full) is sent again, whole, to a worker the policy picks.
- Each router gets its own Prometheus port (two on the default port: the second dies).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tlt_serve.fleet.children import die_with_parent

ROUTER_INSTALL = "pip install sglang-router==0.3.2 (or the fleet extra)"
POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")


def router_missing() -> str | None:
    if importlib.util.find_spec("sglang_router") is None:
        return f"the fleet needs sglang-router: {ROUTER_INSTALL}"
    return None


def answers(url: str) -> bool:
    """GET ``url`` answers 200 (within 2 s)."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def router_command(
    host: str, port: int, worker_urls: list[str], policy: str, log_level: str
) -> list[str]:
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host,
           "--port", str(port), "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--disable-circuit-breaker", "--health-check-interval-secs", "1",
           "--health-failure-threshold", "2", "--health-success-threshold", "1",
           "--log-level", {"warning": "warn", "critical": "error"}.get(log_level, log_level)]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    return cmd


class RouterProcess:
    """A running sglang-router; ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, host: str, port: int, worker_urls: list[str], policy: str = "round_robin",
                 log_level: str = "warning") -> None:
        self.url = f"http://{host}:{port}"
        self.proc = subprocess.Popen(
            router_command(host, port, worker_urls, policy, log_level), start_new_session=True,
            preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread()
            else None,
        )

    def wait_up(self, timeout: float = 60.0) -> None:
        """Until the router answers (it answers ``/liveness`` itself, workers or not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.proc.returncode}")
            if answers(f"{self.url}/liveness"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"sglang-router did not answer at {self.url} in {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
