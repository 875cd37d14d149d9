"""Per-request sampling settings, validated at the boundary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def logprob_limit(max_logprobs: int, vocab_size: int) -> int:
    """The most top logprobs a request may ask per position: ``max_logprobs``, -1 for all."""
    return vocab_size if max_logprobs < 0 else max_logprobs


class ParamError(ValueError):
    """An out-of-range or ill-typed request field; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` means greedy.

    ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` disable those filters.
    ``seed`` makes sampling reproducible whatever else is in the batch.
    ``max_new_tokens == 0`` runs the prompt only (scoring: nothing is sampled).
    ``json_schema`` constrains the output to JSON matching it (decoded without speculation).
    ``prompt_logprobs >= 0`` asks for the logprob of every prompt token from position
    ``prompt_logprobs_start`` on, each given the tokens before it, with that many top
    logprobs per position (the target's raw distribution, whatever the temperature).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # slow tokenizers only; fast ones never add them
    include_stop_in_text: bool = False  # keep the matched stop string or stop token's text
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int = -1  # -1: none
    prompt_logprobs_start: int = 0
    cache_salt: str | None = None  # cached prefixes are shared only under the same salt
    json_schema: str | None = None  # the output must match this JSON schema (its JSON text)

    def __post_init__(self) -> None:
        # Accept lists from JSON-ish callers but store immutable tuples.
        object.__setattr__(self, "stop", _str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def check_logprobs(self, limit: int) -> None:
        """Top logprobs asked per position within ``limit`` (the server's max_logprobs)."""
        for name in ("top_logprobs", "prompt_logprobs"):
            if getattr(self, name) > limit:
                raise ParamError(name, f"must be in [0, {limit}], got {getattr(self, name)} "
                                 "(the server's --max-logprobs)")

    def for_vocab(self, vocab_size: int) -> SamplingParams:
        """These settings for a vocabulary of ``vocab_size``: a ``top_k`` at or above it keeps
        every token, so it is off (AReaL sends 10**8, SGLang's "all" is 2**30)."""
        if self.top_k >= vocab_size:
            return dataclasses.replace(self, top_k=-1)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs >= 0

    def check_prompt(self, length: int) -> None:
        """What depends on the prompt: a scoring start inside it."""
        if self.scores_prompt and self.prompt_logprobs_start >= length:
            raise ParamError("prompt_logprobs_start", f"must be below the prompt's length "
                             f"{length}, got {self.prompt_logprobs_start}")

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ParamError("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ParamError("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ParamError("top_k", f"must be -1 (off) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 1 <= self.n <= 256:
            raise ParamError("n", f"must be in [1, 256], got {self.n}")
        if any(s == "" for s in self.stop):
            raise ParamError("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", "token ids must be >= 0")
        if self.top_logprobs < 0:
            raise ParamError("top_logprobs", f"must be >= 0, got {self.top_logprobs}")
        if self.prompt_logprobs < -1:
            raise ParamError("prompt_logprobs",
                             f"must be >= 0 (or -1: none), got {self.prompt_logprobs}")
        if self.prompt_logprobs_start < 0:
            raise ParamError("prompt_logprobs_start",
                             f"must be >= 0, got {self.prompt_logprobs_start}")
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= 1024:
            raise ParamError("cache_salt", "must be 1 to 1024 characters")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ParamError("seed", f"must be in [0, 2**63), got {self.seed}")


def _str_tuple(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)
