"""The one object that tracks a request through the engine. Only the scheduler mutates it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from tlt_serve.engine.detokenizer import Detokenizer
from tlt_serve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class FinishReason:
    """``type`` is stop | length | abort; ``matched`` the stop token id or string, if any."""

    type: str
    matched: int | str | None = None


TopLogprobs = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(frozen=True)
class PromptLogprobs:
    """A scored prompt: the logprob of each token from position ``start`` on given the
    tokens before it, under the target's raw distribution (position 0 has none: None), its
    rank there (1: the most likely token) and the position's top logprobs."""

    start: int
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[TopLogprobs]  # one list per position ([] at position 0, or when none asked)


@dataclass(frozen=True)
class SpecCounts:
    """Speculation counters of one request: verify steps it drafted in, draft tokens
    proposed, draft tokens accepted (excluding the correction / bonus token), and the tokens
    its verify steps appended beyond one each (fewer than accepted where a stop cut them)."""

    verify_ct: int = 0
    drafted: int = 0
    accepted: int = 0
    drafter_versions: tuple[int, ...] = ()  # drafter versions that drafted for it, in order
    extra_tokens: int = 0

    def plus(self, drafted: int, accepted: int, drafter_version: int | None = None,
             appended: int | None = None) -> SpecCounts:
        """One verify step that drafted ``drafted`` and appended ``appended`` tokens
        (default ``accepted`` + 1)."""
        versions = self.drafter_versions
        if drafter_version is not None and (not versions or versions[-1] != drafter_version):
            versions = (*versions, drafter_version)
        extra = accepted if appended is None else max(appended - 1, 0)
        return SpecCounts(self.verify_ct + 1, self.drafted + drafted, self.accepted + accepted,
                          versions, self.extra_tokens + extra)

    def forwards(self, completion_tokens: int) -> int:
        """Decode forwards (plain or verify) that produced a request's ``completion_tokens``:
        the prefill commits the first, every forward one more and a verify step its extra."""
        return max(completion_tokens - 1 - self.extra_tokens, self.verify_ct)

    @property
    def accept_length(self) -> float:
        """Mean accepted drafts per verify step (0 when it never speculated)."""
        return self.accepted / self.verify_ct if self.verify_ct else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(eq=False)  # identity semantics: two requests are never 'equal'
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: Detokenizer | None  # present when stop strings or text are needed in the engine
    group: str | None = None  # samples of one prompt share a group and one prefill
    generator: torch.Generator | None = None  # per-request seed; None: engine's generator
    status: Status = Status.WAITING
    row: int = -1  # KV cache row while running
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # prompt tokens whose KV was not computed for it: a sibling's prefill, the prefix cache
    cached_tokens: int = 0
    kv_version: str | None = None  # the weight version its prefill ran under
    spec: SpecCounts = field(default_factory=SpecCounts)
    finish: FinishReason | None = None
    prompt_logprobs: PromptLogprobs | None = None  # scored at its prefill, sent once
    grammar: Any = None  # an xgrammar matcher where the output must match a schema (grammar.py)

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        out, self.prompt_logprobs = self.prompt_logprobs, None
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
