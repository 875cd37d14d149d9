"""The engines behind the server, and the one interface the routes use to reach them.

A backend is an engine process: ``entry(config, conn, log_level)`` runs in a process of its
own, sends ``Ready(EngineInfo)`` (or ``Failed``) once, then speaks ``server/messages.py``:
it takes ``AddRequest`` / ``Abort`` / ``AbortAll`` / ``Control`` / ``Shutdown`` and sends
``StepBatch``es of per-request ``StepOutput`` deltas, one ``Reply`` per ``Control``. The
front end (``server/bridge.EngineClient``) and the routes never know which backend runs.
Every backend answers every control in ``CONTROLS``; one it cannot honour fails with a
message naming the field and the backend (the route answers 400).

- ``native``: the own engine (``server/engine_proc.py``), the CPU default and the reference
  for exactness.
- ``vllm``: vLLM's ``AsyncLLM`` in the engine process, with its own engine-core and worker
  processes (``backends/vllm/``): the GPU path, tested here on vLLM's CPU build.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tlt_serve.config import BACKENDS

__all__ = ["BACKENDS", "CONTROLS", "engine_entry", "missing"]
VLLM_INSTALL = "bash scripts/install.sh --vllm"

# Controls the front end sends (Control.name); their arguments are in server/routes_*.py.
CONTROLS = (
    "info", "stats", "pause", "continue", "flush_cache",
    "update_weights_from_disk", "update_weights_from_file", "update_weight_version",
    "init_weights_update_group", "update_weights_from_distributed",
    "destroy_weights_update_group", "export_weights",
    "update_drafter_from_disk", "drafter_info", "capture_take", "drafter_target",
)


def missing(backend: str) -> str | None:
    """Why ``backend`` cannot run in this environment (one line), or None when it can."""
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return f"--backend vllm: vLLM is not installed in this environment; run {VLLM_INSTALL}"
    return None


def engine_entry(backend: str) -> Callable[[Any, Connection, str], None]:
    """The engine process's entry point for ``backend`` (a picklable module function)."""
    if backend == "vllm":
        from tlt_serve.backends.vllm.proc import run_vllm_engine

        return run_vllm_engine
    from tlt_serve.server.engine_proc import run_engine

    return run_engine
