"""What a drafter borrows from its target, as an fp32 stand-in model for training.

The drafter reads the target's embedding, final norm, lm_head and rotary table, never its
layers. Training holds exactly these (from a loaded model, or from the server's
``/drafter/target`` feed) in a layer-less ``LlamaModel``; their values are the target's (bf16
weights become the same values in fp32), so what is learnt transfers to the served target.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from tlt_serve.models.arch import ArchConfig
from tlt_serve.models.llama import LlamaModel
from tlt_serve.models.rope import cos_sin_table

EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def head_stub(
    cfg: ArchConfig, tensors: Mapping[str, torch.Tensor], max_positions: int
) -> LlamaModel:
    """A frozen fp32 ``LlamaModel`` without layers holding ``tensors`` (HF names; the head
    may be absent when tied to the embedding)."""
    cfg = replace(cfg, num_layers=0)
    with torch.device("meta"):
        stub = LlamaModel(cfg, max_positions)
    device = tensors[EMBED].device
    stub = stub.to_empty(device=device).float()
    if cfg.tie_word_embeddings:
        stub.lm_head.weight = stub.embed_tokens.weight
    stub.rope_table = cos_sin_table(cfg.rope, cfg.head_dim, max_positions).to(device)
    update_stub(stub, tensors)
    return stub.eval().requires_grad_(False)


def update_stub(stub: LlamaModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a new target's embedding / norm / head into ``stub`` in place (the drafter keeps
    its reference); call the drafter's ``refresh_head`` afterwards."""
    with torch.no_grad():
        stub.embed_tokens.weight.copy_(tensors[EMBED].float())
        stub.norm.weight.copy_(tensors[NORM].float())
        if not stub.cfg.tie_word_embeddings:
            stub.lm_head.weight.copy_(tensors[HEAD].float())


def borrowed_tensors(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The tensors a drafter borrows from a loaded target, under HF names."""
    out = {EMBED: model.embed_tokens.weight, NORM: model.norm.weight}
    if not model.cfg.tie_word_embeddings:
        out[HEAD] = model.lm_head.weight
    return {k: v.detach() for k, v in out.items()}


def head_target(model: LlamaModel, max_positions: int) -> LlamaModel:
    """The fp32 stand-in for a loaded target."""
    return head_stub(model.cfg, borrowed_tensors(model), max_positions)
