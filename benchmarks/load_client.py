"""One streamed request, timed, in either dialect: tlt-serve/SGLang ``/generate`` or OpenAI
``/v1/completions`` (what vLLM and other peers speak). Used by ``benchmarks/rollout_load.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Timed:
    """Timestamps (monotonic seconds) of one request's life as the client saw it."""

    sent: float
    first: float | None = None  # first token arrived
    done: float | None = None
    tokens: int = 0
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens)
    error: str | None = None
    accept_length: float | None = None
    verify_ct: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.done is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)


def _note(t: Timed, total: int) -> None:
    now = time.monotonic()
    if total > t.tokens:
        if t.first is None:
            t.first = now
        t.token_times.append((now, total - t.tokens))
        t.tokens = total


async def stream_generate(
    http: httpx.AsyncClient, ids: list[int], params: dict, t: Timed
) -> None:
    body = {"input_ids": ids, "sampling_params": params, "stream": True}
    async with http.stream("POST", "/generate", json=body) as resp:
        if resp.status_code != 200:
            t.error = f"HTTP {resp.status_code}"
            return
        last = None
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                if "error" in last:
                    t.error = str(last["error"].get("message"))
                    return
                _note(t, len(last["output_ids"]))
        if last is not None:
            meta = last["meta_info"]
            t.accept_length = meta.get("spec_accept_length")
            t.verify_ct = int(meta.get("spec_verify_ct", 0))
    t.done = time.monotonic()


async def stream_openai(
    http: httpx.AsyncClient, model: str, ids: list[int], params: dict, t: Timed
) -> None:
    body = {
        "model": model, "prompt": ids, "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": params["max_new_tokens"], "temperature": params.get("temperature", 1.0),
        "ignore_eos": params.get("ignore_eos", False),  # vLLM extra, accepted by tlt-serve
    }
    if "sampling_seed" in params:
        body["seed"] = params["sampling_seed"]
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            t.error = f"HTTP {resp.status_code}"
            return
        seen = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                seen = max(seen, int(chunk["usage"]["completion_tokens"]))
            elif chunk.get("choices") and chunk["choices"][0].get("text"):
                seen += 1  # one chunk per decode step (a speculating server may send more)
            _note(t, seen)
    t.done = time.monotonic()
