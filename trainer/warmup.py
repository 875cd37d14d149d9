"""``tlt-train warmup``: a drafter for a target from the target's own outputs, end to end.

generate (target answers the prompt set) → features (teacher-forced target forward) →
train (EAGLE loss, fp32 drafter) → evaluate (offline accept length on greedy held-out
responses) → save (``save_drafter`` checkpoint + ``warmup.json`` with settings and numbers).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch

from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig
from tlt_serve.llm import LLM
from tlt_serve.models.loader import build_model
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer
from tlt_serve.speculative.checkpoint import save_drafter
from tlt_serve.speculative.drafter import DrafterModel, DrafterSpec, new_drafter
from trainer.data import (
    DataConfig,
    Sample,
    build_draft_vocab,
    generate,
    make_samples,
    teacher_forced,
)
from trainer.evaluate import AcceptStats, offline_accept, prepare_heldout
from trainer.packing import batches
from trainer.prompts import build_prompts
from trainer.selfprompts import SELF_PROMPT_TOKENS, self_prompts
from trainer.target import head_target
from trainer.train import History, TrainConfig, train

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class WarmupConfig:
    model: str = "smollm2-135m"
    out: str = ""
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    dtype: str = "bfloat16"  # the target's dtype while generating and computing features
    eval_depth: int = 4  # chain depth of the offline accept estimate (the engine's default)
    data_cache: str | None = None  # file keeping generated data + features for later runs
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        if not self.out:
            raise ValueError("out: an output directory is required")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if not 1 <= self.eval_depth <= 16:
            raise ValueError(f"eval_depth: must be in [1, 16], got {self.eval_depth}")
        self.data.validate()
        self.train.validate()


@dataclass(frozen=True)
class WarmupResult:
    path: Path
    history: History
    accept: AcceptStats  # trained drafter, offline
    accept_untrained: AcceptStats  # the freshly initialised drafter, same held-out data
    report: dict[str, Any]  # what warmup.json holds


def warmup(cfg: WarmupConfig) -> WarmupResult:
    """Run all phases; torch's thread count is restored afterwards."""
    cfg.validate()
    threads = torch.get_num_threads()
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        return _warmup(cfg)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Collected:
    """The target's data: prompts, responses and the samples with their features."""

    prompts: list[list[int]]
    responses: list[list[int]]
    samples: list[Sample]
    max_len: int  # longest sequence + 1 (the engine's max_model_len while generating)


def collect(cfg: WarmupConfig, model_path: Path, timings: dict[str, float]) -> Collected:
    """Generate the responses and compute the features (or load them from ``data_cache``)."""
    key = _cache_key(cfg, model_path)
    cache = Path(cfg.data_cache) if cfg.data_cache else None
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=True)
        if saved.get("key") == key:
            samples = make_samples(
                saved["prompts"], saved["responses"], saved["features"], saved.get("targets")
            )
            timings.update({f"cached_{k}": v for k, v in saved["timings"].items()})
            return Collected(saved["prompts"], saved["responses"], samples, saved["max_len"])
    tokenizer = load_tokenizer(model_path)

    def chat(texts: list[str]) -> list[list[int]]:
        return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]

    n = cfg.data.num_prompts
    n_self = {"self": n, "both": n // 2, "templates": 0}[cfg.data.prompts]
    templates = chat(build_prompts(n - n_self, cfg.seed)) if n > n_self else []
    # The target writes its n_self prompts below; re-encoding one may take a few more tokens.
    room = [len(chat([""])[0]) + SELF_PROMPT_TOKENS + 32] if n_self else []
    longest = max([len(p) for p in templates] + room)
    t = time.perf_counter()
    llm = LLM(
        config=EngineConfig(
            model=ModelConfig(
                model=str(model_path),
                dtype=cfg.dtype,
                max_model_len=longest + cfg.data.max_new_tokens + 1,
            ),
            cache=CacheConfig(max_num_seqs=cfg.data.max_num_seqs),
            seed=cfg.seed,
            num_threads=cfg.threads,
        )
    )
    cfg.data.check_layers(llm.engine.model.cfg.num_layers)  # before minutes of generation
    if n_self:
        written = chat(self_prompts(llm, tokenizer, n_self, cfg.seed))
        timings["prompts_s"] = time.perf_counter() - t
        t = time.perf_counter()
    else:
        written = []
    # Alternating, so the held-out tail holds both sources.
    prompts = [p for pair in zip_longest(templates, written) for p in pair if p is not None]
    max_len = max(len(p) for p in prompts) + cfg.data.max_new_tokens + 1
    responses = generate(llm, prompts, cfg.data, cfg.seed)
    timings["generate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    target = llm.engine.model
    del llm  # frees the engine's KV cache; the model lives on
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    hidden, fused = teacher_forced(
        target, seqs, cfg.data.feature_batch_tokens, cfg.data.feature_layers
    )
    # A fused drafter reads the fused layers and learns to predict the final hidden states.
    feats, targets = (fused, hidden) if cfg.data.feature_layers else (hidden, None)
    timings["features_s"] = time.perf_counter() - t
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "key": key,
                "prompts": prompts,
                "responses": responses,
                "features": feats,
                "targets": targets,
                "max_len": max_len,
                "timings": dict(timings),
            },
            cache,
        )
    samples = make_samples(prompts, responses, feats, targets)
    return Collected(prompts, responses, samples, max_len)


