"""HF checkpoint names → this engine's fused parameters; validated, all-or-nothing loading.

The same path serves start-up loading and RL weight updates: every tensor is checked (known
name, shape, floating dtype) before any parameter is touched, so a bad update changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tlt_serve.config import ConfigError
from tlt_serve.kernels import (
    CpuKernels,
    batch_invariant,
    build_error,
    native_bf16_gemm,
)
from tlt_serve.kernels import cpu_kernels as own_kernels
from tlt_serve.models.arch import ArchConfig
from tlt_serve.models.llama import Attention, LlamaModel, refresh_fp32_copies, set_cpu_kernels
from tlt_serve.models.rope import cos_sin_table

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Checkpoint entries that carry no weights of ours (recomputed or unused).
# Per-layer modules whose HF tensors map one to one onto ours.
_PLAIN = frozenset(
    {
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    }
)
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


@dataclass(frozen=True)
class ParamSlot:
    """Rows [start, stop) of internal parameter ``name`` (stop None: the whole tensor)."""

    name: str
    start: int = 0
    stop: int | None = None


class WeightError(ValueError):
    """A checkpoint tensor that does not fit the model; the message names it."""


def param_slot(cfg: ArchConfig, hf_name: str) -> ParamSlot | None:
    """Where an HF tensor goes; None for tensors we deliberately skip; WeightError if unknown."""
    if _IGNORED.search(hf_name):
        return None
    if hf_name == "model.embed_tokens.weight":
        return ParamSlot("embed_tokens.weight")
    if hf_name == "model.norm.weight":
        return ParamSlot("norm.weight")
    if hf_name == "lm_head.weight":
        # Tied checkpoints sometimes still ship lm_head; the embedding is the source of truth.
        return None if cfg.tie_word_embeddings else ParamSlot("lm_head.weight")
    m = _LAYER.match(hf_name)
    if m is None or int(m.group(1)) >= cfg.num_layers:
        raise WeightError(f"unknown weight name {hf_name!r}")
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        target, start, stop = fused[module]
        return ParamSlot(f"{prefix}{target}.{kind}", start, stop)
    if module in _PLAIN:
        return ParamSlot(f"{prefix}{rest}")
    raise WeightError(f"unknown weight name {hf_name!r}")


SlotOf = Callable[[str], "ParamSlot | None"]


def load_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    require_all: bool = False,
    slot_of: SlotOf | None = None,
) -> int:
    """Copy HF-named tensors into ``model`` in place; returns how many were applied.

    Validates everything first: on any WeightError nothing has been modified. With
    ``require_all`` every parameter of the model must be covered (start-up loading).
    ``slot_of`` maps a checkpoint name to a parameter slot (default: the target's
    ``param_slot``; drafters bring their own).
    """
    if slot_of is None:
        cfg: ArchConfig = model.cfg  # type: ignore[assignment]  # a LlamaModel
        slot_of = lambda name: param_slot(cfg, name)  # noqa: E731
    params = dict(model.named_parameters())
    plan: list[tuple[torch.Tensor, ParamSlot, torch.Tensor]] = []
    covered: dict[str, int] = {}
    for hf_name, tensor in tensors:
        slot = slot_of(hf_name)
        if slot is None:
            continue
        if slot.name not in params:
            raise WeightError(f"weight {hf_name!r} has no parameter in this model ({slot.name})")
        param = params[slot.name]
        expected = list(param.shape)
        if slot.stop is not None:
            expected[0] = slot.stop - slot.start
        if list(tensor.shape) != expected:
            raise WeightError(
                f"weight {hf_name!r} has shape {list(tensor.shape)}, expected {expected}"
            )
        if not tensor.is_floating_point():
            raise WeightError(f"weight {hf_name!r} has dtype {tensor.dtype}, expected floating")
        if not torch.isfinite(tensor).all():
            raise WeightError(f"weight {hf_name!r} contains NaN or Inf")
        plan.append((param, slot, tensor))
        covered[slot.name] = covered.get(slot.name, 0) + expected[0]
    if require_all:
        missing = [n for n, p in params.items() if covered.get(n, 0) < max(p.shape[0], 1)]
        if missing:
            raise WeightError(f"checkpoint is missing weights for {missing[:5]}")
    with torch.no_grad():
        for target, slot, tensor in plan:
            dst = target if slot.stop is None else target[slot.start : slot.stop]
            dst.copy_(tensor.to(target.dtype))
    if plan:
        refresh_fp32_copies(model)  # the fp32 copies must follow the new weights
    return len(plan)


def checkpoint_names(path: str | Path) -> list[str]:
    """Tensor names of every *.safetensors file of a directory, without reading tensors."""
    names: list[str] = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def served_tensors(model: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The model's current weights under the checkpoint's HF ``names`` (the inverse of
    ``load_weights``): loading them into a model of the same checkpoint reproduces these
    weights exactly."""
    cfg: ArchConfig = model.cfg  # type: ignore[assignment]  # a LlamaModel
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name in names:
        slot = param_slot(cfg, name)
        if slot is None:
            continue
        param = params[slot.name].detach()
        out[name] = (param if slot.stop is None else param[slot.start : slot.stop]).contiguous()
    return out


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in every *.safetensors file of a directory (or a file)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def build_model(
    path: str | Path,
    dtype: torch.dtype,
    max_positions: int,
    device: str = "cpu",
    cpu_kernels: bool = True,
    batch_invariant: bool = False,
) -> LlamaModel:
    """Instantiate the model of an HF directory and load all of its weights.

    bf16 on CPU: products of up to ``CpuKernels.matvec_rows`` rows, the RMSNorms and the
    attention use the own AVX2 kernels when ``cpu_kernels`` and they build; larger products
    run in fp32 where the CPU lacks bf16 GEMM (see ``Linear``); fp32 on CPU: torch's.
    ``batch_invariant`` (bf16 on CPU): the own kernels take
    every row (``kernels.batch_invariant``), or the model is refused naming why."""
    cfg = ArchConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions)
    model = model.to_empty(device=device).to(dtype)
    # The rope table is a non-persistent fp32 buffer: recompute it (meta holds no data and
    # the dtype cast above must not round it).
    model.rope_table = cos_sin_table(cfg.rope, cfg.head_dim, max_positions).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_weights(model, iter_safetensors(path), require_all=True)
    cpu_bf16 = dtype == torch.bfloat16 and device.startswith("cpu")
    model.set_fp32_batch_matmul(cpu_bf16 and not native_bf16_gemm() and not batch_invariant)
    if batch_invariant:
        set_cpu_kernels(model, _invariant_kernels(cpu_bf16 and cpu_kernels))
        if unfit := [m for m in model.modules() if isinstance(m, Attention) and m.kernel is None]:
            cfg = unfit[0].cfg
            raise ConfigError(f"batch_invariant: the own attention does not take this model's "
                              f"heads (head_dim {cfg.head_dim}, {cfg.num_heads} query heads "
                              f"over {cfg.num_kv_heads} KV heads)")
    elif cpu_kernels and device.startswith("cpu"):
        set_cpu_kernels(model, own_kernels() if cpu_bf16 else None)
    return model.eval().requires_grad_(False)


def _invariant_kernels(available: bool) -> CpuKernels:
    own = own_kernels() if available else None
    if own is None or own.matvec is None or own.norm is None or own.attention is None:
        why = build_error() or "they need bf16 on a CPU with AVX2 or AVX512"
        raise ConfigError(f"batch_invariant: the own CPU kernels are not available ({why})")
    return batch_invariant(own)
