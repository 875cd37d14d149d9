"""Our request and output value objects ⇄ vLLM's, with the semantics of the native engine.

- Sampling: each of the n samples is its own vLLM request with ``n=1`` (``rid#i``, seed
  ``seed + i`` as natively), so greedy ``n > 1`` works (vLLM refuses it in one request) and
  aborts address samples the way the front end names them.
- Length: ``max_new_tokens`` past the context is cut at ``max_model_len`` (finish
  ``length``), as ``/generate`` does natively.
- Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"``: log_softmax of the
  logits after temperature (raw logits when greedy), which is the native definition
  whenever no top-k / top-p / min-p truncation renormalizes them. A request that asks for
  logprobs together with a truncation gets a 400 naming the truncating field: vLLM would
  report the truncated distribution's values, not the target's.
- With speculation configured vLLM refuses ``min_p``: a 400 naming it, as well.
- Scoring: ``prompt_logprobs`` are vLLM's (the raw distribution, as natively; vLLM never
  reads a cached prefix for them); a request for no new tokens asks vLLM for one (its
  least) and drops it, finishing with "length".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tlt_serve.engine.outputs import StepOutput
from tlt_serve.engine.request import FinishReason, PromptLogprobs, SpecCounts
from tlt_serve.sampling_params import ParamError, SamplingParams

BACKEND = "vllm"


def refuse(field: str, why: str) -> ParamError:
    return ParamError(field, f"{why} on backend {BACKEND}")


def check_params(params: SamplingParams, speculating: bool) -> None:
    """Raise ParamError (naming the field) for what this backend cannot honour exactly."""
    if params.logprobs or params.top_logprobs:
        for field, active in (("top_k", params.top_k > 0), ("top_p", params.top_p < 1.0),
                              ("min_p", params.min_p > 0.0)):
            if active and not params.greedy:
                raise refuse(field, "logprobs of a truncated distribution are not the "
                             "target's (ask without the truncation, or without logprobs)")
    if speculating and params.min_p > 0.0 and not params.greedy:
        raise refuse("min_p", "not supported with speculative decoding")


def vllm_params(params: SamplingParams, index: int, max_tokens: int) -> Any:
    """vLLM SamplingParams of sample ``index`` (a DELTA stream, n = 1)."""
    from vllm import SamplingParams as VParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    want_logprobs = params.logprobs or params.top_logprobs > 0
    return VParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        min_p=params.min_p,
        seed=None if params.seed is None else params.seed + index,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        max_tokens=max(max_tokens, 1),  # none (scoring only): one, dropped (SampleState)
        logprobs=params.top_logprobs if want_logprobs else None,
        prompt_logprobs=params.prompt_logprobs if params.scores_prompt else None,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        include_stop_str_in_output=params.include_stop_in_text,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=(
            None if params.json_schema is None
            else StructuredOutputsParams(json=params.json_schema)
        ),
    )


@dataclass
class SampleState:
    """What the loop keeps of one sample between its outputs."""

    rid: str  # the engine id: rid, or rid#i
    prompt_tokens: int
    params: SamplingParams
    cached_tokens: int = 0
    scored: bool = False  # its prompt logprobs were sent
    drafter_versions: tuple[int, ...] = ()  # drafters that served while it ran, in order

    def saw_drafter(self, version: int | None) -> None:
        if version is not None and (not self.drafter_versions
                                    or self.drafter_versions[-1] != version):
            self.drafter_versions = (*self.drafter_versions, version)


def step_output(state: SampleState, out: Any, completion: Any, weight_version: str
                ) -> StepOutput:
    """One vLLM DELTA ``CompletionOutput`` → our ``StepOutput``. Its speculation counters
    are vLLM's per-request summary, on the finishing output only (vLLM reports none before,
    nor for an aborted request); the drafter versions are those that served meanwhile."""
    if out.num_cached_tokens is not None:
        state.cached_tokens = out.num_cached_tokens
    scored = None
    if out.prompt_logprobs is not None and not state.scored:
        state.scored = True
        scored = prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, state.params)
    tokens = list(completion.token_ids)
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    want_top = state.params.top_logprobs
    if completion.logprobs is not None:
        for token, entries in zip(tokens, completion.logprobs, strict=True):
            logprobs.append(float(entries[token].logprob))
            if want_top:
                tops.append(_ranked(entries, want_top))
    finish, text = finish_reason(completion), completion.text
    if state.params.max_new_tokens == 0:  # scoring only: the one token vLLM made goes
        tokens, logprobs, tops, text = [], [], [], ""
        finish = finish if finish is None or finish.type == "abort" else FinishReason("length")
    return StepOutput(
        rid=state.rid,
        token_ids=tokens,
        logprobs=logprobs,
        top_logprobs=tops,
        text=text,
        finish=finish,
        prompt_tokens=state.prompt_tokens,
        cached_tokens=state.cached_tokens,
        weight_version=weight_version,
        spec=replace(spec_counts(completion), drafter_versions=state.drafter_versions),
        prompt_logprobs=scored,
    )


def _ranked(entries: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The top ``k`` of a vLLM logprobs dict (token → Logprob with its rank), best first."""
    ranked = sorted((e.rank, t, e.logprob) for t, e in entries.items()
                    if e.rank is not None and e.rank <= k)
    return [(t, float(lp)) for _, t, lp in ranked]


def prompt_logprobs(prompt: list[int], entries: list[Any], params: SamplingParams
                    ) -> PromptLogprobs:
    """vLLM's prompt logprobs (None at position 0, then token → Logprob per position) from
    ``params.prompt_logprobs_start`` on."""
    start, k = params.prompt_logprobs_start, params.prompt_logprobs
    logprobs: list[float | None] = []
    ranks: list[int | None] = []
    tops: list[list[tuple[int, float]]] = []
    for p in range(start, len(prompt)):
        at = entries[p]
        if at is None:
            logprobs.append(None)
            ranks.append(None)
            tops.append([])
            continue
        mine = at[prompt[p]]
        logprobs.append(float(mine.logprob))
        ranks.append(mine.rank)
        tops.append(_ranked(at, k) if k else [])
    return PromptLogprobs(start, logprobs, ranks, tops)


def finish_reason(completion: Any) -> FinishReason | None:
    reason = completion.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        matched = completion.stop_reason  # None for EOS, else the token id or string
        return FinishReason("stop", matched)
    if reason == "length":
        return FinishReason("length")
    return FinishReason("abort")  # abort, error, repetition


def spec_counts(completion: Any) -> SpecCounts:
    """The sample's speculation counters, from vLLM's per-request summary (on a normal
    finish only: vLLM attaches none to running or aborted requests)."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return SpecCounts()
    histogram = list(metrics.histogram)
    accepted = sum(j * c for j, c in enumerate(histogram))
    # vLLM appends what a step accepted and its bonus token, but at a stop it cuts
    return SpecCounts(verify_ct=sum(histogram), drafted=int(metrics.num_draft_tokens),
                      accepted=accepted, extra_tokens=accepted)
