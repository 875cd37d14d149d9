"""The drafter on the vLLM backend: hot-swap, info, the trainer's feed (samples, target).

A drafter can be swapped only into a server that started with one (vLLM builds its EAGLE
proposer at start). The new checkpoint is validated as natively (it must fit the target),
exported to vLLM's EAGLE-1 form, checked against the tensors vLLM loaded at start (names and
shapes), and reloaded in place by the worker between two engine steps; requests in flight go
on (drafts are proposals: their outputs do not change), and the version is bumped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from tlt_serve.backends.vllm.args import VllmSpec
from tlt_serve.backends.vllm.samples import VllmCapture
from tlt_serve.backends.vllm.stat_logger import LoopStats
from tlt_serve.backends.vllm.state import VllmState, WorkerRpc
from tlt_serve.backends.vllm.weights import header
from tlt_serve.config import CaptureConfig
from tlt_serve.contract.controls import (
    MAX_TAKE_BYTES,
    ControlError,
    DrafterState,
    DrafterSwapped,
    Samples,
    TakeSamples,
    TargetFeed,
    UpdateDrafterFromDisk,
)
from tlt_serve.engine.capture import CaptureBuffer, encode_samples
from tlt_serve.models.arch import ArchConfig
from tlt_serve.speculative.checkpoint import DrafterError, check_compatible, read_drafter_config
from tlt_serve.speculative.export import export_vllm_eagle


class VllmDrafter:
    def __init__(self, state: VllmState, rpc: WorkerRpc, lock: asyncio.Lock, spec: VllmSpec,
                 scratch: Path, capture: VllmCapture | None, stats: LoopStats,
                 source: str | None = None) -> None:
        self.state = state
        self.rpc = rpc
        self.lock = lock  # one weight / drafter change at a time
        self.scratch = scratch  # files exchanged with vLLM's worker
        self.capture = capture
        self.stats = stats
        model_dir = Path(state.info.model_path)
        self.target = ArchConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
        self.loaded: dict[str, tuple[str, tuple[int, ...]]] = {}  # what vLLM loaded at start
        if spec.drafter_dir is not None:
            self.loaded = header(Path(spec.drafter_dir) / "model.safetensors")
        self.target_weight_version: str | None = None
        self.path = source if spec.drafter_dir is not None else None  # the served checkpoint

    async def swap(self, op: UpdateDrafterFromDisk) -> DrafterSwapped:
        """Never raises for a bad checkpoint: the reply says whether it was applied and which
        drafter serves now (the route answers 400 when not)."""
        state = self.state
        try:
            if not self.loaded:
                raise DrafterError("the vllm backend swaps drafters only in a server started "
                                   "with one (--speculative drafter --drafter PATH)")
            _, arch, spec = read_drafter_config(op.path)
            check_compatible(arch, spec, self.target)
            out = Path(tempfile.mkdtemp(prefix="swap-", dir=self.scratch)) / "drafter"
            try:
                export_vllm_eagle(op.path, out, keep_extras=True)
                self._check_tensors(header(out / "model.safetensors"))
                async with self.lock:
                    await self.rpc("tlt_load_drafter", files=[str(out / "model.safetensors")])
            finally:
                shutil.rmtree(out.parent, ignore_errors=True)
        except (DrafterError, ControlError) as err:
            return DrafterSwapped(False, str(err), state.drafter_version)
        state.drafter_version = op.version if op.version is not None else spec.version
        self.path = op.path
        self.target_weight_version = spec.target_weight_version
        return DrafterSwapped(True, f"serving drafter version {state.drafter_version}",
                              state.drafter_version)

    def _check_tensors(self, new: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        if new.keys() != self.loaded.keys():
            extra = sorted(new.keys() - self.loaded.keys())
            lost = sorted(self.loaded.keys() - new.keys())
            raise DrafterError(f"drafter tensors differ from the serving drafter's: "
                               f"unknown {extra[:3]}, missing {lost[:3]}")
        for name, (_, shape) in new.items():
            if shape != self.loaded[name][1]:
                raise DrafterError(f"drafter: {name} has shape {list(shape)}, the serving "
                                   f"drafter's is {list(self.loaded[name][1])}")

    def info(self) -> DrafterState:
        state, recent = self.state, self.stats.engine
        buffer = self.capture.buffer if self.capture is not None else None
        return DrafterState(
            drafter_version=state.drafter_version,
            drafter_path=self.path,
            feature_layers=[],
            draft_vocab_size=None if state.drafter_version is None else 0,
            sliced_head=False,  # vLLM's EAGLE drafts over the whole vocabulary
            target_weight_version=self.target_weight_version,
            weight_version=state.version,
            recent_accept_length=round(recent.recent_accept_length, 4),
            recent_verify_steps=len(recent.recent_spec),
            capture=dataclasses.asdict(
                (buffer or CaptureBuffer(CaptureConfig())).stats()),
        )

    async def target_feed(self) -> TargetFeed:
        """The target's embedding, final norm and head (and config), as the native engine
        sends them to the trainer, written by the worker from the weights it serves."""
        state = self.state
        path = self.scratch / "target.safetensors"
        config = (Path(state.info.model_path) / "config.json").read_text()
        try:
            await self.rpc("tlt_save_target", path=str(path),
                           meta={"config": config, "weight_version": state.version})
            return TargetFeed(path.read_bytes(), state.version)
        finally:
            path.unlink(missing_ok=True)

    async def take_samples(self, op: TakeSamples) -> Samples:
        capture = self.capture
        if capture is None:
            raise ControlError("capture is off (start the server with --capture)")
        if op.after < 0 or op.max_bytes < 1:
            raise ControlError("after: must be >= 0 and max_bytes >= 1", "after")
        await capture.fetch()  # what finished by now
        samples = capture.buffer.take(op.after, min(op.max_bytes, MAX_TAKE_BYTES))
        return Samples(encode_samples(samples), len(samples),
                       samples[-1].seq if samples else op.after, capture.buffer.last_seq)
