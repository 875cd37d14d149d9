"""Target weight updates on the vLLM backend: from disk, from an uploaded file, and over
torch.distributed, all or nothing, validated before anything changes, version bumped.

vLLM's CPU worker repacks every linear weight into oneDNN's layout after loading and empties
the parameter, so weights cannot be copied into parameters as natively: the worker reloads
them in place through vLLM's layer-wise reload (``worker.py``), reading safetensors files the
engine process names. Every update is therefore a file: a directory's safetensors files as
they are, an upload as assembled, broadcast tensors written to one file here first.

Validated first, against the served checkpoint's tensor names and shapes (from its
safetensors headers): unknown names, wrong shapes, non-float dtypes are refused naming the
tensor; an update may be partial, but whole per vLLM module (q / k / v and gate / up are one
module each: vLLM would re-process a module from a part of its weights).
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt_serve.engine.engine import next_version
from tlt_serve.engine.weight_sync import TensorSpec, WeightSyncGroup
from tlt_serve.server.engine_weights import DEFAULT_GROUP, ControlError

if TYPE_CHECKING:
    from tlt_serve.backends.vllm.loop import VllmLoop

FLOAT_DTYPES = {"F32", "BF16", "F16"}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# HF projections vLLM fuses into one module: an update names all of a group or none
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (safetensors dtype, shape) of one safetensors file, from its header only."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(size))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in meta.items() if k != "__metadata__"}


def safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ControlError(f"model_path: no .safetensors files in {str(path)!r}")
    return files


def check_update(
    update: dict[str, tuple[str, tuple[int, ...]]],
    served: dict[str, tuple[str, tuple[int, ...]]],
    tied_head: bool,
) -> None:
    """Raise ControlError naming the first tensor that does not fit the served model."""
    if not update:
        raise ControlError("no weights in the update")
    for name, (dtype, shape) in update.items():
        if name == "lm_head.weight" and tied_head:
            want = served.get("model.embed_tokens.weight")
        else:
            want = served.get(name)
        if want is None:
            raise ControlError(f"{name}: not a tensor of the served model")
        if dtype not in FLOAT_DTYPES:
            raise ControlError(f"{name}: dtype {dtype} is not a float type")
        if tuple(shape) != want[1]:
            raise ControlError(f"{name}: shape {list(shape)} != served {list(want[1])}")
    for group in FUSED:
        for name in update:
            parts = name.split(".")
            if len(parts) > 1 and parts[-2] in group:
                siblings = [".".join([*parts[:-2], p, parts[-1]]) for p in group]
                missing = [s for s in siblings if s not in update]
                if missing:
                    raise ControlError(f"{missing[0]}: the vllm backend updates {name} only "
                                       f"together with {', '.join(missing)} (one module)")


class VllmWeights:
    def __init__(self, loop: VllmLoop, model_dir: Path, scratch: Path) -> None:
        self.loop = loop
        self.scratch = scratch
        self.served: dict[str, tuple[str, tuple[int, ...]]] = {}
        for f in safetensors_files(model_dir):
            self.served.update(header(f))
        config = json.loads((model_dir / "config.json").read_text())
        self.tied_head = bool(config.get("tie_word_embeddings", False))
        self.sync: WeightSyncGroup | None = None
        self.group_name = DEFAULT_GROUP
        self.syncing = False  # a rendezvous or a transfer is in progress

    def handlers(self) -> dict[str, Any]:
        return {
            "update_weights_from_disk": self.from_disk,
            "update_weights_from_file": self.from_file,
            "init_weights_update_group": self.init_group,
            "update_weights_from_distributed": self.from_group,
            "destroy_weights_update_group": self.destroy_group,
            "export_weights": self.export,
        }

    async def export(self, path: str) -> dict[str, Any]:
        raise ControlError("export_weights: the vllm backend does not export its weights; "
                           "update a joining replica from disk instead")

    async def from_disk(
        self, model_path: str, weight_version: str | None = None, abort_all: bool = False
    ) -> dict[str, Any]:
        try:
            files = safetensors_files(Path(model_path))
            update = {k: v for f in files for k, v in header(f).items()}
        except (OSError, ValueError, KeyError, struct.error) as err:
            raise ControlError(f"model_path: cannot read {model_path!r}: {err}") from err
        return await self._apply(files, update, weight_version, abort_all)

    async def from_file(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        try:
            update = header(Path(path))
        except (OSError, ValueError, KeyError, struct.error) as err:
            raise ControlError(f"body: not a valid safetensors payload: {err}") from err
        return await self._apply([Path(path)], update, weight_version, False)

    async def _apply(
        self, files: list[Path], update: dict[str, tuple[str, tuple[int, ...]]],
        weight_version: str | None, abort_all: bool,
    ) -> dict[str, Any]:
        check_update(update, self.served, self.tied_head)
        if abort_all:
            await self.loop.abort_every_sample()
        async with self.loop.weights_lock:
            await self.loop.rpc("tlt_load_target", files=[str(f) for f in files])
            self.loop.version = (weight_version if weight_version is not None
                                 else next_version(self.loop.version))
        return {"message": f"updated {len(update)} tensors", "weight_version": self.loop.version}

    async def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        backend: str = "gloo", group_name: str = DEFAULT_GROUP, timeout_s: float = 120.0,
    ) -> dict[str, Any]:
        if self.syncing:
            raise ControlError("busy: a weight-sync call is still in progress")
        self.syncing = True
        try:
            self.sync = await asyncio.to_thread(
                WeightSyncGroup, master_address, master_port, rank_offset, world_size,
                backend, timeout_s)
        except (RuntimeError, ValueError) as err:
            raise ControlError(f"init_weights_update_group failed: {err}") from err
        finally:
            self.syncing = False
        self.group_name = group_name
        return {"message": f"joined {group_name}", "weight_version": self.loop.version}

    async def from_group(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP, weight_version: str | None = None,
        abort_all: bool = False,
    ) -> dict[str, Any]:
        if self.sync is None:
            raise ControlError("no weight update group: call init_weights_update_group first")
        if group_name != self.group_name:
            raise ControlError(f"group_name: the group is {self.group_name!r}, not {group_name!r}")
        if self.syncing:
            raise ControlError("busy: a weight-sync call is still in progress")
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        self.syncing = True
        try:  # rank 0 broadcasts whatever we think of the specs: receive, then judge
            received = await asyncio.to_thread(self.sync.receive, specs)
        except (RuntimeError, ValueError) as err:
            raise ControlError(f"receiving weights failed: {err}") from err
        finally:
            self.syncing = False
        update = {s.name: (SAFETENSORS_DTYPES.get(s.dtype, s.dtype), s.shape) for s in specs}
        check_update(update, self.served, self.tied_head)
        path = self.scratch / "distributed.safetensors"
        from safetensors.torch import save_file

        await asyncio.to_thread(save_file, {n: t.contiguous() for n, t in received}, str(path))
        try:
            return await self._apply([path], update, weight_version, abort_all)
        finally:
            path.unlink(missing_ok=True)

    async def destroy_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        if self.sync is None or group_name != self.group_name:
            raise ControlError(f"group_name: no group {group_name!r}")
        self.sync = None
        return {"message": f"left {group_name}", "weight_version": self.loop.version}

