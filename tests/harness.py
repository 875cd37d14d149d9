"""What the test modules share (fixtures are in ``conftest.py``).

- optional pieces: a test skips where one is missing, and fails instead where its
  ``TLT_REQUIRE_*`` switch is 1 (CI sets them);
- waiting on a state: ``wait_for(predicate, timeout, what)``, never a fixed sleep;
- a real server on the tiny model: ``serve()`` starts the engine process (fp32) and uvicorn
  on a free port in a background thread; test modules wrap it in a module-scoped fixture so
  the engine starts once per module; the CLI and fleet launchers as processes;
- the prompts and engines several modules run.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tlt_serve import LLM, kernels
from tlt_serve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
)
from tlt_serve.kernels import CpuKernels, cpu_kernels
from tlt_serve.server.app import build_app
from tlt_serve.server.common.bridge import Bridge

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 256
T = TypeVar("T")

# ---- optional pieces: skip, unless required -------------------------------------------------

DEV = "bash scripts/install.sh"  # installs sglang-router and ray with the dev extras


def skip_unless_required(reason: str, *switches: str) -> NoReturn:
    """Skip the calling test (or module, at import) for a missing optional piece; where one of
    ``switches`` is set to 1 its absence fails instead."""
    on = [s for s in switches if os.environ.get(s) == "1"]
    if on:
        pytest.fail(f"{reason}; {on[0]}=1 requires it", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def need(module: str, install: str, *switches: str, load: bool = True) -> None:
    """Skip unless ``module`` is there (see ``skip_unless_required``). ``load=False`` looks
    for it without importing it (importing vllm or areal changes this process's
    environment)."""
    try:
        found = importlib.import_module(module) if load else importlib.util.find_spec(module)
    except ImportError as err:
        skip_unless_required(f"{module} does not import ({install}): {err}", *switches)
    if found is None:
        skip_unless_required(f"{module} is not installed ({install})", *switches)


def need_router(*also: str) -> None:
    """sglang-router: required by ``TLT_REQUIRE_ROUTER=1`` and by any switch in ``also``
    (the switch of what the test is about, e.g. AReaL's)."""
    need("sglang_router", DEV, "TLT_REQUIRE_ROUTER", *also)


def own_kernels() -> CpuKernels:
    """The own CPU kernels; a skip without them, a failure where ``TLT_REQUIRE_KERNELS=1``."""
    found = cpu_kernels()
    if found is None:
        why = "no AVX2 CPU, or TLT_SERVE_NO_KERNELS=1"
        failed = kernels.build_error()
        if failed:  # the compiler's errors, else the end of what it said
            lines = dict.fromkeys(e for e in failed.splitlines() if "error:" in e)
            why = "their build failed: " + ("\n".join(lines) or failed)[-1500:]
        skip_unless_required(f"the own CPU kernels are not available ({why})",
                             "TLT_REQUIRE_KERNELS")
    return found


# ---- waiting ------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
             interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true, and return that; fail naming
    ``what`` when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)


# ---- a server in this process ------------------------------------------------------------


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
        model=ModelConfig(model=str(model_dir), dtype="float32",
                          max_model_len=engine_kw.pop("max_model_len", MAX_MODEL_LEN),
                          enforce_eager=engine_kw.pop("enforce_eager", False),
                          max_logprobs=engine_kw.pop("max_logprobs", ModelConfig.max_logprobs)),
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
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 30, "uvicorn to start", 0.02)
        assert server.started, "uvicorn exited before it started"
    except AssertionError:
        bridge.shutdown()
        raise
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


def engine_counts(http: httpx.Client) -> tuple[int, int, int]:
    """(running, waiting, in-flight in the front end), fresh from the engine."""
    info = http.get("/get_server_info").json()
    return info["stats"]["running"], info["stats"]["waiting"], info["in_flight"]


def generated_tokens(http: httpx.Client) -> int:
    """Tokens the engine has generated since it started."""
    return int(http.get("/get_server_info").json()["stats"]["generated_tokens"])


