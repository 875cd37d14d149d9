"""The policy side of an RL loop on CPU: a trainable copy of the target, its response
log-probabilities, and checkpoints the server loads with ``/update_weights_from_disk``.

The policy is the Hugging Face model of the served checkpoint, in fp32. Only the response
positions go through the output head (the prompt's logits are never needed), and the tied
embedding / head is frozen by default: it is a quarter of the parameters and most of the
backward cost here, and fine-tuning the decoder layers is enough to move the outputs.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class Batch:
    """Right-padded prompt + response rows; ``mask`` marks the response tokens."""

    ids: torch.Tensor  # [B, L] long
    attention: torch.Tensor  # [B, L] long (1 = real token)
    mask: torch.Tensor  # [B, L] bool: positions whose token is a response token


def load_policy(path: str | Path, train_embeddings: bool = False) -> Any:
    """The HF causal LM at ``path`` in fp32. Kept in eval mode (gradients still flow): no
    dropout, so its log-probabilities are the ones the server computes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    if not train_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
        model.get_output_embeddings().weight.requires_grad_(False)
    return model


def make_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int = 0
) -> Batch:
    rows = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), L), dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.bool)
    for i, (row, p) in enumerate(zip(rows, prompts, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        mask[i, len(p) : len(row)] = True
    return Batch(ids, attention, mask)


def response_logprobs(model: Any, batch: Batch) -> torch.Tensor:
    """log p(token) of every response token, flattened in row order: [N] (N = mask.sum())."""
    hidden = model.model(input_ids=batch.ids, attention_mask=batch.attention).last_hidden_state
    # Position t predicts token t+1: the hidden state before each response token.
    pred = batch.mask[:, 1:]  # [B, L-1]
    h = hidden[:, :-1][pred]  # [N, H]
    logits = model.lm_head(h).float()  # [N, V]
    targets = batch.ids[:, 1:][pred]  # [N]
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def save_policy(model: Any, source: str | Path, out: str | Path) -> Path:
    """Save the weights (safetensors) plus the tokenizer files of ``source`` to ``out``.

    Written to a sibling temp directory and renamed, so ``out`` is complete or absent."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
