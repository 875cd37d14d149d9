"""OpenAI request bodies → engine jobs (prompts, SamplingParams), validated in the front end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tlt_serve.contract.reports import EngineInfo
from tlt_serve.models.tokenizer import Tokenizer
from tlt_serve.sampling_params import ParamError, SamplingParams
from tlt_serve.server.common.jobs import (
    Job,
    check_prompt,
    make_params,
    new_rid,
    require_defaults,
    whole_vocab,
)
from tlt_serve.server.openai.chat_inputs import (
    ToolUse,
    answer_schema,
    template_messages,
    tool_use,
)
from tlt_serve.server.openai.protocol import (
    CHAT_DEFAULT_ONLY,
    COMPLETION_DEFAULT_ONLY,
    ChatReq,
    CommonReq,
    CompletionReq,
)

# What the request itself hands the chat template: never a template variable from the body
RENDER_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "tokenizer_kwargs", "padding", "truncation", "max_length",
})


def completion_jobs(req: CompletionReq, tok: Tokenizer, info: EngineInfo) -> list[Job]:
    require_defaults(req, COMPLETION_DEFAULT_ONLY)
    if req.best_of is not None and req.best_of != req.n:
        raise ParamError("best_of", "only best_of == n is supported")
    limit = info.logprob_limit
    if req.logprobs is not None and not 0 <= req.logprobs <= limit:
        raise ParamError("logprobs", f"must be in [0, {limit}], got {req.logprobs}")
    _check_stream_options(req)
    prompts = _completion_prompts(req.prompt, tok)
    base = new_rid()
    jobs = []
    # An echoed prompt's logprobs come with `logprobs` (as vLLM): its tokens are scored too.
    echoed = req.logprobs if req.echo and req.logprobs is not None else None
    asked = whole_vocab(req.prompt_logprobs, info)
    scored = max((k for k in (asked, echoed) if k is not None), default=None)
    for i, ids in enumerate(prompts):
        check_prompt(ids, info, "prompt")
        params = _params(
            req, info, len(ids), req.max_tokens, req.logprobs is not None, req.logprobs or 0,
            {"top_logprobs": "logprobs"}, scored,
        )
        jobs.append(Job(base if len(prompts) == 1 else f"{base}-{i}", ids, params))
    return jobs


def _completion_prompts(prompt: str | list[Any], tok: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise ParamError("prompt", "is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise ParamError("prompt", "must be a string, a list of strings, token ids or lists of them")


def chat_job(
    req: ChatReq, tok: Tokenizer, info: EngineInfo, tool_parser: str | None = None
) -> tuple[Job, ToolUse]:
    """``tool_parser``: the server's tool-call format (None: it parses none)."""
    require_defaults(req, CHAT_DEFAULT_ONLY)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise ParamError("top_logprobs", "requires logprobs to be true")
        if not 0 <= req.top_logprobs <= info.logprob_limit:
            raise ParamError("top_logprobs", f"must be in [0, {info.logprob_limit}]")
    _check_stream_options(req)
    tools = tool_use(req, tool_parser)
    schema = answer_schema(req, tools)
    messages = template_messages(req.messages)
    kwargs = req.chat_template_kwargs or {}
    taken = sorted(set(kwargs) & RENDER_ARGUMENTS)
    if taken:
        raise ParamError(f"chat_template_kwargs.{taken[0]}",
                         "is set by the request itself, not a template variable")
    try:
        ids = tok.apply_chat_template(messages, tools.schemas, kwargs)
    except ValueError as err:
        raise ParamError("messages", str(err)) from err
    check_prompt(ids, info, "messages")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = _params(
        req, info, len(ids), limit, req.logprobs, req.top_logprobs or 0,
        {"max_new_tokens": field}, whole_vocab(req.prompt_logprobs, info),
    )
    # a template's call markers may be special tokens: its parser must see them
    markers = tools.parser in ("hermes", "llama3_json")
    params = replace(params, json_schema=schema,
                     skip_special_tokens=params.skip_special_tokens and not markers)
    return Job(new_rid(), ids, params), tools


def _check_stream_options(req: CommonReq) -> None:
    opts = req.stream_options
    if opts is None:
        return
    if not req.stream:
        raise ParamError("stream_options", "only allowed when stream is true")
    if opts.continuous_usage_stats:
        raise ParamError("stream_options.continuous_usage_stats", "not supported")


def _params(
    req: CommonReq,
    info: EngineInfo,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    rename: dict[str, str],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= info.logprob_limit:
        raise ParamError("prompt_logprobs", f"must be in [0, {info.logprob_limit}], got "
                         f"{prompt_logprobs}")
    room = info.max_model_len - prompt_len
    names = {"max_new_tokens": "max_tokens", "prompt_logprobs": "prompt_logprobs", **rename}
    if max_tokens is not None and max_tokens > room:
        # As OpenAI and vLLM: refused, not silently cut at the end of the context.
        raise ParamError(
            names["max_new_tokens"],
            f"is too large: {max_tokens}. The maximum context length is {info.max_model_len} "
            f"tokens and the prompt has {prompt_len}, which leaves {room} "
            f"({max_tokens} > {info.max_model_len} - {prompt_len})",
        )
    return make_params(
        names, info,
        max_new_tokens=room if max_tokens is None else max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        n=req.n,
        stop=req.stop or (),
        stop_token_ids=req.stop_token_ids or (),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_in_text=req.include_stop_str_in_output or req.no_stop_trim,
        seed=req.seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=-1 if prompt_logprobs is None else prompt_logprobs,
        cache_salt=req.cache_salt,
    )
