"""SGLang ``/generate`` bodies → jobs (rid, prompt token ids, SamplingParams), validated in
the front end: everything the engine would reject is checked here first (vocabulary, length,
ranges), so the common error costs no round trip to the engine process; every error names
its field (``sampling_params.temperature``, ``input_ids``...)."""

from __future__ import annotations

from typing import Any, TypeVar

from tlt_serve.contract.reports import EngineInfo
from tlt_serve.engine.grammar import check_schema
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.server.common.jobs import (
    Job,
    api_names,
    check_prompt,
    make_params,
    new_rid,
    require_defaults,
)
from tlt_serve.server.sglang.protocol import (
    GENERATE_DEFAULT_ONLY,
    SGL_DEFAULT_ONLY,
    GenerateReq,
    SglSamplingParams,
)

T = TypeVar("T")
SAMPLING_EPS = 1e-6


def generate_jobs(req: GenerateReq, tok: Tokenizer, info: EngineInfo) -> tuple[list[Job], bool]:
    """Returns the jobs and whether the response is a single object (one prompt, n == 1)."""
    require_defaults(req, GENERATE_DEFAULT_ONLY)
    prompts, field, batch = _native_prompts(req, tok)
    count = len(prompts)
    sps = _per_prompt(req.sampling_params, count, "sampling_params", SglSamplingParams())
    logprob = _per_prompt(req.return_logprob, count, "return_logprob", False)
    top_n = _per_prompt(req.top_logprobs_num, count, "top_logprobs_num", 0)
    starts = _per_prompt(req.logprob_start_len, count, "logprob_start_len", -1)
    rids = _rids(req.rid, count)
    jobs = []
    for i, ids in enumerate(prompts):
        check_prompt(ids, info, f"{field}[{i}]" if batch else field)
        params = _sgl_params(sps[i], logprob[i], top_n[i], _start(starts[i]), info,
                             info.max_model_len - len(ids))
        with api_names(_SGL_FIELD_NAMES):  # a scoring start inside the prompt
            params.check_prompt(len(ids))
        jobs.append(Job(rids[i], ids, params))
    single = not batch and jobs[0].params.n == 1
    return jobs, single


def _native_prompts(req: GenerateReq, tok: Tokenizer) -> tuple[list[list[int]], str, bool]:
    if (req.text is None) == (req.input_ids is None):
        raise ParamError("text", "give exactly one of text or input_ids")
    if req.text is not None:
        if isinstance(req.text, str):
            return [tok.encode(req.text)], "text", False
        if not req.text:
            raise ParamError("text", "batch is empty")
        return [tok.encode(t) for t in req.text], "text", True
    ids = req.input_ids or []
    if all(isinstance(t, int) for t in ids):
        return [list(ids)], "input_ids", False  # type: ignore[arg-type]
    if all(isinstance(t, list) for t in ids):
        return [list(p) for p in ids], "input_ids", True  # type: ignore[arg-type]
    raise ParamError("input_ids", "must be a list of token ids or a list of such lists")


def _start(start: int) -> int:
    """-1 (the default): no prompt token is scored. SGLang would score the last one; that
    costs nothing natively, but vLLM computes prompt logprobs for a whole prompt and reads no
    cached prefix for them, so every ``return_logprob`` request would pay both there."""
    if start < -1:
        raise ParamError("logprob_start_len", f"must be >= -1, got {start}")
    return start


def _per_prompt(value: Any, count: int, field: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise ParamError(field, f"has {len(value)} entries for {count} prompts")
    return value


def _rids(rid: str | list[str] | None, count: int) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(count)]
    rids = [rid] if isinstance(rid, str) else rid
    if len(rids) != count:
        raise ParamError("rid", f"has {len(rids)} ids for {count} prompts")
    if len(set(rids)) != len(rids) or any(not r or "#" in r for r in rids):
        raise ParamError("rid", "ids must be unique, non-empty and free of '#'")
    return rids


# SamplingParams field → the name a client used for it in a /generate body (error messages).
_SGL_FIELD_NAMES = {
    **{f: f"sampling_params.{f}" for f in SamplingParams.__dataclass_fields__},
    "seed": "sampling_params.sampling_seed",
    "top_logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    "prompt_logprobs_start": "logprob_start_len",
}


def _sgl_params(sp: SglSamplingParams, logprob: bool, top_n: int, start: int,
                info: EngineInfo, room: int) -> SamplingParams:
    """``room``: what the context leaves the prompt (a null ``max_new_tokens``)."""
    require_defaults(sp, SGL_DEFAULT_ONLY, "sampling_params.")
    if sp.json_schema is not None:
        check_schema(sp.json_schema, "sampling_params.json_schema")
    return make_params(
        _SGL_FIELD_NAMES, info,
        max_new_tokens=room if sp.max_new_tokens is None else sp.max_new_tokens,
        temperature=_greedy_below_eps(_or(sp.temperature, 1.0)),
        top_p=_or(sp.top_p, 1.0),
        top_k=_or(sp.top_k, -1),
        min_p=_or(sp.min_p, 0.0),
        n=_or(sp.n, 1),
        stop=sp.stop or (),
        stop_token_ids=sp.stop_token_ids or (),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        include_stop_in_text=sp.no_stop_trim,
        seed=sp.sampling_seed,
        logprobs=logprob,
        top_logprobs=top_n if logprob else 0,
        prompt_logprobs=top_n if logprob and start >= 0 else -1,
        prompt_logprobs_start=max(start, 0),
        json_schema=sp.json_schema,
    )


def _greedy_below_eps(temperature: float) -> float:
    """SGLang samples greedily below 1e-6 (its ``_SAMPLING_EPS``)."""
    return 0.0 if 0.0 <= temperature < SAMPLING_EPS else temperature


def _or(value: T | None, default: T) -> T:
    return default if value is None else value
