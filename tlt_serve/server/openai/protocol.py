"""OpenAI-compatible bodies (/v1/completions, /v1/chat/completions) plus vLLM's extras.

Fields the official SDK may send but this server does not implement are declared so that
their harmless defaults pass; ``*_DEFAULT_ONLY`` lists the values accepted, anything else is
a 400 naming the field (never silently ignored).
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType

# ---- requests -----------------------------------------------------------------------------


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CommonReq(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:{id}"
    prompt_logprobs: int | None = None  # each prompt token's logprob, with this many top ones
    cache_salt: str | None = None  # cached prefixes are shared only under the same salt
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    # SGLang extras (sglang-router adds them to every request it forwards)
    no_stop_trim: bool = False  # as include_stop_str_in_output
    return_hidden_states: bool = False


COMMON_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "logit_bias": (None, {}),
    "repetition_penalty": (None, 1.0),
    "use_beam_search": (False,),
    "min_tokens": (0,),
    "return_hidden_states": (False,),
}


class CompletionReq(CommonReq, kw_only=True):
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


COMPLETION_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    **COMMON_DEFAULT_ONLY,
    "suffix": (None, ""),
}


class TextPart(Struct, forbid_unknown_fields=True):
    type: str
    text: str


class FunctionCallIn(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text


class ToolCallIn(Struct, forbid_unknown_fields=True, kw_only=True):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    function: FunctionCallIn
    id: str | None = None
    type: str = "function"
    index: int | None = None  # a streamed call's place, sent back by some clients


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result's call


class FunctionDef(Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDef(Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


class FunctionName(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionName


class JsonSchemaFormat(Struct, forbid_unknown_fields=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema
    json_schema: JsonSchemaFormat | None = None


class ChatReq(CommonReq, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as sent; each checked as a ToolDef
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # SGLang extras. The reasoning flags act only with a reasoning parser, which this
    # server (like SGLang without --reasoning-parser) does not run: accepted, no effect.
    continue_final_message: bool = False
    # vLLM's and SGLang's: variables the chat template reads (Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True


CHAT_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    **COMMON_DEFAULT_ONLY,
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "continue_final_message": (False,),
}

# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens whose KV was reused (prefix cache, shared prefill)


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's entry of ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobsOut = list[dict[str, PromptLogprob] | None]  # per prompt position, None first


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobsOut | UnsetType = UNSET


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    weight_version: str
    object: str = "text_completion"
    usage: Usage | None | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob] | None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessageOut(Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []


class DeltaToolCall(Struct):
    """A whole call in one delta (clients join a call's deltas by ``index``)."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    weight_version: str
    object: str = "chat.completion"
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobsOut | UnsetType = UNSET


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    weight_version: str
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobsOut | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    root: str
    object: str = "model"
    owned_by: str = "tlt-serve"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"
