"""Training data from the target itself: its responses to the prompt set and its features.

1. ``generate``: the target (through ``tlt_serve.LLM``, the server's dtype, all prompts in one
   continuous batch) answers every prompt; training prompts are sampled (temperature, one seed
   per prompt), held-out prompts are greedy, so the offline accept estimate on them measures
   exactly what greedy verification accepts.
2. ``target_features``: one teacher-forced forward of prompt + response through the target
   gives the final post-norm hidden state ``f_i`` of every position (what the engine hands a
   drafter). Pair i of a sequence is (f_i, x_{i+1}) and predicts f_{i+1} (see drafter.py).
   For a fused (EAGLE-3 style) drafter, ``teacher_forced`` also gives the input feature of
   each position (the residual streams after ``feature_layers``, concatenated) beside the
   final hidden state that is still what the drafter predicts.
3. ``build_draft_vocab``: the most frequent response tokens, for the sliced draft head.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.runner import extend_batch
from tlt_serve.llm import LLM
from tlt_serve.models.llama import LlamaModel
from tlt_serve.sampling_params import SamplingParams

PROMPT_SOURCES = ("both", "self", "templates")


@dataclass(frozen=True)
class DataConfig:
    num_prompts: int = 896  # training + held-out
    # Who writes the prompts (PROMPT_SOURCES): the target itself (its own user turns, see
    # selfprompts.py), templates (prompts.py), or both (half each, alternating). Measured on
    # the benchmark's prompts (trainer/README.md): both beat either alone at equal steps.
    prompts: str = "both"
    heldout_prompts: int = 32  # the last ones; generated greedily, never trained on
    max_new_tokens: int = 256
    temperature: float = 0.8
    max_num_seqs: int = 64  # engine rows while generating
    feature_batch_tokens: int = 4096  # padded tokens per teacher-forced forward
    draft_vocab_size: int = 8192  # 0 = the full target vocabulary
    # Target layers whose residual streams a fused (EAGLE-3 style) drafter reads, low / mid /
    # high; () = the final hidden state (EAGLE-1)
    feature_layers: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.prompts not in PROMPT_SOURCES:
            raise ValueError(f"prompts: {self.prompts!r} is not one of {PROMPT_SOURCES}")
        if self.num_prompts < 2:
            raise ValueError(f"num_prompts: must be >= 2, got {self.num_prompts}")
        if not 1 <= self.heldout_prompts < self.num_prompts:
            raise ValueError(
                f"heldout_prompts: must be in [1, num_prompts), got {self.heldout_prompts}"
            )
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens: must be >= 2, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.feature_batch_tokens < 1:
            raise ValueError(f"feature_batch_tokens: must be >= 1, got {self.feature_batch_tokens}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab: must be >= 0, got {self.draft_vocab_size}")
        layers = self.feature_layers
        if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"feature_layers: need distinct indices >= 0, got {list(layers)}")

    def check_layers(self, num_layers: int) -> None:
        """``feature_layers`` against a target of ``num_layers`` layers (ValueError)."""
        bad = [i for i in self.feature_layers if i >= num_layers]
        if bad:
            raise ValueError(f"feature_layers: {bad} outside the target's {num_layers} layers")


@dataclass(frozen=True)
class Sample:
    """One prompt + response of the target."""

    tokens: torch.Tensor  # [L] long: prompt then response
    features: torch.Tensor  # [L, F] the drafter's input features (the model's dtype)
    prompt_len: int
    # [L, H] the target's final hidden states, the training targets; None: ``features``
    # are those (EAGLE-1), not fused target layers
    targets: torch.Tensor | None = None

    @property
    def hidden(self) -> torch.Tensor:
        """[L, H] the final hidden states (what the drafter learns to predict)."""
        return self.features if self.targets is None else self.targets

    @property
    def num_pairs(self) -> int:
        return int(self.tokens.shape[0]) - 1


def generate(
    llm: LLM, prompt_ids: Sequence[list[int]], cfg: DataConfig, seed: int
) -> list[list[int]]:
    """The target's response to every prompt: sampled, except the held-out tail (greedy)."""
    n_train = len(prompt_ids) - cfg.heldout_prompts
    params = [
        SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature if i < n_train else 0.0,
            seed=seed * 1_000_003 + i,
        )
        for i in range(len(prompt_ids))
    ]
    results = llm.generate(list(prompt_ids), params, use_tqdm=True)
    return [r.samples[0].token_ids for r in results]


