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

from tlt_serve.backends.vllm import eagle_patch

eagle_patch.apply()  # before vLLM builds the drafter in this (its worker) process


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

        vocab: list[torch.Tensor] = []
        tensors = list(eagle_patch.split_draft_vocab(_tensors(files), vocab))
        model = self.model_runner.get_draft_model()
        with set_current_vllm_config(self.vllm_config):
            reload_weights(self.vllm_config, model, weights_iterator=iter(tensors),
                           weights_path=None, is_checkpoint_format=True)
        if vocab:
            eagle_patch.set_draft_vocab(model, vocab[-1])
        return len(tensors) + len(vocab)

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
        # To the host before fp32: converted on the GPU, the embedding and head would get
        # fp32 copies there (twice their bf16 size) beside the served model.
        save_file({k: v.detach().cpu().float().contiguous() for k, v in tensors.items()},
                  path, metadata=meta)

    # ---- the model runner this backend reaches into ----------------------------------------
    def tlt_probe(self) -> dict[str, Any]:
        """What the backend relies on in vLLM's model runner (``runner.check_runner``)."""
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        batch = getattr(runner, "input_batch", None)
        draft_model = (runner.get_draft_model() if hasattr(runner, "get_draft_model")
                       else None)
        return {
            "runner": type(runner).__name__,
            "req_ids": isinstance(getattr(batch, "req_ids", None), list),
            "get_draft_model": hasattr(runner, "get_draft_model"),
            "drafter": None if drafter is None else type(drafter).__name__,
            "propose": callable(getattr(drafter, "propose", None)),
            "draft_model": None if draft_model is None else type(draft_model).__name__,
        }

    # ---- capture: the target features vLLM hands its EAGLE drafter --------------------------
    def tlt_capture_start(self) -> bool:
        """Keep, per request, the target's final hidden state of every position it commits,
        as vLLM passes them to its EAGLE drafter each step (prefill chunks whole; of a verify
        step's [last token, drafts] only the accepted prefix): the drafter's own inputs, at
        no extra compute and without a host sync (``step_copy.py``). False when no EAGLE
        drafter runs (nothing to hook)."""
        from tlt_serve.backends.vllm.step_copy import StepCopies

        drafter = getattr(self.model_runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "propose"):
            return False
        self._tlt_steps = StepCopies()
        propose = drafter.propose

        def capturing(**kw: Any) -> Any:
            starts = kw["common_attn_metadata"].query_start_loc_cpu.tolist()  # [R + 1]
            self._tlt_steps.add(
                self.model_runner.input_batch.req_ids[: len(starts) - 1], starts,
                kw["target_token_ids"], kw["target_positions"], kw["target_hidden_states"],
                kw.get("num_rejected_tokens_gpu"))
            return propose(**kw)

        drafter.propose = capturing
        return True

    def tlt_capture_take(self, rids: list[str], path: str) -> list[str]:
        """Write the kept positions of the finished requests ``rids`` to ``path`` (per
        request i: ``i.start`` the first position, ``i.tokens`` [m], ``i.features`` [m, H];
        only requests whose positions are contiguous) and forget them; returns the rids
        written, in their order."""
        from safetensors.torch import save_file

        out: dict[str, torch.Tensor] = {}
        written: list[str] = []
        for rid in rids:
            segments = self._tlt_steps.take(rid)
            if not segments or any(s[0] + len(s[1]) != t[0]
                                   for s, t in zip(segments, segments[1:], strict=False)):
                continue
            i = len(written)
            out[f"{i}.start"] = torch.tensor([segments[0][0]])
            out[f"{i}.tokens"] = torch.cat([s[1] for s in segments])
            out[f"{i}.features"] = torch.cat([s[2] for s in segments])
            written.append(rid)
        save_file(out, path)
        return written

    def tlt_capture_drop(self, rids: list[str]) -> None:
        for rid in rids:
            self._tlt_steps.drop(rid)
