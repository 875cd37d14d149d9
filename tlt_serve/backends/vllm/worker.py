"""Our extension of vLLM's worker (``worker_extension_cls``): what the engine process asks
of the models through ``collective_rpc``. vLLM mixes this class into its worker, so ``self``
is the worker; the methods are prefixed ``tlt_`` (vLLM refuses names its worker has). Tensors
travel as safetensors files the engine process names (``collective_rpc`` arguments must be
plain values).

Weights are reloaded in place through vLLM's layer-wise reload: on a CPU, vLLM keeps each
linear layer's weight only in a packed oneDNN copy, so a plain ``load_weights`` or a copy
into the parameters would not reach what the kernels read. A head tied to the embedding is
re-packed after the reload (vLLM's reload processes a tied parameter for one of its owners
only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _repack_tied_head(model: Any) -> None:
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if head is None or not getattr(config, "tie_word_embeddings", False):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class TltWorker:
    model_runner: Any  # vLLM's
    vllm_config: Any

    def tlt_load_target(self, files: list[str]) -> int:
        """Reload the target's weights from safetensors ``files`` (HF names) in place."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in _tensors(files):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        _repack_tied_head(self.model_runner.model)
        return count

    def tlt_load_drafter(self, files: list[str]) -> int:
        """Reload the EAGLE drafter's weights (vLLM's EAGLE-1 names: ``fc.*``,
        ``layers.0.*``) from safetensors ``files`` in place."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        tensors = list(_tensors(files))
        with set_current_vllm_config(self.vllm_config):
            reload_weights(self.vllm_config, self.model_runner.get_draft_model(),
                           weights_iterator=iter(tensors), weights_path=None,
                           is_checkpoint_format=True)
        return len(tensors)

    def tlt_save_target(self, path: str, meta: dict[str, str]) -> None:
        """Write the target's embedding, final norm and (untied) head to ``path``, as the
        native engine's trainer feed has them."""
        from safetensors.torch import save_file

        model = self.model_runner.model
        tensors = {
            "model.embed_tokens.weight": model.model.embed_tokens.weight,
            "model.norm.weight": model.model.norm.weight,
        }
        if not getattr(model.config, "tie_word_embeddings", False):
            tensors["lm_head.weight"] = model.lm_head.weight
        save_file({k: v.detach().float().contiguous() for k, v in tensors.items()}, path,
                  metadata=meta)
