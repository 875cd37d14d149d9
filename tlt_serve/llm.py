"""Offline API: ``LLM(...).generate(prompts, SamplingParams(...))`` runs the engine to the end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from tlt_serve.config import EngineConfig
from tlt_serve.engine.engine import Engine
from tlt_serve.engine.outputs import RequestResult
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative.decoder import build_spec_decoder

Prompt = str | list[int]


@dataclass(frozen=True)
class GenerateResult:
    prompt_ids: list[int]
    samples: list[RequestResult]  # n of them


class LLM:
    """Blocking, single-threaded front end over an Engine (tests, benchmarks, scripts)."""

    def __init__(
        self, model: str | None = None, config: EngineConfig | None = None, **model_kw: Any
    ):
        config = config or EngineConfig()
        if model is not None:
            model_kw["model"] = model
        if model_kw:
            config = replace(config, model=replace(config.model, **model_kw))
        self.engine = Engine(config, build_spec_decoder)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerateResult]:
        """Run all prompts to completion in one continuous batch; results in prompt order."""
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in _as_list(prompts)]
        plist = _per_prompt(params, len(ids))
        results: dict[str, RequestResult] = {}
        order: list[list[str]] = []
        for i, (prompt, p) in enumerate(zip(ids, plist, strict=True)):
            rids = self.engine.add_request(f"offline-{i}", prompt, p)
            order.append(rids)
            results.update({r: RequestResult(r, prompt) for r in rids})
        bar = tqdm(total=len(results), desc="generate", disable=not use_tqdm)
        while self.engine.has_work():
            for out in self.engine.step():
                results[out.rid].add(out)
                bar.update(int(out.finished))
        bar.close()
        return [
            GenerateResult(prompt, [results[r] for r in rids])
            for prompt, rids in zip(ids, order, strict=True)
        ]

    def chat(
        self, conversations: Sequence[list[dict[str, Any]]], params: SamplingParams | None = None
    ) -> list[GenerateResult]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a sequence of them → a list of prompts."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]  # a single list[int] prompt
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"params: {len(params)} SamplingParams for {n} prompts")
    return list(params)
