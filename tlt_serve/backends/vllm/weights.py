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
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from tlt_serve.backends.vllm.state import VllmState, WorkerRpc
from tlt_serve.contract.controls import (
    DEFAULT_GROUP,
    ControlError,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromFile,
    WeightsUpdated,
    next_version,
)
from tlt_serve.weight_sync import TensorSpec, WeightSyncGroup, receive_device

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


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu()


class VllmWeights:
    def __init__(self, state: VllmState, rpc: WorkerRpc, lock: asyncio.Lock,
                 abort_all: Callable[[], Awaitable[None]], scratch: Path,
                 device: str = "cpu") -> None:
        self.state = state
        self.device = device  # where vLLM runs: "cuda" or "cpu" (its CPU build)
        self.rpc = rpc
        self.lock = lock  # one weight / drafter change at a time
        self.abort_all = abort_all
        self.scratch = scratch  # files exchanged with vLLM's worker
        model_dir = Path(state.info.model_path)
        self.served: dict[str, tuple[str, tuple[int, ...]]] = {}
        for f in safetensors_files(model_dir):
            self.served.update(header(f))
        config = json.loads((model_dir / "config.json").read_text())
        self.tied_head = bool(config.get("tie_word_embeddings", False))
        self.sync: WeightSyncGroup | None = None
        self.group_name = DEFAULT_GROUP
        self.syncing = False  # a rendezvous or a transfer is in progress

    async def from_disk(self, op: UpdateWeightsFromDisk) -> WeightsUpdated:
        try:
            files = safetensors_files(Path(op.model_path))
            update = {k: v for f in files for k, v in header(f).items()}
        except (OSError, ValueError, KeyError, struct.error) as err:
            raise ControlError(f"model_path: cannot read {op.model_path!r}: {err}",
                               "model_path") from err
        return await self._apply(files, update, op.weight_version, op.abort_all)

    async def from_file(self, op: UpdateWeightsFromFile) -> WeightsUpdated:
        try:
            update = header(Path(op.path))
        except (OSError, ValueError, KeyError, struct.error) as err:
            raise ControlError(f"body: not a valid safetensors payload: {err}", "body") from err
        return await self._apply([Path(op.path)], update, op.weight_version, False)

    async def _apply(
        self, files: list[Path], update: dict[str, tuple[str, tuple[int, ...]]],
        weight_version: str | None, abort_all: bool,
    ) -> WeightsUpdated:
        check_update(update, self.served, self.tied_head)
        if abort_all:
            await self.abort_all()
        state = self.state
        async with self.lock:
            await self.rpc("tlt_load_target", files=[str(f) for f in files])
            state.version = (weight_version if weight_version is not None
                             else next_version(state.version))
        return WeightsUpdated(f"updated {len(update)} tensors", state.version)

    async def init_group(self, op: InitWeightsUpdateGroup) -> WeightsUpdated:
        if self.syncing:
            raise ControlError("busy: a weight-sync call is still in progress")
        self.syncing = True
        try:
            device = receive_device(op.backend, self.device)
            self.sync = await asyncio.to_thread(
                WeightSyncGroup, op.master_address, op.master_port, op.rank_offset,
                op.world_size, op.backend, op.timeout_s, device)
        except (RuntimeError, ValueError) as err:
            raise ControlError(f"init_weights_update_group failed: {err}") from err
        finally:
            self.syncing = False
        self.group_name = op.group_name
        return WeightsUpdated(f"joined {op.group_name}", self.state.version)

    async def from_group(self, op: UpdateWeightsFromDistributed) -> WeightsUpdated:
        if self.sync is None:
            raise ControlError("no weight update group: call init_weights_update_group first")
        if op.group_name != self.group_name:
            raise ControlError(f"group_name: the group is {self.group_name!r}, not "
                               f"{op.group_name!r}", "group_name")
        if self.syncing:
            raise ControlError("busy: a weight-sync call is still in progress")
        specs = [TensorSpec(n, d, tuple(s))
                 for n, d, s in zip(op.names, op.dtypes, op.shapes, strict=True)]
        self.syncing = True
        try:  # rank 0 broadcasts whatever we think of the specs: receive, then judge
            # Each tensor to host memory as it arrives (they go to a file for vLLM's worker):
            # over NCCL the GPU then holds one received tensor beside vLLM, not the update.
            received = await asyncio.to_thread(self.sync.receive, specs, _to_host)
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
            return await self._apply([path], update, op.weight_version, op.abort_all)
        finally:
            path.unlink(missing_ok=True)

    async def destroy_group(self, op: DestroyWeightsUpdateGroup) -> WeightsUpdated:
        if self.sync is None or op.group_name != self.group_name:
            raise ControlError(f"group_name: no group {op.group_name!r}", "group_name")
        self.sync = None
        return WeightsUpdated(f"left {op.group_name}", self.state.version)