@torch.inference_mode()
def target_features(
    model: LlamaModel, sequences: Sequence[list[int]], batch_tokens: int
) -> list[torch.Tensor]:
    """Teacher-forced forward of each token sequence → its final hidden states [L, H]."""
    return teacher_forced(model, sequences, batch_tokens)[0]


def teacher_forced(
    model: LlamaModel,
    sequences: Sequence[list[int]],
    batch_tokens: int,
    layers: Sequence[int] = (),
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence its final hidden states [L, H] and, with ``layers``, its fused input
    features [L, len(layers) * H] (the residual streams after those layers, concatenated as
    the engine does; else none), in the model's dtype.

    Sequences run in length-sorted batches of at most ``batch_tokens`` padded tokens, each
    in a fresh KV cache sized to the batch.
    """
    dtype = model.embed_tokens.weight.dtype
    device = str(model.embed_tokens.weight.device)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    aux: list[torch.Tensor | None] = [None] * len(sequences)
    bar = tqdm(total=sum(len(s) for s in sequences), desc="features", unit="tok")
    lo = 0
    while lo < len(order):
        hi = lo + 1
        while hi < len(order) and (hi + 1 - lo) * len(sequences[order[hi]]) <= batch_tokens:
            hi += 1
        group = [sequences[i] for i in order[lo:hi]]
        max_len = max(len(s) for s in group)
        kv = KVCache(model.cfg, len(group), max_len, dtype, device)
        fb, ids = extend_batch(kv, 0, [0] * len(group), group, device, pack=True)
        run = model(ids, fb, kv.layers, tuple(layers))
        fused = torch.cat(run.aux, dim=-1) if layers else None  # [B, Q, kH]
        for b, i in enumerate(order[lo:hi]):
            out[i] = run.hidden[b, : len(sequences[i])].clone()  # [L, H]
            if fused is not None:
                aux[i] = fused[b, : len(sequences[i])].clone()  # [L, kH]
        bar.update(sum(len(s) for s in group))
        lo = hi
    bar.close()
    return [f for f in out if f is not None], [f for f in aux if f is not None]


def build_draft_vocab(
    responses: Sequence[list[int]], prompts: Sequence[list[int]], size: int, vocab_size: int
) -> torch.Tensor:
    """The ``size`` most frequent response tokens (ties: lower id first) → int64 [size].

    Fewer distinct response tokens: filled with the most frequent prompt tokens, then the
    lowest unused ids.
    """
    size = min(size, vocab_size)
    chosen: list[int] = []
    taken: set[int] = set()
    for source in (responses, prompts):
        counts = Counter(t for seq in source for t in seq)
        for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) == size:
                break
            if tok not in taken:
                chosen.append(tok)
                taken.add(tok)
    tok = 0
    while len(chosen) < size:
        if tok not in taken:
            chosen.append(tok)
        tok += 1
    return torch.tensor(chosen, dtype=torch.long)


def make_samples(
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    features: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] | None = None,
) -> list[Sample]:
    """``targets``: the final hidden states when ``features`` are fused target layers."""
    hidden: Sequence[torch.Tensor | None] = [None] * len(features) if targets is None else targets
    return [
        Sample(torch.tensor(p + r, dtype=torch.long), f, len(p), t)
        for p, r, f, t in zip(prompts, responses, features, hidden, strict=True)
    ]
