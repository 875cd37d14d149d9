"""Typed results and errors of the tlt-serve client (shared by the sync and async clients).

The server's JSON becomes frozen dataclasses: what an RL loop needs from a sample (token ids,
the target's logprobs of them, the weight / drafter versions that produced it, speculation
stats) without dictionary digging. Non-2xx replies become ``ServerError`` subclasses
carrying the server's message and the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class ServerError(Exception):
    """A non-2xx reply: ``status``, the server's ``message`` and the field it names."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" + (f" (field: {param})" if param else ""))
        self.status, self.message, self.param = status, message, param


class BadRequest(ServerError):
    """4xx other than 401/503-like: the request itself is wrong; retrying will not help."""


class AuthError(ServerError):
    """401: missing or wrong API key."""


class Unavailable(ServerError):
    """503: overloaded or shutting down; ``retry_after`` seconds when the server said."""

    def __init__(self, status: int, message: str, param: str | None, retry_after: float | None):
        super().__init__(status, message, param)
        self.retry_after = retry_after


def raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        err = resp.json().get("error", {})
        message, param = str(err.get("message", resp.text)), err.get("param")
    except ValueError:
        message, param = resp.text, None
    if resp.status_code == 401:
        raise AuthError(resp.status_code, message, param)
    if resp.status_code == 503:
        after = resp.headers.get("retry-after")
        raise Unavailable(resp.status_code, message, param, float(after) if after else None)
    if resp.status_code < 500:
        raise BadRequest(resp.status_code, message, param)
    raise ServerError(resp.status_code, message, param)


@dataclass(frozen=True)
class SpecStats:
    accept_length: float  # mean accepted drafts per verify step (bonus token excluded)
    verify_ct: int  # verify steps that drafted for it
    accept_rate: float
    drafter_versions: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """One generated sample of a prompt."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # the target's log p of each token (return_logprob)
    finish_reason: str | None  # stop | length | abort (None while streaming)
    prompt_tokens: int
    weight_version: str  # the last weight version a step of this sample ran under
    weight_versions: tuple[str, ...]
    spec: SpecStats | None  # None when the server does not speculate
    rid: str
    latency_s: float

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def spec_verifies(meta: dict[str, Any]) -> tuple[int, int]:
    """(verify steps that drafted, drafts accepted) of a sample, from its ``/generate``
    ``meta_info``: ``spec_draft_steps`` and ``spec_accept_token_num`` (SGLang's
    ``spec_verify_ct`` counts every decode forward of a speculating server)."""
    steps = meta.get("spec_draft_steps", meta.get("spec_verify_ct", 0))
    return int(steps or 0), int(meta.get("spec_accept_token_num", 0) or 0)


def parse_sample(body: dict[str, Any]) -> Sample:
    meta = body["meta_info"]
    lps = meta.get("output_token_logprobs")
    spec = None
    if "spec_verify_ct" in meta:
        steps, accepted = spec_verifies(meta)
        spec = SpecStats(
            accepted / steps if steps else 0.0,
            steps,
            float(meta["spec_accept_rate"]),
            tuple(meta.get("drafter_versions") or ()),
        )
    finish = meta.get("finish_reason")
    return Sample(
        text=body["text"],
        token_ids=tuple(body["output_ids"]),
        logprobs=tuple(float(e[0]) for e in lps) if lps is not None else None,
        finish_reason=finish["type"] if finish else None,
        prompt_tokens=int(meta["prompt_tokens"]),
        weight_version=str(meta["weight_version"]),
        weight_versions=tuple(meta.get("weight_versions") or ()),
        spec=spec,
        rid=str(meta["id"]),
        latency_s=float(meta.get("e2e_latency", 0.0)),
    )


def group_samples(bodies: list[dict[str, Any]], prompts: int, n: int) -> list[list[Sample]]:
    """The server's flat list (prompt-major, n per prompt) as one group per prompt."""
    samples = [parse_sample(b) for b in bodies]
    if len(samples) != prompts * n:
        raise ServerError(200, f"expected {prompts * n} samples, got {len(samples)}")
    return [samples[i * n : (i + 1) * n] for i in range(prompts)]
