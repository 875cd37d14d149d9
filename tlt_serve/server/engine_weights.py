"""Weight-related control handlers of the engine process (run between two engine steps).

Every update goes through ``Engine.update_weights``: all tensors are validated before any
parameter is touched, so a rejected update leaves the old weights serving. The two
torch.distributed controls wait on the trainer (the rendezvous, the broadcast): they return
a ``Background`` whose waiting runs on a worker thread while the engine keeps stepping; the
weights are still applied by the engine loop, between two steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file

from tlt_serve.engine.engine import Engine, UpdateResult
from tlt_serve.engine.weight_sync import TensorSpec, WeightSyncGroup
from tlt_serve.models.loader import iter_safetensors

DEFAULT_GROUP = "weight_update_group"


class ControlError(Exception):
    """A control RPC that failed cleanly (the engine keeps its previous state)."""


@dataclass(frozen=True)
class Background:
    """A control's slow part: ``work`` runs on a worker thread (it must not touch the
    engine); ``finish`` gets its result on the engine loop, between two steps, and returns
    the reply payload. An exception from either fails the control."""

    work: Callable[[], Any]
    finish: Callable[[Any], dict[str, Any]]


class WeightControls:
    def __init__(self, engine: Engine, abort_all: Callable[[], None]) -> None:
        self.engine = engine
        self.abort_all = abort_all  # aborts every request; their final outputs are sent
        self.group_name = DEFAULT_GROUP  # label of the engine's (single) weight-sync group

    def handlers(self) -> dict[str, Callable[..., dict[str, Any] | Background]]:
        return {
            "update_weights_from_disk": self.from_disk,
            "update_weights_from_file": self.from_file,
            "update_weight_version": self.set_version,
            "init_weights_update_group": self.init_group,
            "update_weights_from_distributed": self.from_group,
            "destroy_weights_update_group": self.destroy_group,
        }

    def from_disk(
        self, model_path: str, weight_version: str | None = None, abort_all: bool = False
    ) -> dict[str, Any]:
        if abort_all:
            self.abort_all()
        try:
            result = self.engine.update_weights(iter_safetensors(model_path), weight_version)
        except (OSError, SafetensorError) as err:
            raise ControlError(f"model_path: cannot read {model_path!r}: {err}") from err
        return _result(result)

    def from_file(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        # Read every tensor before touching the model: a truncated upload fails here.
        try:
            tensors = load_file(path)
        except (OSError, SafetensorError) as err:
            raise ControlError(f"body: not a valid safetensors payload: {err}") from err
        return _result(self.engine.update_weights(tensors.items(), weight_version))

    def set_version(self, new_version: str, abort_all: bool = False) -> dict[str, Any]:
        if abort_all:
            self.abort_all()
        self.engine.set_weight_version(new_version)
        return {"weight_version": new_version, "message": "weight version updated"}

    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        backend: str = "gloo", group_name: str = DEFAULT_GROUP, timeout_s: float = 120.0,
    ) -> Background:
        device = self.engine.config.model.device

        def join() -> WeightSyncGroup:  # waits until the trainer, rank 0, has joined too
            try:
                return WeightSyncGroup(master_address, master_port, rank_offset, world_size,
                                       backend, timeout_s=timeout_s, device=device)
            except (RuntimeError, ValueError) as err:  # rendezvous timeout, refused, bad args
                raise ControlError(f"init_weights_update_group failed: {err}") from err

        def joined(group: WeightSyncGroup) -> dict[str, Any]:
            self.engine.close_weight_sync()
            self.engine.weight_sync = group
            self.group_name = group_name
            return {"message": f"joined as rank {rank_offset} of {world_size}",
                    "weight_version": self.engine.weight_version}

        return Background(join, joined)

    def from_group(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP, weight_version: str | None = None,
        abort_all: bool = False,
    ) -> Background:
        sync = self.engine.weight_sync
        if sync is None:
            raise ControlError("no weight update group: call init_weights_update_group first")
        if group_name != self.group_name:
            raise ControlError(f"group_name: the group is {self.group_name!r}, not {group_name!r}")
        if abort_all:
            self.abort_all()
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]

        def receive() -> list[tuple[str, Any]]:  # waits for rank 0's broadcasts
            try:
                return sync.receive(specs)
            except (RuntimeError, ValueError) as err:
                raise ControlError(f"receiving weights failed: {err}") from err

        return Background(
            receive, lambda tensors: _result(self.engine.update_weights(tensors, weight_version))
        )

    def destroy_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        if self.engine.weight_sync is None or group_name != self.group_name:
            raise ControlError(f"group_name: no group {group_name!r}")
        self.engine.close_weight_sync()
        return {"message": f"left {group_name}", "weight_version": self.engine.weight_version}


def _result(result: UpdateResult) -> dict[str, Any]:
    if not result.ok:
        raise ControlError(result.message)
    return {"message": result.message, "weight_version": result.weight_version}
