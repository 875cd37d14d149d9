"""Receiving target weights from an RL trainer over torch.distributed (gloo on CPU, nccl on GPU).

The trainer is rank 0 of a group it creates with the engine(s); the engine joins as rank
``rank_offset`` (SGLang's convention). An update names the tensors, dtypes and shapes; the
engine allocates them, receives each by broadcast from rank 0, and only then applies them all
through the validated loader, so a failure mid-transfer changes no weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DIST_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


class WeightSyncGroup:
    """One process group with the trainer. Creating it blocks until every rank has joined."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        device: str = "cpu",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} must be in [0, world_size={world_size})")
        timeout = timedelta(seconds=timeout_s)
        # Rank 0 (the trainer) hosts the rendezvous store.
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
        )
        # A group of our own, not torch's default group: the engine may re-join after a
        # trainer restart, and the trainer keeps its default group for its own training.
        self.group = _make_group(backend, store, rank, world_size, timeout)
        self.rank, self.world_size, self.device = rank, world_size, device

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: broadcast each tensor, in the order of the specs sent to the engine."""
        for _, tensor in tensors:
            self.group.broadcast(tensor.contiguous(), 0).wait()

    def receive(
        self, specs: Sequence[TensorSpec],
        keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive each named tensor broadcast by rank 0, in order; ``keep`` (e.g. a copy to
        host memory) takes each one as soon as it has arrived, so that the receiving device
        holds one at a time instead of the whole update.

        Specs are checked before the first receive: stopping half-way would leave the
        trainer blocked in a broadcast nobody answers.
        """
        bad = next((s for s in specs if s.dtype not in DIST_DTYPES), None)
        if bad is not None:
            raise ValueError(f"dtypes: {bad.dtype!r} is not one of {sorted(DIST_DTYPES)}")
        if keep is None:
            return [(spec.name, self._receive_one(spec)) for spec in specs]
        # No name outlives one iteration: the buffer is freed before the next is allocated.
        return [(spec.name, keep(self._receive_one(spec))) for spec in specs]

    def _receive_one(self, spec: TensorSpec) -> torch.Tensor:
        tensor = torch.empty(spec.shape, dtype=DIST_DTYPES[spec.dtype], device=self.device)
        self.group.broadcast(tensor, 0).wait()
        return tensor


def receive_device(backend: str, engine_device: str) -> str:
    """Where the engine receives the broadcast tensors: NCCL moves GPU memory only (a group
    over host tensors fails there), gloo host memory."""
    if backend == "nccl":
        if not engine_device.startswith("cuda"):
            raise ValueError(f"backend: nccl moves GPU memory, and this engine runs on "
                             f"{engine_device}: use gloo")
        return engine_device
    return "cpu"


def specs_of(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    names = {v: k for k, v in DIST_DTYPES.items()}
    return [TensorSpec(n, names[t.dtype], tuple(t.shape)) for n, t in tensors]


def _make_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroup:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)  # type: ignore[return-value]
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)  # type: ignore[return-value]
    raise ValueError(f"backend: {backend!r} is not gloo or nccl")
