"""Make vLLM's EAGLE-1 Llama drafter compute what our drafter computes.

vLLM's ``EagleLlamaForCausalLM`` (``model_executor/models/llama_eagle.py``, vllm 0.32) has
an fc without bias and drafts over the whole vocabulary; ours may have an fc bias and a
draft vocabulary (the head sliced to the tokens it was trained on). Exported as is, our
drafter loses both in vLLM and accepts fewer drafts than natively. The vLLM backend exports
both (marked in the drafter's config as ``tlt_vllm``), and this patch, applied in vLLM's
worker process before it builds the drafter (our worker extension imports it), gives such a
drafter:

- an fc built with a bias (loaded with the other weights, reloaded in place on a swap);
- a mask of its draft vocabulary: logits of other tokens are set to -inf, so it proposes
  only tokens its head was trained on, as natively. The mask is a buffer filled once, so a
  captured CUDA graph reads it in place.

A drafter without ``tlt_vllm`` in its config (e.g. from ``tlt-train export-vllm``, for plain
vLLM) is built exactly as vLLM builds it. Tied to vLLM's internals: the backend pins the
version, and the tests check the drafter's accept length on vLLM against the native one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

MARK = "tlt_vllm"  # config key of a drafter exported for the vLLM backend
DRAFT_VOCAB = "draft_vocab"  # checkpoint tensor: target token id of each draft-head row
_applied = False


def marks(config: Any) -> dict[str, Any]:
    value = getattr(config, MARK, None)
    return dict(value) if isinstance(value, dict) else {}


def split_draft_vocab(
    weights: Iterable[tuple[str, torch.Tensor]], sink: list[torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights without ``draft_vocab``, which goes to ``sink``."""
    for name, tensor in weights:
        if name.split(".")[-1] == DRAFT_VOCAB:
            sink.append(tensor)
        else:
            yield name, tensor


def set_draft_vocab(model: Any, ids: torch.Tensor) -> None:
    """Fill the drafter's vocabulary mask from the token ids it may propose."""
    mask = model.tlt_draft_mask
    mask.fill_(False)
    mask[ids.to(device=mask.device, dtype=torch.long)] = True


def apply() -> None:
    """Patch vLLM's EAGLE-1 Llama drafter classes (once per process)."""
    global _applied
    if _applied:
        return
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.models import llama_eagle
    from vllm.model_executor.models.utils import maybe_prefix

    model_init = llama_eagle.LlamaModel.__init__

    @functools.wraps(model_init)  # vLLM reads the constructor's signature
    def init_model(self: Any, *args: Any, **kw: Any) -> None:
        model_init(self, *args, **kw)
        if marks(self.config).get("fc_bias"):
            old = self.fc
            self.fc = ReplicatedLinear(
                input_size=old.input_size, output_size=old.output_size, bias=True,
                params_dtype=old.params_dtype, quant_config=self.quant_config,
                prefix=maybe_prefix(kw.get("prefix", ""), "fc"), return_bias=False,
            )

    causal: Any = llama_eagle.EagleLlamaForCausalLM
    causal_init, logits_of, load = causal.__init__, causal.compute_logits, causal.load_weights

    @functools.wraps(causal_init)
    def init_causal(self: Any, *args: Any, **kw: Any) -> None:
        causal_init(self, *args, **kw)
        if marks(self.config).get("draft_vocab"):
            device = next(self.parameters()).device
            mask = torch.ones(self.config.vocab_size, dtype=torch.bool, device=device)
            self.register_buffer("tlt_draft_mask", mask, persistent=False)

    @functools.wraps(logits_of)
    def compute_logits(self: Any, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = logits_of(self, hidden_states)  # [T, V]
        mask = getattr(self, "tlt_draft_mask", None)
        if logits is None or mask is None:
            return logits
        return logits.masked_fill(~mask[: logits.shape[-1]], float("-inf"))

    @functools.wraps(load)
    def load_weights(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        vocab: list[torch.Tensor] = []
        out = load(self, split_draft_vocab(weights, vocab))
        if vocab and hasattr(self, "tlt_draft_mask"):
            set_draft_vocab(self, vocab[-1])
        return out

    llama_eagle.LlamaModel.__init__ = init_model  # type: ignore[method-assign]
    causal.__init__ = init_causal
    causal.compute_logits = compute_logits
    causal.load_weights = load_weights
    _applied = True
