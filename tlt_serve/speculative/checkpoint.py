"""Drafter checkpoint directories: ``config.json`` + ``model.safetensors``, validated on load.

Layout (EAGLE-1 compatible names, so vLLM / SGLang EAGLE loaders read the tensors):

- ``config.json``: the target's HF config with ``num_hidden_layers: 1`` and
  ``architectures: ["LlamaForCausalLMEagle"]``, plus a ``tlt_drafter`` section:
  ``{"format": 1, "feature_layers": [...], "draft_vocab_size": N, "version": V,
  "target_weight_version": "..."}``.
- ``model.safetensors``: ``fc.weight`` [H, 2H] and ``fc.bias`` [H] over
  ``cat(embedding, feature)``; ``fuse.weight`` [H, kH] and ``fuse_norm.weight`` [H]
  when fusing k target layers;
  ``layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm}``
  (+ q/k norms or qkv biases as the architecture has); ``draft_vocab`` int64 [N] when the
  head is sliced. No embedding or lm_head: those are the target's.

Loading refuses, naming the mismatch: a missing or unreadable directory, a drafter whose
hidden size, vocabulary, heads or architecture differ from the target, unknown / missing /
misshapen tensors. Saving is atomic (written beside, then renamed into place).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tlt_serve.models.arch import ArchConfig
from tlt_serve.models.llama import LlamaModel, set_cpu_kernels, set_fp32_copies
from tlt_serve.models.loader import (
    ParamSlot,
    WeightError,
    iter_safetensors,
    load_weights,
    param_slot,
)
from tlt_serve.speculative.drafter import DrafterModel, DrafterSpec

FORMAT = 1
# Fields that must equal the target's for the drafter to read its features and share its
# embedding / head / rotary layout.
_MUST_MATCH = ("model_type", "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim")


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used with this target; the message says why."""


def drafter_hf_config(target_hf: dict[str, Any], spec: DrafterSpec) -> dict[str, Any]:
    """The config.json of a drafter for a target with HF config ``target_hf``."""
    cfg = {k: v for k, v in target_hf.items() if k not in ("quantization_config", "auto_map")}
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle"])
    cfg["tlt_drafter"] = {
        "format": FORMAT,
        "feature_layers": list(spec.feature_layers),
        "draft_vocab_size": spec.draft_vocab_size,
        "version": spec.version,
        "target_weight_version": spec.target_weight_version,
    }
    return cfg


def read_drafter_config(path: str | Path) -> tuple[dict[str, Any], ArchConfig, DrafterSpec]:
    """Parse ``path/config.json``; DrafterError when missing, unreadable or not a drafter."""
    path = Path(path)
    file = path / "config.json"
    if not path.is_dir():
        raise DrafterError(f"drafter: {path} is not a directory")
    try:
        raw = json.loads(file.read_text())
        meta = raw["tlt_drafter"]
        spec = DrafterSpec(
            feature_layers=tuple(int(i) for i in meta.get("feature_layers", ())),
            draft_vocab_size=int(meta.get("draft_vocab_size", 0)),
            version=int(meta.get("version", 0)),
            target_weight_version=str(meta.get("target_weight_version", "")),
        )
        arch = ArchConfig.from_hf_dict(raw)
    except FileNotFoundError as err:
        raise DrafterError(f"drafter: no config.json in {path}") from err
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DrafterError(f"drafter: unreadable config.json in {path}: {err!r}") from err
    if int(meta.get("format", 0)) != FORMAT:
        raise DrafterError(f"drafter: format {meta.get('format')!r} is not {FORMAT}")
    return raw, arch, spec


def check_compatible(arch: ArchConfig, spec: DrafterSpec, target: ArchConfig) -> None:
    """DrafterError naming every field in which the drafter does not fit the target."""
    bad = [
        f"{name} {getattr(arch, name)} != target's {getattr(target, name)}"
        for name in _MUST_MATCH
        if getattr(arch, name) != getattr(target, name)
    ]
    if arch.num_layers != 1:
        bad.append(f"num_hidden_layers {arch.num_layers} != 1")
    out_of_range = [i for i in spec.feature_layers if not 0 <= i < target.num_layers]
    if out_of_range:
        bad.append(f"feature_layers {out_of_range} outside the target's {target.num_layers}")
    if not 0 <= spec.draft_vocab_size <= target.vocab_size:
        bad.append(f"draft_vocab_size {spec.draft_vocab_size} not in [0, {target.vocab_size}]")
    if bad:
        raise DrafterError("drafter does not fit the target: " + "; ".join(bad))


