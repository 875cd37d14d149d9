"""Capture on the vLLM backend: the drafter's training samples from what vLLM served.

vLLM hands its EAGLE drafter the target's final hidden state of every position it commits;
our worker extension keeps those per request (``worker.py``, no extra compute). Here, each
finished sample's positions are fetched from the worker in batches (every ``FETCH_S``,
between two engine steps) and become ``TrainingSample``s in the same bounded
``CaptureBuffer`` the native engine fills, served to the trainer by the same feed.

A sample starts at the first position vLLM computed: prompt blocks found in the prefix
cache were not computed (the last prompt position always is, so every response pair is
there), so ``prompt_len`` counts the prompt positions kept. As natively: one seeded draw per
sample (``sample_rate``); aborted samples, samples whose target changed while they ran, and
samples whose kept tokens do not match what was served are dropped. Rows kept past what was
served (a step scheduled before the request finished) are cut.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tlt_serve.backends.vllm.state import VllmState, WorkerRpc
from tlt_serve.config import CaptureConfig
from tlt_serve.engine.capture import CaptureBuffer

log = logging.getLogger("tlt_serve.vllm")
FETCH_S = 0.5


@dataclass
class _Live:
    internal_id: str  # vLLM's id of the request (the worker's key)
    prompt: list[int]
    versions: set[str]
    output: list[int] = field(default_factory=list)


class VllmCapture:
    def __init__(self, state: VllmState, rpc: WorkerRpc, scratch: Path, config: CaptureConfig,
                 seed: int) -> None:
        self.state = state
        self.rpc = rpc
        self.scratch = scratch  # files exchanged with vLLM's worker
        self.buffer = CaptureBuffer(config, seed=seed)
        self.live: dict[str, _Live] = {}  # drawn samples in flight, by our sample rid
        self.done: list[tuple[str, _Live, int | None]] = []  # finished, to fetch
        self.dropped: list[str] = []  # internal ids the worker may forget
        # One fetch at a time (the periodic one and a trainer's pull): they share the file
        # the worker writes, and a pull must find what an ongoing fetch takes in the buffer.
        self.fetching = asyncio.Lock()

    async def start(self) -> None:
        if not await self.rpc("tlt_capture_start"):
            raise RuntimeError("capture needs vLLM's EAGLE drafter (--speculative drafter)")
        asyncio.create_task(self._fetch_forever())

    def on_add(self, rid: str, internal_id: str, prompt: list[int]) -> None:
        if self.buffer.draw():
            self.live[rid] = _Live(internal_id, list(prompt), {self.state.version})
        else:
            self.buffer.skip()
            self.dropped.append(internal_id)

    def on_output(self, rid: str, tokens: list[int], finish: Any) -> None:
        live = self.live.get(rid)
        if live is None:
            return
        live.output.extend(tokens)
        live.versions.add(self.state.version)
        if finish is None:
            return
        del self.live[rid]
        if finish.type == "abort":
            self.buffer.skip()
            self.dropped.append(live.internal_id)
        else:
            self.done.append((rid, live, self.state.drafter_version))

    async def _fetch_forever(self) -> None:
        while True:
            await asyncio.sleep(FETCH_S)
            try:
                await self.fetch()
            except Exception:  # a failed fetch loses those samples, never the engine
                log.exception("capture fetch failed")

    async def fetch(self) -> None:
        async with self.fetching:
            await self._fetch()

    async def _fetch(self) -> None:
        done, self.done = self.done, []
        dropped, self.dropped = self.dropped, []
        if dropped:
            await self.rpc("tlt_capture_drop", rids=dropped)
        if not done:
            return
        path = self.scratch / "capture.safetensors"
        try:
            written = await self.rpc("tlt_capture_take", path=str(path),
                                          rids=[live.internal_id for _, live, _ in done])
            from safetensors.torch import load_file

            tensors = load_file(str(path)) if written else {}
        finally:
            path.unlink(missing_ok=True)
        found = {internal: i for i, internal in enumerate(written)}
        for _, live, drafter_version in done:
            i = found.get(live.internal_id)
            if i is None or len(live.versions) > 1:
                self.buffer.skip()
                continue
            self._keep(live, int(tensors[f"{i}.start"].item()), tensors[f"{i}.tokens"],
                       tensors[f"{i}.features"], drafter_version)

    def _keep(self, live: _Live, start: int, tokens: torch.Tensor, features: torch.Tensor,
              drafter_version: int | None) -> None:
        # Positions start.. fed the prompt's rest and every output token but the last.
        served = (live.prompt + live.output[:-1])[start:]
        # With async scheduling (vLLM's default on CUDA) a step scheduled before the request
        # finished still runs it, so rows past the served ones may follow; they are cut.
        n = len(served)
        if start >= len(live.prompt) or tokens[:n].tolist() != served:
            self.buffer.skip()
            return
        version = next(iter(live.versions))
        self.buffer.add(tokens[:n].long(), features[:n], len(live.prompt) - start, version,
                        drafter_version)
