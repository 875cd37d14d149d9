"""What the vLLM engine process serves now, shared by its loop and its control handlers, and
the one way to call our worker extension (``worker.py``) inside vLLM's worker process.

The handlers change the state (a weight update bumps ``version``, a swap sets
``drafter_version``, pause sets ``paused``); the loop reads it (every output carries the
versions, stats report it) and counts the samples in flight (``live``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tlt_serve.contract.controls import ControlError
from tlt_serve.contract.reports import EngineInfo

RPC_TIMEOUT_S = 600.0  # vLLM does not fail a pending collective_rpc when its engine dies


@dataclass
class VllmState:
    info: EngineInfo
    version: str  # the target weight version served
    drafter_version: int | None = None  # the drafter serving (speculating with one)
    paused: bool = False
    live: int = 0  # samples in flight (running or queued in vLLM)


class WorkerRpc:
    """``await rpc(method, **kwargs)``: our worker extension's ``method``, run between two
    engine steps; a failure there is a ControlError (the engine goes on), unless the engine
    core died with it (``on_dead`` hears why)."""

    def __init__(self, llm: Any, on_dead: Callable[[str], None]) -> None:
        self.llm = llm
        self.on_dead = on_dead

    async def __call__(self, method: str, **kwargs: Any) -> Any:
        try:
            results = await asyncio.wait_for(
                self.llm.collective_rpc(method, kwargs=kwargs), RPC_TIMEOUT_S)
        except asyncio.TimeoutError as err:
            raise ControlError(f"{method}: no answer from vLLM's worker in "
                               f"{RPC_TIMEOUT_S:.0f} s") from err
        except Exception as err:
            if self.llm.errored:
                self.on_dead(f"vLLM engine core died: {err}")
            raise ControlError(f"{method} failed in vLLM's worker: {err}") from err
        return results[0]
