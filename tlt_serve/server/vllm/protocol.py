"""Bodies of vLLM's RL routes (msgspec Structs): ``/inference/v1/generate`` (tokens in,
tokens out) and ``/update_weights``. Unknown fields are a 400 naming them; fields vLLM
clients send at harmless defaults are accepted only there (``*_DEFAULT_ONLY``)."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from tlt_serve.server.openai.protocol import PromptLogprobsOut, StreamOptions, Usage


class VllmSamplingParams(Struct, forbid_unknown_fields=True):
    """The part of vLLM's ``SamplingParams`` a rollout sends."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None  # omitted or null: up to max_model_len, as vLLM's route
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: int = 0  # vLLM's RequestOutputKind: every kind answers whole here
    # What prime-rl's train client merges in from its ``extra_body`` (vLLM drops keys its
    # SamplingParams lacks): token ids come back anyway; a salt here salts the prefix cache
    # as the top-level ``cache_salt`` does (which wins); the routed-experts offset has
    # nothing to apply to (dense models, no routing replay).
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    routed_experts_prompt_start: int | None = None
    # Accepted only at these no-op values.
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None


SAMPLING_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "min_tokens": (0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "logit_bias": (None, {}),
    "structured_outputs": (None,),
}


class GenerateReq(Struct, forbid_unknown_fields=True):
    token_ids: list[int]
    sampling_params: VllmSamplingParams = msgspec.field(default_factory=VllmSamplingParams)
    request_id: str | None = None
    model: str | None = None
    cache_salt: str | None = None  # cached prefixes are shared only under the same salt
    return_token_ids: bool | None = None
    output_mode: str = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted only at these no-op values.
    priority: int = 0
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None


GENERATE_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "output_mode": ("tokens",),
    "priority": (0,),
    "features": (None,),
    "content_parts": (None, []),
    "kv_transfer_params": (None,),
}


class GenLogprob(Struct):
    token_id: int
    logprob: float
    rank: int | None = None
    token: str = ""  # "token_id:<id>", as prime-rl's renderers client checks it


def gen_logprob(token_id: int, logprob: float, rank: int | None) -> GenLogprob:
    return GenLogprob(token_id, logprob, rank, f"token_id:{token_id}")


class GenLogprobsContent(Struct):
    """The sampled token's; ``top_logprobs`` it first, then the best others in rank order."""

    token_id: int
    logprob: float
    rank: int | None
    top_logprobs: list[GenLogprob]
    token: str  # "token_id:<id>"


class GenLogprobs(Struct):
    content: list[GenLogprobsContent] | None


class WeightVersionSpan(Struct):
    """vLLM's: output tokens [start, end) were sampled under weights ``version``."""

    version: str
    start: int
    end: int


class GenChoice(Struct):
    index: int
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int]
    logprobs: GenLogprobs | None
    weight_versions: list[WeightVersionSpan]


class GenerateOut(Struct):
    request_id: str
    model: str
    created: int
    choices: list[GenChoice]
    usage: Usage
    weight_version: str
    prompt_logprobs: PromptLogprobsOut | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET


class GenStreamChoice(Struct):
    """A sample's new tokens (and their logprobs) since its previous chunk."""

    index: int
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int]
    logprobs: GenLogprobs | None
    weight_versions: list[WeightVersionSpan] | UnsetType = UNSET  # on the sample's last chunk


class GenStreamOut(Struct):
    request_id: str
    choices: list[GenStreamChoice]
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobsOut | UnsetType = UNSET


class TransferUpdateInfo(Struct, forbid_unknown_fields=True):
    """One round of vLLM's weight transfer: the tensors rank 0 broadcasts next, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    is_checkpoint_format: bool = True


class UpdateWeightsReq(Struct, forbid_unknown_fields=True):
    """prime-rl's ``{weight_dir}`` (a checkpoint directory), or vLLM's weight-transfer
    ``{update_info}`` (a round over the group ``/init_weight_transfer_engine`` joined)."""

    weight_dir: str | None = None
    update_info: TransferUpdateInfo | None = None


class TransferInitInfo(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's NCCL weight-transfer init, its TCPStore rendezvous: the trainer is rank 0 and
    hosts the store; this server joins as ``rank_offset``. ``backend`` (not vLLM's): the
    collective library, gloo (CPU) or nccl (a CUDA engine)."""

    master_address: str
    master_port: int | str
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 120.0
    packed: bool = False
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None
    nccl_unique_id_b64: str | None = None


class TransferInitReq(Struct, forbid_unknown_fields=True):
    init_info: TransferInitInfo


class TransferFinishReq(Struct, forbid_unknown_fields=True):
    weight_version: str | None = None