def _cache_key(cfg: WarmupConfig, model_path: Path) -> str:
    """What the cached data depends on: the target, its dtype, the seed and DataConfig."""
    data = {k: v for k, v in asdict(cfg.data).items() if k != "draft_vocab_size"}
    return json.dumps([str(model_path), cfg.dtype, cfg.seed, data], sort_keys=True)


def _warmup(cfg: WarmupConfig) -> WarmupResult:
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    model_path = resolve_model_path(cfg.model)
    data = collect(cfg, model_path, timings)
    samples, n_train = data.samples, len(data.samples) - cfg.data.heldout_prompts
    train_set, held_set = samples[:n_train], samples[n_train:]

    # fp32 embedding + head of the target (the bf16 values when the target runs in bf16).
    target = build_model(model_path, DTYPES[cfg.dtype], 1, cpu_kernels=False)
    max_positions = data.max_len + cfg.eval_depth + cfg.train.unroll + 1
    stub = head_target(target, max_positions)
    del target
    vocab_size = stub.cfg.vocab_size
    # A draft vocabulary as large as the target's is no slice: use the full head.
    size = cfg.data.draft_vocab_size if cfg.data.draft_vocab_size < vocab_size else 0
    spec = DrafterSpec(
        feature_layers=cfg.data.feature_layers,
        draft_vocab_size=size,
        version=1,
        target_weight_version="0",
    )
    drafter = new_drafter(stub, spec, cfg.seed)
    if spec.draft_vocab_size:
        vocab = build_draft_vocab(
            data.responses[:n_train],
            data.prompts[:n_train],
            spec.draft_vocab_size,
            stub.cfg.vocab_size,
        )
        drafter.draft_vocab.copy_(vocab)
    drafter.refresh_head()
    rows = max(cfg.train.batch_tokens // cfg.train.row_len, 1)
    heldout = prepare_heldout(drafter, batches(held_set, cfg.train.row_len, rows, None))
    untrained = offline_accept(drafter, heldout, cfg.eval_depth)

    t = time.perf_counter()
    hist = train(drafter, train_set, heldout, cfg.train, cfg.seed)
    timings["train_s"] = time.perf_counter() - t

    t = time.perf_counter()
    accept = offline_accept(drafter, heldout, cfg.eval_depth)
    timings["eval_s"] = time.perf_counter() - t

    out = _save(drafter, Path(cfg.out), model_path, spec)
    timings["total_s"] = time.perf_counter() - t_start
    report = _report(cfg, model_path, timings, samples, n_train, hist, accept, untrained)
    (out / "warmup.json").write_text(json.dumps(report, indent=2))
    return WarmupResult(out, hist, accept, untrained, report)


def _save(drafter: DrafterModel, out: Path, model_path: Path, spec: DrafterSpec) -> Path:
    target_hf = json.loads((model_path / "config.json").read_text())
    return save_drafter(drafter, out, target_hf, spec)


def _report(
    cfg: WarmupConfig,
    model_path: Path,
    timings: dict[str, float],
    samples: list[Sample],
    n_train: int,
    hist: History,
    accept: AcceptStats,
    untrained: AcceptStats,
) -> dict[str, Any]:
    resp = [int(s.tokens.shape[0]) - s.prompt_len for s in samples]
    tail = max(len(hist.loss) // 10, 1)
    return {
        "settings": asdict(cfg),
        "model_path": str(model_path),
        "torch_threads": torch.get_num_threads(),
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "data": {
            "train_sequences": n_train,
            "heldout_sequences": len(samples) - n_train,
            "train_response_tokens": sum(resp[:n_train]),
            "train_total_tokens": sum(int(s.tokens.shape[0]) for s in samples[:n_train]),
            "heldout_response_tokens": sum(resp[n_train:]),
            "epochs": hist.epochs,
        },
        "train": {
            "first_loss": round(hist.loss[0], 4),
            "final_loss": round(sum(hist.loss[-tail:]) / tail, 4),
            "final_feature_loss": round(sum(hist.feature_loss[-tail:]) / tail, 4),
            "final_ce": round(sum(hist.ce[-tail:]) / tail, 4),
            "heldout_top1": [[s, round(a, 4)] for s, a in hist.evals],
        },
        "offline": {
            "depth": cfg.eval_depth,
            "trained": accept.as_dict(),
            "untrained": untrained.as_dict(),
        },
    }
