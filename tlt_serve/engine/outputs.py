"""Value objects the engine hands out."""

from __future__ import annotations

from dataclasses import dataclass, field

from tlt_serve.engine.request import FinishReason, PromptLogprobs, SpecCounts


@dataclass(frozen=True)
class StepOutput:
    """What one request gained in one engine step (the delta, not the total)."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: str  # the target weights this step ran under
    spec: SpecCounts = SpecCounts()  # the request's speculation counters so far (cumulative)
    prompt_logprobs: PromptLogprobs | None = None  # on the request's first output, if asked

    @property
    def finished(self) -> bool:
        return self.finish is not None


@dataclass
class RequestResult:
    """A whole request's output, accumulated from its StepOutputs (offline API, /generate)."""

    rid: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    cached_tokens: int = 0
    weight_version: str = ""  # version of the last step
    weight_versions: list[str] = field(default_factory=list)  # all, in order (RL: off-policy)
    version_starts: list[int] = field(default_factory=list)  # each one's first output token
    spec: SpecCounts = field(default_factory=SpecCounts)
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, out: StepOutput) -> None:
        if not self.weight_versions or self.weight_versions[-1] != out.weight_version:
            self.weight_versions.append(out.weight_version)
            self.version_starts.append(len(self.token_ids))
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        self.text += out.text
        self.finish = out.finish
        self.cached_tokens = out.cached_tokens
        self.weight_version = out.weight_version
        self.spec = out.spec
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs

    def version_spans(self) -> list[tuple[str, int, int]]:
        """(version, start, end): output tokens [start, end) sampled under that version."""
        ends = [*self.version_starts[1:], len(self.token_ids)]
        return [(v, s, e) for v, s, e in zip(self.weight_versions, self.version_starts, ends,
                                             strict=True) if e > s]
