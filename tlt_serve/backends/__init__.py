"""The engines behind the server, and the one entry the front end uses to start them.

A backend is an engine process: its entry ``(config, conn, log_level)`` runs in a process of
its own, sends ``Ready(EngineInfo)`` (or ``Failed``) once, then speaks ``tlt_serve/contract``:
it takes ``AddRequest`` / ``Abort`` / ``AbortAll`` / ``Control`` / ``Shutdown`` and sends
``StepBatch``es of per-request ``StepOutput`` deltas and one ``Reply`` per ``Control``, all
through the shared ``common.outbox.Outbox``. The front end (``server/common/bridge.py``) and
the routes never know which backend runs. Every backend answers every control in
``contract.controls.CONTROLS`` (its ``HANDLERS`` table); one it cannot honour is refused
naming the field and the backend.

- ``native``: the own engine, the CPU default and the reference for exactness.
- ``vllm``: vLLM's ``AsyncLLM`` in the engine process, with its own engine-core and worker
  processes: the GPU path, tested here on vLLM's CPU build.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tlt_serve.config import BACKENDS

__all__ = ["BACKENDS", "VLLM_INSTALL", "entry_point", "missing"]
VLLM_INSTALL = "bash scripts/install.sh --vllm"


def missing(backend: str) -> str | None:
    """Why ``backend`` cannot run in this environment (one line), or None when it can."""
    if backend != "vllm":
        return None
    if importlib.util.find_spec("vllm") is None:
        return f"--backend vllm: vLLM is not installed in this environment; run {VLLM_INSTALL}"
    from tlt_serve.backends.vllm.compat import installed_version, version_problem

    why = version_problem(installed_version())
    return None if why is None else f"--backend vllm: {why}"


def entry_point(backend: str) -> Callable[[Any, Connection, str], None]:
    """The engine process's entry point for ``backend`` (a picklable module function)."""
    if backend == "vllm":
        from tlt_serve.backends.vllm.process import run_vllm

        return run_vllm
    from tlt_serve.backends.native.process import run_native

    return run_native
