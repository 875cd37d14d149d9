"""Request/response bodies of the SGLang-native ``/generate`` (msgspec Structs).

Requests forbid unknown fields: a typo like ``max_new_token`` is a 400 naming it, never a
silently ignored setting. Fields that SGLang clients send at harmless defaults are accepted
(declared here) and rejected with a 400 at any other value (see ``inputs.require_defaults``).
OpenAI bodies live in ``server/openai/protocol.py``, control bodies in
``server/control/protocol.py``.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType

# ---- /generate ------------------------------------------------------------------------


class SglSamplingParams(Struct, forbid_unknown_fields=True):
    # null is the default, as SGLang reads it (an OpenAI-style client sends "temperature":
    # null); a null max_new_tokens runs to max_model_len.
    max_new_tokens: int | None = 128
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    n: int | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    no_stop_trim: bool = False  # keep a matched stop string / stop token's text in `text`
    spaces_between_special_tokens: bool = True
    # Read only by a custom logit processor (refused below), as in SGLang: accepted, unused.
    custom_params: dict[str, Any] | None = None
    # Accepted only at these no-op values (or null).
    min_new_tokens: int | None = 0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None


SGL_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0, None),
    "frequency_penalty": (0.0, None),
    "presence_penalty": (0.0, None),
    "repetition_penalty": (1.0, None),
    "regex": (None,),
    "ebnf": (None,),
    "logit_bias": (None, {}),
}


class GenerateReq(Struct, forbid_unknown_fields=True):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: SglSamplingParams | list[SglSamplingParams] | None = None
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # With return_logprob: the first prompt position whose logprob is returned (-1: none).
    logprob_start_len: int | list[int] = -1
    # Accepted only at these no-op values.
    return_hidden_states: bool = False
    lora_path: str | None = None
    custom_logit_processor: str | None = None
    token_ids_logprob: list[int] | None = None
    image_data: str | list[Any] | None = None
    log_metrics: bool = True
    # sglang-router re-serializes every /generate with these fields set (model: null).
    model: str | None = None  # one model per server: not used for routing here
    no_logs: bool = False  # request bodies are never logged
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


GENERATE_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "return_hidden_states": (False,),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "token_ids_logprob": (None,),
    "image_data": (None, []),
    "background": (False,),
    "return_bytes": (False,),
    "return_entropy": (False,),
}


class FinishReasonOut(Struct):
    type: str  # stop | length | abort
    matched: int | str | None = None
    length: int | UnsetType = UNSET  # SGLang reports the limit for type "length"
    message: str | UnsetType = UNSET


# (logprob, token_id, token text or None) — SGLang's tuple layout, kept for drop-in clients.
LogprobEntry = tuple[float, int, str | None]
# A prompt position's: no logprob at position 0 (nothing precedes it).
InputLogprobEntry = tuple[float | None, int, str | None]


class MetaInfo(Struct):
    id: str
    finish_reason: FinishReasonOut | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_versions: list[str]  # every version a step of this sample ran under, in order
    e2e_latency: float
    output_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_top_logprobs: list[list[LogprobEntry]] | UnsetType = UNSET
    # The prompt's tokens from logprob_start_len on, each given the tokens before it.
    input_token_logprobs: list[InputLogprobEntry] | UnsetType = UNSET
    input_top_logprobs: list[list[LogprobEntry] | None] | UnsetType = UNSET
    # Only when the server speculates, in SGLang's meaning: verify_ct counts the sample's
    # decode forwards (a plain step is a verify of no drafts: speculation runs in the tail
    # only), accept_length is completion_tokens / verify_ct (tokens per forward, the bonus
    # included; 0 before a decode forward), accept_rate accepted / drafted tokens. On
    # --backend vllm the counts come with a sample's last chunk (vLLM reports them there).
    spec_accept_length: float | UnsetType = UNSET
    spec_verify_ct: int | UnsetType = UNSET
    spec_accept_rate: float | UnsetType = UNSET
    # SGLang's totals (slime's speculation metrics): accepted and drafted tokens.
    spec_accept_token_num: int | UnsetType = UNSET
    spec_draft_token_num: int | UnsetType = UNSET
    spec_draft_steps: int | UnsetType = UNSET  # the forwards that drafted for it (verified)
    # Drafter versions that drafted for this sample, in order (RL: which drafter served it);
    # drafter_version is the last of them (null before any drafter step).
    drafter_version: int | None | UnsetType = UNSET
    drafter_versions: list[int] | UnsetType = UNSET


class GenerateOut(Struct):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | UnsetType = UNSET  # position in a batch/n>1 response (streaming only)
