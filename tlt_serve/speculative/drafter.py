"""EAGLE-style drafter: one decoder layer over [token embedding, target feature].

Pair i of a sequence is (f_i, x_{i+1}): the target's feature at position i and the token that
followed it. The drafter maps ``fc(cat(embed(x_{i+1}), f_i))`` through ONE decoder layer of the
target's architecture (input norm replaced by identity, as EAGLE-1) at rotary position i and
outputs a predicted feature ``f̂_{i+1}``; ``lm_head(f̂_{i+1})`` scores x_{i+2}. While drafting,
the predicted feature is fed back as the next pair's feature.

Features: by default the target's final (post-norm) hidden state, the same space the lm_head
reads, so drafter outputs need no norm (EAGLE-1). With ``feature_layers`` (EAGLE-3 style
fusion) the feature of a committed position is the concatenation of the residual streams after
those target layers, projected by ``fuse`` (kH → H); drafted positions feed back the
drafter's own output as EAGLE-3 does.

The embedding and lm_head are the TARGET's, shared by reference and never trained here: after
an RL weight update the drafter reads the new ones. An optional draft vocabulary (the most
frequent tokens) slices the head: proposing only among them is still lossless (verification is
exact) and cuts the drafter's largest matmul several-fold.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from tlt_serve.models.arch import ArchConfig
from tlt_serve.models.batch import ForwardBatch
from tlt_serve.models.llama import DecoderLayer, KVLayer, Linear, LlamaModel, RMSNorm


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter is, beyond its layer's architecture (saved in ``config.json``)."""

    feature_layers: tuple[int, ...] = ()  # () = target's final hidden (EAGLE-1)
    draft_vocab_size: int = 0  # 0 = the full target vocabulary
    version: int = 0  # increases with every published training result
    target_weight_version: str = ""  # the target weights it was last trained against


class DrafterModel(nn.Module):
    """fc (+ optional fuse) + one decoder layer; embedding and head borrowed from the target."""

    def __init__(self, cfg: ArchConfig, spec: DrafterSpec, target: LlamaModel) -> None:
        super().__init__()
        if cfg.num_layers != 1:
            raise ValueError(f"num_hidden_layers: a drafter has 1 layer, got {cfg.num_layers}")
        self.cfg = cfg
        self.spec = spec
        H = cfg.hidden_size
        if spec.feature_layers:
            self.fuse = Linear(H * len(spec.feature_layers), H, bias=False)
            # Residual streams inside the target are far from the final (normed) hidden
            # state's scale and grow with depth; projected as they are, a fresh drafter's
            # outputs were ~10x off and warm-up diverged (loss 17 -> 130 within 50 steps at
            # lr 2e-3). A norm after the projection puts them on the scale of the drafter's
            # own fed-back outputs (EAGLE-3 normalizes its fused hidden states too).
            self.fuse_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: no norm on the fc output
        self.register_buffer(
            "draft_vocab", torch.zeros(spec.draft_vocab_size, dtype=torch.long), persistent=True
        )
        # Borrowed, not owned: a plain attribute keeps the target out of parameters/state.
        self.__dict__["target"] = target
        # Derived from the target's head (refresh_head), so not a submodule: never saved,
        # never trained, never moved by .to().
        self.__dict__["head"] = None

    target: LlamaModel
    head: Linear | None  # the target's lm_head rows of draft_vocab (None: full head)
    draft_vocab: torch.Tensor  # [Vd] long: target token id of each draft-head row

    def __deepcopy__(self, memo: dict[int, Any]) -> DrafterModel:
        """Its own weights, the same target: a copy (the trainer's served drafter, a
        candidate) must read the target's head as it is updated in place, and the fp32
        target stand-in is hundreds of MB at real vocabulary sizes. The sliced head is only
        ever replaced, never written, so the copy shares it until its own refresh_head."""
        memo[id(self.target)] = self.target
        memo[id(self.head)] = self.head
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def forward(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        batch: ForwardBatch,
        kv: KVLayer,
        fused: bool = False,
    ) -> torch.Tensor:
        """token_ids [B, Q], features [B, Q, F] → predicted features [B, Q, H].

        ``fused``: features are already H-wide (drafter outputs fed back); otherwise they
        are target features (F = kH, projected by ``fuse`` when configured).
        """
        if self.spec.feature_layers and not fused:
            features = self.fuse_norm(self.fuse(features))  # [B, Q, kH] -> [B, Q, H]
        emb = self.target.embed_tokens(token_ids).to(features.dtype)  # [B, Q, H]
        x = self.fc(torch.cat([emb, features], dim=-1))  # [B, Q, H]
        table: torch.Tensor = self.target.rope_table  # type: ignore[assignment]  # same rotary
        rope = table[batch.positions].to(x.dtype)  # [B, Q, 2, D] (cos, sin)
        return self.layers[0](x, rope, batch, kv)  # type: ignore[no-any-return]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] → fp32 logits [N, Vd] over the draft vocabulary (or the full one)."""
        if self.head is None:
            return self.target.logits(hidden)
        return self.head(hidden, out_dtype=torch.float32)

    def to_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into ``draft_logits``' last axis → target token ids."""
        if self.head is None:
            return index
        return self.draft_vocab[index]

    def refresh_head(self) -> None:
        """(Re)slice the target's lm_head to the draft vocabulary; call after target updates."""
        if not self.spec.draft_vocab_size:
            self.__dict__["head"] = None
            return
        src = self.target.lm_head
        vocab = self.draft_vocab
        head = Linear(self.cfg.hidden_size, len(vocab), bias=False).to(src.weight)
        with torch.no_grad():
            head.weight.copy_(src.weight[vocab])
        head.matvec, head.matvec_rows = src.matvec, src.matvec_rows  # the target head's
        head.set_fp32_copy(src.weight_f32 is not None)
        self.__dict__["head"] = head.requires_grad_(False)


def feature_of(
    hidden: torch.Tensor, aux: tuple[torch.Tensor, ...], spec: DrafterSpec
) -> torch.Tensor:
    """The target feature a drafter with ``spec`` reads: [..., H] or [..., kH]."""
    if not spec.feature_layers:
        return hidden
    return torch.cat(aux, dim=-1)


def new_drafter(target: LlamaModel, spec: DrafterSpec, seed: int = 0) -> DrafterModel:
    """A freshly initialised drafter for ``target`` (fp32, trainable, on the target's device).

    ``fc`` starts as a pass-through of the feature half (embedding half zero, no bias), so
    before any training the drafter predicts roughly "the same feature again".
    """
    cfg = replace(target.cfg, num_layers=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DrafterModel(cfg, spec, target).to(target.embed_tokens.weight.device)
    H = cfg.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, H:].copy_(torch.eye(H, device=model.fc.weight.device))
        model.fc.bias.zero_()
    return model
