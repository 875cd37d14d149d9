"""Bodies of the control endpoints: abort, pause, weights, tokenizer, drafter (hot-swap,
training control, capture). Requests forbid unknown fields (a typo is a 400 naming it)."""

from __future__ import annotations

from msgspec import Struct


class UpdateDrafterReq(Struct, forbid_unknown_fields=True):
    path: str  # a drafter checkpoint directory (speculative/checkpoint.py)
    version: int | None = None  # overrides the checkpoint's own version


class UpdateDrafterOut(Struct):
    success: bool
    message: str
    drafter_version: int | None


class GateOut(Struct):
    """May the trainer run now? Polled between training micro-steps."""

    train: bool
    reason: str
    in_flight: int
    max_running: int
    paused: bool
    weight_version: str


# ---- abort, pause, weights, tokenizer ----------------------------------------------------
class AbortReq(Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False


class PauseReq(Struct, forbid_unknown_fields=True):
    mode: str = "abort"


class UpdateFromDiskReq(Struct, forbid_unknown_fields=True):
    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    load_format: str | None = None  # only the default (safetensors) is supported
    flush_cache: bool = True  # no KV of other weights is ever reused: nothing to flush


class UpdateWeightVersionReq(Struct, forbid_unknown_fields=True):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default: the running requests end first


class InitGroupReq(Struct, forbid_unknown_fields=True):
    master_address: str
    master_port: int | str  # AReaL sends it as a string
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 120.0  # give up when rank 0 has not joined by then (serving goes on)


class UpdateFromDistributedReq(Struct, forbid_unknown_fields=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True  # no prefix cache yet: nothing to flush
    load_format: str | None = None


class DestroyGroupReq(Struct, forbid_unknown_fields=True):
    group_name: str = "weight_update_group"


class WeightUpdateOut(Struct):
    success: bool
    message: str
    weight_version: str
    num_paused_requests: int = 0


class TokenizeMessage(Struct, forbid_unknown_fields=True):
    role: str
    content: str


class TokenizeReq(Struct, forbid_unknown_fields=True):
    prompt: str | None = None
    messages: list[TokenizeMessage] | None = None
    add_special_tokens: bool = False
    model: str | None = None


class TokenizeOut(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeReq(Struct, forbid_unknown_fields=True):
    tokens: list[int]
    skip_special_tokens: bool = False
    model: str | None = None


class DetokenizeOut(Struct):
    prompt: str  # vLLM's name
    text: str  # SGLang's name