def assert_error(resp: httpx.Response, status: int, param: str | None) -> None:
    """An error response of the API's shape, naming ``param`` (when given) in its message."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[-1].split("[")[0] in err["message"], err


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


# ---- the CLI and the fleet launcher as processes ------------------------------------------


def start_cli(
    model: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """The CLI in a session of its own (``os.killpg(proc.pid, ...)`` reaches every process it
    started, as Ctrl-C in a terminal would); ``env`` adds to the environment."""
    cmd = [sys.executable, "-m", "tlt_serve", "serve", "--model", model, "--port", "0",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
           "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO, start_new_session=True)


def read_ready_url(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """The URL of the CLI's ready line (the rest of its output stays in the pipe)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"tlt-serve ready: (http://\S+) \(model ", line)
        if m:
            return m.group(1)
    raise AssertionError("no ready line; output:\n" + "".join(seen))


def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 300) -> str:
    """The first line of ``proc``'s output that starts with ``prefix``; fails with the output
    so far when ``proc`` exits first. The rest of its output is drained from then on."""
    lines: list[str] = []

    def seen() -> bool:
        line = proc.stdout.readline() if proc.stdout else ""
        lines.append(line)
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {''.join(lines)[-2000:]}")
        return line.startswith(prefix)

    wait_for(seen, timeout, f"a line starting {prefix!r}", interval=0)
    # Keep the pipe drained from here on: a full pipe blocks the router's logging (it shares
    # the launcher's stdout), and a blocked router answers nothing.
    threading.Thread(target=lambda: proc.stdout and proc.stdout.read(), daemon=True).start()
    return lines[-1]


def tiny_flags(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "256",
            "--max-num-seqs", "16", "--log-level", "warning"]


def free_run(n: int) -> int:
    """The first of ``n`` consecutive free ports, below Linux's ephemeral range (32768+), so
    that no outgoing connection takes one between now and the replicas binding it."""
    rng = random.Random()
    while True:
        first = rng.randrange(20000, 32000 - n)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", first + i))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def routed(url: str, n: int) -> list[dict]:
    """``n`` requests (rids r0..) through the router, 16 at a time; each answered once."""
    def one(i: int) -> dict:
        body = {"input_ids": [5, 9, 23, i % 50 + 1], "rid": f"r{i}",
                "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": i}}
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(n)))
    assert all(o["output_ids"] for o in outs)
    assert sorted(o["meta_info"]["id"] for o in outs) == sorted(f"r{i}" for i in range(n))
    return outs


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc)."""
    return procs(lambda fields: int(fields[1]) == pid)


def group(pgid: int) -> list[int]:
    """Live (not zombie) pids in process group ``pgid``."""
    return procs(lambda fields: int(fields[2]) == pgid and fields[0] != "Z")


def procs(where: Callable[[list[str]], bool]) -> list[int]:
    """Pids whose /proc stat fields after the name (state, ppid, pgrp, ...) match."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if where(fields):
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    """Exists and is not a zombie (an orphan's zombie may linger where pid 1 does not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ---- prompts and engines ------------------------------------------------------------------

# For the tiny (random) model: texts of different lengths.
PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "What is 12 + 7? Let me think step by step.",
    "Bonjour",
    "Speculative decoding drafts tokens cheaply and verifies them in one forward pass. " * 2,
]
# Rollouts of n samples each, for capture and drafter training on the tiny model.
ROLLOUT_PROMPTS = ["The quick brown fox", "def add(a, b):", "What is 12 + 7?", "Bonjour, ça va?",
                   "Speculative decoding drafts tokens", "Reinforcement learning trains"]
# For the real default model: questions with answers to compare.
REAL_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "If I have 3 apples and buy 5 more, how many apples do I have? Think step by step.",
    "Give me two tips for better sleep.",
    "Translate 'good morning' into Spanish and German.",
]


def make_llm(
    path: Path,
    spec: SpecConfig | None = None,
    rows: int = 8,
    max_len: int = 256,
    dtype: str = "float32",
    prefill: int = 2048,
) -> LLM:
    """An offline engine on ``path`` (speculating with ``spec`` when given)."""
    return LLM(
        config=EngineConfig(
            model=ModelConfig(model=str(path), dtype=dtype, max_model_len=max_len),
            cache=CacheConfig(max_num_seqs=rows),
            scheduler=SchedulerConfig(max_prefill_tokens=prefill),
            spec=spec or SpecConfig(),
        )
    )