def load_drafter(path: str | Path, target: LlamaModel) -> DrafterModel:
    """Build and load a drafter for ``target`` (same dtype / device, same CPU kernels)."""
    _, arch, spec = read_drafter_config(path)
    check_compatible(arch, spec, target.cfg)
    like = target.embed_tokens.weight
    model = DrafterModel(arch, spec, target).to(device=like.device, dtype=like.dtype)
    tensors = dict(read_tensors(Path(path)))
    vocab = tensors.pop("draft_vocab", None)
    if spec.draft_vocab_size:
        if vocab is None or tuple(vocab.shape) != (spec.draft_vocab_size,):
            raise DrafterError(f"drafter: draft_vocab must be int64 [{spec.draft_vocab_size}]")
        if int(vocab.min()) < 0 or int(vocab.max()) >= target.cfg.vocab_size:
            raise DrafterError("drafter: draft_vocab holds ids outside the target vocabulary")
        model.draft_vocab.copy_(vocab.long())
    try:
        load_weights(model, tensors.items(), require_all=True, slot_of=_slot_of(arch, spec))
    except WeightError as err:
        raise DrafterError(f"drafter: {err}") from err
    set_fp32_copies(model, target.fp32_batch_matmul)
    set_cpu_kernels(model, target.kernels)
    model.refresh_head()
    return model.eval().requires_grad_(False)


def read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name; DrafterError when missing or unreadable."""
    try:
        yield from iter_safetensors(path)
    except FileNotFoundError as err:
        raise DrafterError(f"drafter: no *.safetensors in {path}") from err
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise DrafterError(f"drafter: unreadable weights in {path}: {err!r}") from err


def _slot_of(arch: ArchConfig, spec: DrafterSpec):  # type: ignore[no-untyped-def]
    fused = {"fuse.weight", "fuse_norm.weight"} if spec.feature_layers else set()
    own = {"fc.weight", "fc.bias"} | fused

    def slot(name: str) -> ParamSlot | None:
        if name in own:
            return ParamSlot(name)
        if not name.startswith("layers.0.") or name.startswith("layers.0.input_layernorm"):
            raise WeightError(f"unknown drafter weight name {name!r}")
        return param_slot(arch, "model." + name)

    return slot


def drafter_tensors(model: DrafterModel) -> dict[str, torch.Tensor]:
    """The drafter's tensors under checkpoint (HF / EAGLE) names, fused projections split."""
    cfg = model.cfg
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        t = param.detach().contiguous()
        if ".qkv_proj." in name:
            base, kind = name.split(".qkv_proj.")
            for part, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                out[f"{base}.{part}_proj.{kind}"] = t[lo:hi].clone()
        elif ".gate_up_proj." in name:
            base, kind = name.split(".gate_up_proj.")
            out[f"{base}.gate_proj.{kind}"] = t[:inter].clone()
            out[f"{base}.up_proj.{kind}"] = t[inter:].clone()
        else:
            out[name] = t.clone()
    if model.spec.draft_vocab_size:
        out["draft_vocab"] = model.draft_vocab.detach().long().clone()
    return out


def save_drafter(
    model: DrafterModel, path: str | Path, target_hf: dict[str, Any], spec: DrafterSpec
) -> Path:
    """Write a checkpoint directory atomically: a reader sees the old one or the new one."""
    config = json.dumps(drafter_hf_config(target_hf, spec), indent=2)
    return write_dir(Path(path), drafter_tensors(model), config)


def write_dir(path: Path, tensors: dict[str, torch.Tensor], config_json: str) -> Path:
    """``model.safetensors`` + ``config.json`` into ``path``, atomically (written beside,
    then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(config_json)
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
