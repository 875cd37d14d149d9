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
from tlt_serve.engine.weight_sync import TensorSpec
from tlt_serve.models.loader import iter_safetensors

DEFAULT_GROUP = "weight_update_group"


class ControlError(Exception):
    """A control RPC that failed cleanly (the engine keeps its previous state)."""


@dataclass(frozen=True)
class Background:
    """A control's slow part: ``work`` runs on a worker thread (it may touch only what
    the engine loop leaves alone meanwhile); ``finish`` gets its result on the engine loop,
    between two steps, and returns the reply payload. An exception from either fails the
    control."""

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
            "export_weights": self.export,
        }

    def export(self, path: str) -> dict[str, Any]:
        n = self.engine.export_weights(path)
        return {"weight_version": self.engine.weight_version, "message": f"{n} tensors"}

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
        # The rendezvous waits on the trainer (rank 0) on a worker thread; the engine loop
        # refuses other weight-sync controls meanwhile, so only this thread uses the group.
        def join() -> UpdateResult:
            return self.engine.init_weight_sync(
                master_address, master_port, rank_offset, world_size, backend, timeout_s
            )

        def joined(result: UpdateResult) -> dict[str, Any]:
            if result.ok:
                self.group_name = group_name
            return _result(result)

        return Background(join, joined)

    def from_group(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP, weight_version: str | None = None,
        abort_all: bool = False,
    ) -> Background:
        if self.engine.weight_sync is not None and group_name != self.group_name:
            raise ControlError(f"group_name: the group is {self.group_name!r}, not {group_name!r}")
        if abort_all:
            self.abort_all()
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]

        def apply(received: list[tuple[str, Any]] | UpdateResult) -> dict[str, Any]:
            if isinstance(received, UpdateResult):  # no group, or the transfer failed
                return _result(received)
            return _result(self.engine.update_weights(received, weight_version))

        # Waiting for rank 0's broadcasts happens on a worker thread; applying, on the loop.
        return Background(lambda: self.engine.receive_weights(specs), apply)

    def destroy_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        if self.engine.weight_sync is None or group_name != self.group_name:
            raise ControlError(f"group_name: no group {group_name!r}")
        self.engine.close_weight_sync()
        return {"message": f"left {group_name}", "weight_version": self.engine.weight_version}


def _result(result: UpdateResult) -> dict[str, Any]:
    if not result.ok:
        raise ControlError(result.message)
    return {"message": result.message, "weight_version": result.weight_version}
