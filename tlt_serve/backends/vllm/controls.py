"""The vLLM backend's answer to every control (``contract/controls.py``).

``HANDLERS`` is the table the loop dispatches on: control type → handler. Each runs as a task
of the loop (requests keep flowing meanwhile); those that change weights take turns on one
lock (``weights.py``, ``drafter_swap.py``). A handler returns its control's reply or raises
``ControlError`` to refuse. The handlers change ``VllmState``; the loop reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from tlt_serve.backends.vllm.drafter_swap import VllmDrafter
from tlt_serve.backends.vllm.samples import VllmCapture
from tlt_serve.backends.vllm.stat_logger import LoopStats
from tlt_serve.backends.vllm.state import VllmState
from tlt_serve.backends.vllm.weights import VllmWeights
from tlt_serve.contract.controls import (
    PAUSE_MODES,
    Continue,
    ControlError,
    ControlOp,
    DestroyWeightsUpdateGroup,
    Done,
    DrafterState,
    DrafterSwapped,
    ExportWeights,
    FlushCache,
    GetDrafterInfo,
    GetDrafterTarget,
    GetInfo,
    GetStats,
    InitWeightsUpdateGroup,
    Pause,
    Paused,
    Samples,
    TakeSamples,
    TargetFeed,
    UpdateDrafterFromDisk,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromFile,
    UpdateWeightVersion,
    WeightsExported,
    WeightsUpdated,
)
from tlt_serve.contract.reports import EngineInfo, StatsSnapshot

VLLM_PAUSE_MODES = dict(zip(PAUSE_MODES, ("abort", "keep", "wait"), strict=True))  # → vLLM's


class VllmControls:
    def __init__(
        self, llm: Any, state: VllmState, stats: LoopStats, capture: VllmCapture | None,
        weights: VllmWeights, drafter: VllmDrafter, abort_all: Callable[[], Awaitable[None]],
    ) -> None:
        self.llm = llm
        self.state = state
        self.stats_logger = stats
        self.capture = capture
        self.weights = weights
        self.drafter = drafter
        self.abort_all = abort_all

    # ---- reports ---------------------------------------------------------------------------
    async def info(self, op: GetInfo) -> EngineInfo:
        return dataclasses.replace(self.state.info, weight_version=self.state.version)

    async def stats(self, op: GetStats) -> StatsSnapshot:
        return self.stats_logger.snapshot(self.state, self.capture)

    # ---- serving ---------------------------------------------------------------------------
    async def pause(self, op: Pause) -> Paused:
        """``abort``: running requests end now with their partial output; ``in_place``: they
        stay, frozen, and go on after ``continue`` with the KV they have (as natively; new
        weights apply to the tokens after)."""
        if op.mode not in VLLM_PAUSE_MODES:
            raise ControlError(f"mode: must be one of {PAUSE_MODES}, got {op.mode!r}", "mode")
        await self.llm.pause_generation(mode=VLLM_PAUSE_MODES[op.mode], clear_cache=False)
        self.state.paused = True
        return Paused(op.mode)

    async def resume(self, op: Continue) -> Done:
        await self.llm.resume_generation()
        self.state.paused = False
        return Done()

    async def flush_cache(self, op: FlushCache) -> Done:
        """vLLM refuses while a running request holds cached blocks; waiting ones hold none."""
        if not await self.llm.reset_prefix_cache():
            raise ControlError(f"cache not flushed: requests are running "
                               f"({self.state.live} in flight)")
        return Done()

    # ---- target weights --------------------------------------------------------------------
    async def from_disk(self, op: UpdateWeightsFromDisk) -> WeightsUpdated:
        return await self.weights.from_disk(op)

    async def from_file(self, op: UpdateWeightsFromFile) -> WeightsUpdated:
        return await self.weights.from_file(op)

    async def set_version(self, op: UpdateWeightVersion) -> WeightsUpdated:
        if not op.new_version:
            raise ControlError("new_version: must be a non-empty string", "new_version")
        if op.abort_all:
            await self.abort_all()
        self.state.version = op.new_version
        return WeightsUpdated("weight version updated", op.new_version)

    async def init_group(self, op: InitWeightsUpdateGroup) -> WeightsUpdated:
        return await self.weights.init_group(op)

    async def from_group(self, op: UpdateWeightsFromDistributed) -> WeightsUpdated:
        return await self.weights.from_group(op)

    async def destroy_group(self, op: DestroyWeightsUpdateGroup) -> WeightsUpdated:
        return await self.weights.destroy_group(op)

    async def export(self, op: ExportWeights) -> WeightsExported:
        raise ControlError("backend: the vllm backend does not export its weights; update a "
                           "joining replica from disk instead", "backend")

    # ---- the drafter and its trainer -------------------------------------------------------
    async def swap_drafter(self, op: UpdateDrafterFromDisk) -> DrafterSwapped:
        return await self.drafter.swap(op)

    async def drafter_info(self, op: GetDrafterInfo) -> DrafterState:
        return self.drafter.info()

    async def take_samples(self, op: TakeSamples) -> Samples:
        return await self.drafter.take_samples(op)

    async def drafter_target(self, op: GetDrafterTarget) -> TargetFeed:
        return await self.drafter.target_feed()


HANDLERS: dict[type[ControlOp[Any]], Callable[[VllmControls, Any], Awaitable[Any]]] = {
    GetInfo: VllmControls.info,
    GetStats: VllmControls.stats,
    Pause: VllmControls.pause,
    Continue: VllmControls.resume,
    FlushCache: VllmControls.flush_cache,
    UpdateWeightsFromDisk: VllmControls.from_disk,
    UpdateWeightsFromFile: VllmControls.from_file,
    UpdateWeightVersion: VllmControls.set_version,
    InitWeightsUpdateGroup: VllmControls.init_group,
    UpdateWeightsFromDistributed: VllmControls.from_group,
    DestroyWeightsUpdateGroup: VllmControls.destroy_group,
    ExportWeights: VllmControls.export,
    UpdateDrafterFromDisk: VllmControls.swap_drafter,
    GetDrafterInfo: VllmControls.drafter_info,
    TakeSamples: VllmControls.take_samples,
    GetDrafterTarget: VllmControls.drafter_target,
}
