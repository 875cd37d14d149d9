"""Request bodies → (rid, prompt token ids, SamplingParams), validated in the front end.

Everything the engine would reject is checked here first (vocabulary, length, ranges), so the
common error costs no round trip to the engine process; every error names its field in the
caller's vocabulary (``sampling_params.temperature``, ``max_tokens``, ``prompt``...).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.server.messages import EngineInfo
from tlt_serve.server.protocol import (
    GENERATE_DEFAULT_ONLY,
    SGL_DEFAULT_ONLY,
    GenerateReq,
    SglSamplingParams,
)


@dataclass(frozen=True)
class Job:
    """One prompt of a request, ready for ``EngineClient.submit``."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams


def new_rid() -> str:
    return uuid.uuid4().hex


def check_prompt(ids: Sequence[int], info: EngineInfo, field: str) -> None:
    if not ids:
        raise ParamError(field, "prompt is empty")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise ParamError(field, f"token id {bad} outside vocabulary [0, {info.vocab_size})")
    limit = info.max_model_len - 1  # at least one token of room for the output
    if len(ids) > limit:
        raise ParamError(
            field, f"prompt has {len(ids)} tokens, the limit is {limit} (max_model_len - 1)"
        )


def require_defaults(obj: Any, allowed: Mapping[str, tuple[Any, ...]], prefix: str = "") -> None:
    """Fields we accept only at no-op values: anything else is a 400, never ignored."""
    for name, values in allowed.items():
        value = getattr(obj, name)
        if not any(_same(value, v) for v in values):
            shown = ", ".join(repr(v) for v in values)
            raise ParamError(f"{prefix}{name}", f"not supported (accepted values: {shown})")


def _same(value: Any, allowed: Any) -> bool:
    # Types must match too: msgspec decodes each field to its declared type, and this keeps
    # True from passing for 1 (or 0 for False).
    return value is None if allowed is None else type(value) is type(allowed) and value == allowed


def make_params(rename: Mapping[str, str], **kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs) with a ParamError renamed to the API's field name."""
    try:
        return SamplingParams(**kwargs)
    except ParamError as err:
        field = rename.get(err.field, err.field)
        raise ParamError(field, str(err).split(": ", 1)[1]) from err


# ---- SGLang /generate -------------------------------------------------------------------


def generate_jobs(req: GenerateReq, tok: Tokenizer, info: EngineInfo) -> tuple[list[Job], bool]:
    """Returns the jobs and whether the response is a single object (one prompt, n == 1)."""
    require_defaults(req, GENERATE_DEFAULT_ONLY)
    prompts, field, batch = _native_prompts(req, tok)
    count = len(prompts)
    sps = _per_prompt(req.sampling_params, count, "sampling_params", SglSamplingParams())
    logprob = _per_prompt(req.return_logprob, count, "return_logprob", False)
    top_n = _per_prompt(req.top_logprobs_num, count, "top_logprobs_num", 0)
    rids = _rids(req.rid, count)
    jobs = []
    for i, ids in enumerate(prompts):
        check_prompt(ids, info, f"{field}[{i}]" if batch else field)
        jobs.append(Job(rids[i], ids, _sgl_params(sps[i], logprob[i], top_n[i])))
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
}


def _sgl_params(sp: SglSamplingParams, logprob: bool, top_n: int) -> SamplingParams:
    require_defaults(sp, SGL_DEFAULT_ONLY, "sampling_params.")
    return make_params(
        _SGL_FIELD_NAMES,
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        n=sp.n,
        stop=sp.stop or (),
        stop_token_ids=sp.stop_token_ids or (),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        include_stop_in_text=sp.no_stop_trim,
        seed=sp.sampling_seed,
        logprobs=logprob,
        top_logprobs=top_n if logprob else 0,
    )
