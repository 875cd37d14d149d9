"""What RL changes in a running native engine, between two steps: the target's weights (from
tensors, all or nothing; over a weight-sync group; relabelled; exported) and the drafter (a
checkpoint swapped in).

Every target update goes through ``load``: all tensors are validated before any parameter is
touched, so a refused update leaves the old weights serving. Joining the trainer's group and
receiving its broadcasts wait on the trainer: they may run on a worker thread while the loop
steps (they touch no weight), as long as nothing else uses the group meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

import torch
from safetensors.torch import save_file

from tlt_serve.contract.controls import (
    ControlError,
    DrafterSwapped,
    WeightsExported,
    WeightsUpdated,
    next_version,
)
from tlt_serve.engine.engine import Engine
from tlt_serve.models.loader import WeightError, checkpoint_names, load_weights, served_tensors
from tlt_serve.speculative.checkpoint import load_drafter
from tlt_serve.speculative.decoder import SpecDecoder
from tlt_serve.weight_sync import TensorSpec, WeightSyncGroup, receive_device

log = logging.getLogger("tlt_serve.native")


def spec_decoder(engine: Engine) -> SpecDecoder:
    """The engine's speculation, as the native backend builds it."""
    spec = engine.spec
    if not isinstance(spec, SpecDecoder):
        raise TypeError("the native backend builds its engine with build_spec_decoder")
    return spec


class EngineUpdates:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.spec = spec_decoder(engine)
        config = engine.config.spec
        self.drafter_path = config.drafter if self.spec.drafter is not None else None
        self.sync: WeightSyncGroup | None = None

    # ---- target weights ------------------------------------------------------------------
    def load(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: str | None = None
    ) -> WeightsUpdated:
        """Copy HF-named tensors into the target in place, all or nothing; the version becomes
        ``version`` (or the next one). Raises ControlError naming the wrong tensor."""
        engine = self.engine
        try:
            n = load_weights(engine.model, tensors)
        except WeightError as err:
            raise ControlError(str(err)) from err
        if n == 0:
            raise ControlError("no weights in the update")
        engine.weights_replaced(version if version is not None
                                else next_version(engine.weight_version))
        log.info("weights updated (%d tensors) → version %s", n, engine.weight_version)
        return WeightsUpdated(f"updated {n} tensors", engine.weight_version)

    def relabel(self, version: str) -> WeightsUpdated:
        self.engine.relabel_weights(version)
        return WeightsUpdated("weight version updated", version)

    def export(self, path: str) -> WeightsExported:
        """Write the served target weights to ``path`` (safetensors, HF names, served dtype):
        a replica joining a fleet loads them to serve exactly what its peers serve."""
        engine = self.engine
        tensors = served_tensors(engine.model, checkpoint_names(engine.model_path))
        save_file(tensors, path, metadata={"weight_version": engine.weight_version})
        return WeightsExported(len(tensors), engine.weight_version)

    # ---- the trainer's weight-sync group -------------------------------------------------
    def join_group(
        self, master_address: str, master_port: int, rank: int, world_size: int,
        backend: str, timeout_s: float = 120.0,
    ) -> WeightsUpdated:
        """Join the trainer's weight-broadcast group (blocks until every rank has joined or
        ``timeout_s``)."""
        try:
            device = receive_device(backend, self.engine.config.model.device)
            self.sync = WeightSyncGroup(master_address, master_port, rank, world_size, backend,
                                        timeout_s=timeout_s, device=device)
        except (RuntimeError, ValueError) as err:  # rendezvous timeout, refused, bad args
            raise ControlError(f"init_weights_update_group failed: {err}") from err
        return WeightsUpdated(f"joined as rank {rank} of {world_size}", self.engine.weight_version)

    def receive(self, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 broadcasts (blocks until it has); touches no weight."""
        if self.sync is None:
            raise ControlError("no weight update group: call init_weights_update_group first")
        try:
            return self.sync.receive(specs)
        except (RuntimeError, ValueError) as err:
            raise ControlError(f"receiving weights failed: {err}") from err

    def leave_group(self) -> None:
        self.sync = None

    # ---- the drafter ----------------------------------------------------------------------
    def swap_drafter(self, path: str, version: int | None = None) -> DrafterSwapped:
        """Load a drafter checkpoint and serve it from the next step. It is validated
        completely (fits the target, same feature layers) before anything changes; on failure
        the serving drafter stays and the message says why. ``version`` overrides the
        checkpoint's own."""
        try:
            new = load_drafter(path, self.engine.model)
            if version is not None:
                new.spec = replace(new.spec, version=version)
            self.spec.swap_drafter(new)
        except ValueError as err:  # DrafterError included
            return DrafterSwapped(False, str(err), self.spec.drafter_version)
        self.drafter_path = path
        log.info("drafter %s → version %d", path, new.spec.version)
        return DrafterSwapped(True, f"serving drafter version {new.spec.version}",
                              new.spec.version)
