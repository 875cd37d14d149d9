"""Controls of the vLLM engine process that are not about weights: info, stats, pause,
continue, cache flush, weight-version relabel."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tlt_serve.server.engine_weights import ControlError

if TYPE_CHECKING:
    from tlt_serve.backends.vllm.loop import VllmLoop

PAUSE_MODES = {"abort": "abort", "in_place": "keep"}  # ours → vLLM's


class BasicControls:
    def __init__(self, loop: VllmLoop) -> None:
        self.loop = loop

    def handlers(self) -> dict[str, Any]:
        return {
            "info": self.info,
            "stats": self.stats,
            "pause": self.pause,
            "continue": self.resume,
            "flush_cache": self.flush_cache,
            "update_weight_version": self.set_version,
        }

    async def info(self) -> dict[str, Any]:
        return {"info": dataclasses.replace(self.loop.info, weight_version=self.loop.version)}

    async def stats(self) -> dict[str, Any]:
        return {"stats": self.loop.stats.snapshot(self.loop)}

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        """``abort``: running requests end now with their partial output; ``in_place``: they
        stay, frozen, and go on after ``continue`` with the KV they have (as natively; new
        weights apply to the tokens after)."""
        if mode not in PAUSE_MODES:
            raise ControlError(f"mode: must be one of {tuple(PAUSE_MODES)}, got {mode!r}")
        await self.loop.llm.pause_generation(mode=PAUSE_MODES[mode], clear_cache=False)
        self.loop.paused = True
        return {"paused": True, "mode": mode}

    async def resume(self) -> dict[str, Any]:
        await self.loop.llm.resume_generation()
        self.loop.paused = False
        return {"paused": False}

    async def flush_cache(self) -> dict[str, Any]:
        busy = sum(len(s) for s in self.loop.samples.values())
        if busy or not await self.loop.llm.reset_prefix_cache():
            raise ControlError(f"cache not flushed: {busy} requests are running or waiting")
        return {}

    async def set_version(self, new_version: str, abort_all: bool = False) -> dict[str, Any]:
        if not new_version:
            raise ControlError("new_version: must be a non-empty string")
        if abort_all:
            await self.loop.abort_every_sample()
        self.loop.version = new_version
        return {"weight_version": new_version, "message": "weight version updated"}
