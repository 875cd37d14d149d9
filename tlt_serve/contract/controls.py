"""Controls: one typed message per operation the front end asks of an engine, and its reply.

A control is applied between two engine steps and answered by exactly one ``Reply`` whose
``result`` is the control's reply type (``ControlOp[R]`` names it), or ``Refused`` (the
engine said no and changed nothing: the route answers 4xx naming ``field``), or ``Crashed``
(a handler failed: the route answers 500, the engine process logged the traceback and goes
on). Every backend answers every control in ``CONTROLS``; one it cannot honour is refused
naming the backend. Plain frozen dataclasses of builtins: they pickle cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tlt_serve.contract.reports import EngineInfo, StatsSnapshot

R = TypeVar("R", covariant=True)
PAUSE_MODES = ("abort", "in_place", "drain")
DEFAULT_GROUP = "weight_update_group"  # the label of an engine's (single) weight-sync group
MAX_TAKE_BYTES = 256 << 20  # one TakeSamples reply at most (the pipe holds it whole)


class ControlError(Exception):
    """A control refused (the engine keeps its previous state); ``field`` names the request
    field at fault, when one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ControlOp(Generic[R]):
    """Base of every control; ``R`` is the type of its reply's result."""


# ---- replies ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """The control changed nothing; ``message`` says why (a 4xx)."""

    message: str
    field: str | None
    weight_version: str  # what the engine serves, unchanged


@dataclass(frozen=True)
class Crashed:
    """A handler failed unexpectedly (a 500); the traceback is in the engine's log."""

    message: str


@dataclass(frozen=True)
class Paused:
    mode: str


@dataclass(frozen=True)
class Done:
    """A control with nothing to report (continue, cache flush)."""


@dataclass(frozen=True)
class WeightsUpdated:
    """Target weights (or their label, or the weight-sync group) changed as asked."""

    message: str
    weight_version: str


@dataclass(frozen=True)
class WeightsExported:
    tensors: int
    weight_version: str


@dataclass(frozen=True)
class DrafterSwapped:
    """Whether the checkpoint serves now (``success``) and which drafter does."""

    success: bool
    message: str
    drafter_version: int | None


@dataclass(frozen=True)
class DrafterState:
    """The serving drafter, its recent acceptance and the capture buffer."""

    drafter_version: int | None
    drafter_path: str | None
    feature_layers: list[int]
    draft_vocab_size: int | None
    sliced_head: bool  # drafts come from a head restricted to the checkpoint's vocabulary
    target_weight_version: str | None  # the target weights the drafter was trained on
    weight_version: str
    recent_accept_length: float
    recent_verify_steps: int
    capture: dict[str, Any]  # CaptureStats as a dict


@dataclass(frozen=True)
class Samples:
    """Captured training samples after a cursor, as one safetensors blob."""

    data: bytes
    count: int
    last_seq: int
    newest_seq: int


@dataclass(frozen=True)
class TargetFeed:
    """What a drafter trainer borrows from the target (embedding, final norm, head, HF
    config) at ``weight_version``, as one safetensors blob."""

    data: bytes
    weight_version: str


# ---- controls -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GetInfo(ControlOp[EngineInfo]):
    pass


@dataclass(frozen=True)
class GetStats(ControlOp[StatsSnapshot]):
    pass


@dataclass(frozen=True)
class Pause(ControlOp[Paused]):
    """``abort``: running requests end now with their partial output; ``in_place``: they stay,
    frozen, and go on after ``Continue`` with the KV they have; ``drain``: nothing new is
    admitted, the running ones finish, then the engine is paused (``paused`` in its stats:
    the reply may come first)."""

    mode: str = "abort"


@dataclass(frozen=True)
class Continue(ControlOp[Done]):
    pass


@dataclass(frozen=True)
class FlushCache(ControlOp[Done]):
    """Refused while requests run or wait."""


@dataclass(frozen=True)
class UpdateWeightsFromDisk(ControlOp[WeightsUpdated]):
    model_path: str
    weight_version: str | None = None  # None: the next version
    abort_all: bool = False


@dataclass(frozen=True)
class UpdateWeightsFromFile(ControlOp[WeightsUpdated]):
    """An uploaded safetensors file (``/update_weights_from_tensor``)."""

    path: str
    weight_version: str | None = None


@dataclass(frozen=True)
class UpdateWeightVersion(ControlOp[WeightsUpdated]):
    new_version: str
    abort_all: bool = False


@dataclass(frozen=True)
class InitWeightsUpdateGroup(ControlOp[WeightsUpdated]):
    """Join the trainer's torch.distributed group (the trainer is rank 0)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    group_name: str = DEFAULT_GROUP
    timeout_s: float = 120.0


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(ControlOp[WeightsUpdated]):
    """Receive the named tensors from rank 0's broadcasts, then apply them all or none."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    weight_version: str | None = None
    abort_all: bool = False


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup(ControlOp[WeightsUpdated]):
    group_name: str = DEFAULT_GROUP


@dataclass(frozen=True)
class ExportWeights(ControlOp[WeightsExported]):
    """Write the served target weights to ``path`` (safetensors, HF names, served dtype)."""

    path: str


@dataclass(frozen=True)
class UpdateDrafterFromDisk(ControlOp[DrafterSwapped]):
    """Serve a drafter checkpoint from the next step (a bad one is ``success=False``)."""

    path: str
    version: int | None = None  # overrides the checkpoint's own


@dataclass(frozen=True)
class GetDrafterInfo(ControlOp[DrafterState]):
    pass


@dataclass(frozen=True)
class TakeSamples(ControlOp[Samples]):
    after: int = 0  # the cursor: samples with a larger sequence number
    max_bytes: int = 64 << 20
    # The asker runs on this machine: features may go by reference (engine/handoff.py) where
    # the engine can lend them; the reply says which (its blob's metadata).
    share: bool = False


@dataclass(frozen=True)
class GetDrafterTarget(ControlOp[TargetFeed]):
    pass


CONTROLS: tuple[type[ControlOp[Any]], ...] = (
    GetInfo, GetStats, Pause, Continue, FlushCache,
    UpdateWeightsFromDisk, UpdateWeightsFromFile, UpdateWeightVersion,
    InitWeightsUpdateGroup, UpdateWeightsFromDistributed, DestroyWeightsUpdateGroup,
    ExportWeights, UpdateDrafterFromDisk, GetDrafterInfo, TakeSamples, GetDrafterTarget,
)


@dataclass(frozen=True)
class Control:
    """One control on its way to the engine; answered by the ``Reply`` with its ``call_id``."""

    call_id: int
    op: ControlOp[Any]


@dataclass(frozen=True)
class Reply:
    call_id: int
    result: Any = field(default=None)  # the control's reply type, Refused or Crashed


def next_version(version: str) -> str:
    """The version a weight update without one gets: "3" → "4", "rl-3" → "rl-3+1"."""
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"
