"""Drafter controls on the vLLM backend: hot-swap, info, the trainer's target feed.

A drafter can be swapped only into a server that started with one (vLLM builds its EAGLE
proposer at start). The new checkpoint is validated as natively (it must fit the target),
exported to vLLM's EAGLE-1 form, checked against the tensors vLLM loaded at start (names and
shapes), and reloaded in place by the worker between two engine steps; requests in flight go
on (drafts are proposals: their outputs do not change), and the version is bumped.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt_serve.backends.vllm.engine import VllmSpec
from tlt_serve.backends.vllm.weights import header
from tlt_serve.capture import CaptureBuffer, encode_samples
from tlt_serve.config import CaptureConfig
from tlt_serve.models.arch import ArchConfig
from tlt_serve.server.engine_drafter import MAX_TAKE_BYTES
from tlt_serve.server.engine_weights import ControlError
from tlt_serve.speculative.checkpoint import DrafterError, check_compatible, read_drafter_config
from tlt_serve.speculative.export import export_vllm_eagle

if TYPE_CHECKING:
    from tlt_serve.backends.vllm.loop import VllmLoop


class VllmDrafter:
    def __init__(self, loop: VllmLoop, spec: VllmSpec, scratch: Path,
                 source: str | None = None) -> None:
        self.loop = loop
        self.scratch = scratch
        model_dir = Path(loop.info.model_path)
        self.target = ArchConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
        self.loaded: dict[str, tuple[str, tuple[int, ...]]] = {}  # what vLLM loaded at start
        if spec.drafter_dir is not None:
            self.loaded = header(Path(spec.drafter_dir) / "model.safetensors")
        self.target_weight_version: str | None = None
        self.path = source if spec.drafter_dir is not None else None  # the served checkpoint

    def handlers(self) -> dict[str, Any]:
        return {
            "update_drafter_from_disk": self.from_disk,
            "drafter_info": self.info,
            "drafter_target": self.target_feed,
            "capture_take": self.capture_take,
        }

    async def from_disk(self, path: str, version: int | None = None) -> dict[str, Any]:
        """Never raises for a bad checkpoint: the reply says whether it was applied and which
        drafter serves now (the route answers 400 when not)."""
        loop = self.loop
        try:
            if not self.loaded:
                raise DrafterError("the vllm backend swaps drafters only in a server started "
                                   "with one (--speculative drafter --drafter PATH)")
            _, arch, spec = read_drafter_config(path)
            check_compatible(arch, spec, self.target)
            out = Path(tempfile.mkdtemp(prefix="swap-", dir=self.scratch)) / "drafter"
            try:
                export_vllm_eagle(path, out, keep_extras=True)
                self._check_tensors(header(out / "model.safetensors"))
                async with loop.weights_lock:
                    await loop.rpc("tlt_load_drafter", files=[str(out / "model.safetensors")])
            finally:
                import shutil

                shutil.rmtree(out.parent, ignore_errors=True)
        except (DrafterError, ControlError) as err:
            return {"success": False, "message": str(err),
                    "drafter_version": loop.drafter_version}
        loop.drafter_version = version if version is not None else spec.version
        self.path = path
        self.target_weight_version = spec.target_weight_version
        return {"success": True, "message": f"serving drafter version {loop.drafter_version}",
                "drafter_version": loop.drafter_version}

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

    async def info(self) -> dict[str, Any]:
        loop, stats = self.loop, self.loop.stats
        return {
            "drafter_version": loop.drafter_version,
            "drafter_path": self.path,
            "feature_layers": [],
            "draft_vocab_size": None if loop.drafter_version is None else 0,
            "sliced_head": False,  # vLLM's EAGLE drafts over the whole vocabulary
            "target_weight_version": self.target_weight_version,
            "weight_version": loop.version,
            "recent_accept_length": round(stats.engine.recent_accept_length, 4),
            "recent_verify_steps": len(stats.engine.recent_spec),
            "capture": dataclasses.asdict(self.buffer().stats()),
        }

    def buffer(self) -> CaptureBuffer:
        capture = self.loop.capture
        return capture.buffer if capture is not None else CaptureBuffer(CaptureConfig())

    async def target_feed(self) -> dict[str, Any]:
        """The target's embedding, final norm and head (and config), as the native engine
        sends them to the trainer, written by the worker from the weights it serves."""
        path = self.scratch / "target.safetensors"
        config = (Path(self.loop.info.model_path) / "config.json").read_text()
        try:
            await self.loop.rpc("tlt_save_target", path=str(path),
                                meta={"config": config, "weight_version": self.loop.version})
            return {"data": path.read_bytes(), "weight_version": self.loop.version}
        finally:
            path.unlink(missing_ok=True)

    async def capture_take(self, after: int = 0, max_bytes: int = 64 << 20) -> dict[str, Any]:
        capture = self.loop.capture
        if capture is None:
            raise ControlError("capture is off (start the server with --capture)")
        if after < 0 or max_bytes < 1:
            raise ControlError("after: must be >= 0 and max_bytes >= 1")
        await capture.fetch()  # what finished by now
        samples = capture.buffer.take(after, min(max_bytes, MAX_TAKE_BYTES))
        return {
            "data": encode_samples(samples),
            "count": len(samples),
            "last_seq": samples[-1].seq if samples else after,
            "newest_seq": capture.buffer.last_seq,
        }
