"""What the loop asks of speculative decoding, and the loop without it.

``Engine.step`` asks its ``Speculation`` for a plan per decode batch (None: a plain step) and
has it verify the plan in one target forward; it hands it the features of every committed
position, the finished requests and the step's time. ``tlt_serve/speculative`` implements it
(``SpecDecoder``: proposers, verifiers, the adaptive policy); whoever builds an ``Engine``
passes its builder (``tlt_serve.llm.LLM``, the native backend). ``plain_decoding`` is the loop
with nothing to propose, for an engine built without the speculative package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from tlt_serve.config import ConfigError, SpecConfig
from tlt_serve.engine.features import Committed
from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.request import Request
from tlt_serve.engine.runner import ModelRunner, RunOutput
from tlt_serve.engine.scheduler import Emitted, ScheduledBatch
from tlt_serve.models.llama import LlamaModel


class Speculation(Protocol):
    """Per-step speculation, called by the engine loop only (between or inside steps)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the runner returns (a drafter's features)."""

    @property
    def needs_features(self) -> bool: ...

    @property
    def drafter_version(self) -> int | None: ...

    def plan(self, batch: ScheduledBatch) -> Any:
        """Drafts for a decode batch (opaque to the loop), or None for a plain step."""

    def verify(
        self, plan: Any, reqs: list[Request], runner: ModelRunner, shared: torch.Generator
    ) -> tuple[RunOutput, Emitted]:
        """One target forward over every request's [last token + drafts]; what each commits."""

    def observe(self, committed: Committed) -> None: ...

    def end_step(
        self, batch: ScheduledBatch, outputs: Sequence[StepOutput], seconds: float
    ) -> None: ...

    def release(self, reqs: Sequence[Request]) -> None: ...

    def move_row(self, src: int, dst: int, length: int) -> None: ...

    def weights_changed(self) -> None: ...


# (spec config, target, KV rows, max model length, seed) → the engine's Speculation
SpeculationBuilder = Callable[[SpecConfig, LlamaModel, int, int, int], Speculation]


class PlainDecoding:
    """Nothing to propose: every decode step is a plain step."""

    feature_layers: tuple[int, ...] = ()
    needs_features = False
    drafter_version: int | None = None

    def plan(self, batch: ScheduledBatch) -> Any:
        return None

    def verify(
        self, plan: Any, reqs: list[Request], runner: ModelRunner, shared: torch.Generator
    ) -> tuple[RunOutput, Emitted]:
        raise AssertionError("plain decoding never plans a verify step")

    def observe(self, committed: Committed) -> None:
        pass

    def end_step(
        self, batch: ScheduledBatch, outputs: Sequence[StepOutput], seconds: float
    ) -> None:
        pass

    def release(self, reqs: Sequence[Request]) -> None:
        pass

    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    def weights_changed(self) -> None:
        pass


def plain_decoding(
    config: SpecConfig, target: LlamaModel, rows: int, max_len: int, seed: int
) -> Speculation:
    if config.method != "off":
        raise ConfigError(f"method: {config.method!r} needs the speculative package's builder "
                          "(tlt_serve.speculative.decoder.build_spec_decoder)")
    return PlainDecoding()
