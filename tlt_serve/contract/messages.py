"""The messages on the pipe between the HTTP front end and an engine process.

Front end → engine: lists of ``AddRequest | Abort | AbortAll | Control | Shutdown`` (the
sender thread packs whatever is queued into one pickle). Engine → front end: ``Ready`` or
``Failed`` once at start, then ``StepBatch`` (one per engine step and per drained message
batch that produced acknowledgements), ``Reply`` for each ``Control`` (``controls.py``),
``Fatal`` if the loop crashes. Everything here must pickle cheaply: plain frozen dataclasses
of builtins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tlt_serve.contract.controls import Control, Reply
from tlt_serve.contract.reports import EngineInfo, StatsSnapshot
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.sampling_params import SamplingParams

# ---- front end → engine -----------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    rid: str  # a front-end rid: aborts all of its samples


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class Shutdown:
    """Abort everything (final outputs are still sent), then exit the engine process."""


ToEngine = AddRequest | Abort | AbortAll | Control | Shutdown

# ---- engine → front end -----------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    """The engine could not start (bad model path, out of memory...)."""

    message: str


@dataclass(frozen=True)
class Rejected:
    """``engine.add_request`` refused a request: ``kind`` is "param" or "overflow"."""

    rid: str
    kind: str
    param: str | None
    message: str


@dataclass(frozen=True)
class StepBatch:
    """Everything one engine iteration produced, sent as a single message."""

    outputs: list[StepOutput]
    accepted: list[str] = field(default_factory=list)  # front-end rids now queued
    rejected: list[Rejected] = field(default_factory=list)
    stats: StatsSnapshot | None = None


@dataclass(frozen=True)
class Fatal:
    """The engine loop crashed; the process exits right after sending this."""

    message: str


FromEngine = Ready | Failed | StepBatch | Reply | Fatal
