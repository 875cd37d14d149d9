"""What a decode step of the whole native engine costs on a device (scheduling, inputs,
sampling, outputs included): its steps replayed from CUDA graphs (the decoder layers compiled)
against run eagerly (``eager``: ``--enforce-eager``) and against captured from the layers as
written (``uncompiled``: ``--no-compile``) and attending through the own Triton kernel
(``triton``: ``--attention-backend triton``), side by side: a random-weight checkpoint at a real
shape is written once, the engines load it, and each batch size is timed on each in
alternating rounds. ``--arms`` adds engines that capture drafter training samples as they
serve: ``capture`` keeps the features on the device, ``capture-host`` copies them to the host
every step (``--capture-on-host``): what keeping them there saves a step.

    python -m benchmarks.engine_steps run --device cuda --shape 1.7b
    python -m benchmarks.engine_steps run --device cuda --arms graphs,uncompiled,capture
    python -m benchmarks.engine_steps run --device cpu --shape tiny --batches 1,4 --tokens 8

Set against ``benchmarks.profile steps`` (the model's step alone), the difference is what
the engine adds around a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common.results import ints, pyplot, report, save, tool
from benchmarks.profile import SHAPES, random_model
from tlt_serve.models.arch import ArchConfig


def hf_names(cfg: ArchConfig) -> list[str]:
    """The tensor names of a Hugging Face checkpoint of this architecture."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + n + ".weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def random_checkpoint(cfg: ArchConfig, out: Path, device: torch.device, seed: int = 0) -> Path:
    """A bf16 checkpoint of shape ``cfg`` with random weights (``profile.random_model``) and
    a small tokenizer (ids past its vocabulary decode to nothing) in ``out``."""
    from safetensors.torch import save_file

    from tests.tiny import build_tokenizer
    from tlt_serve.models.loader import served_tensors

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    model = random_model(cfg, 64, device, seed)
    names = hf_names(cfg)
    tensors = {k: v.cpu() for k, v in served_tensors(model, names).items()}
    missing = set(names) - set(tensors)
    assert not missing, f"names the loader does not know: {sorted(missing)[:3]}"
    save_file(tensors, str(out / "model.safetensors"))
    del model, tensors
    architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}
    (out / "config.json").write_text(json.dumps({
        "architectures": [architectures[cfg.model_type]], "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "bfloat16",
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    }))
    return out


# arm: the engine's model settings (besides the defaults: CUDA graphs, layers compiled,
# torch's attention) and whether it captures samples, keeping their features on the device
ARMS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    "graphs": ({}, False, True),
    "eager": ({"enforce_eager": True}, False, True),
    "uncompiled": ({"compile": False}, False, True),
    "triton": ({"attention_backend": "triton"}, False, True),
    "capture": ({}, True, True),
    "capture-host": ({}, True, False),
}


def _engine(path: Path, a: argparse.Namespace, arm: str) -> Any:
    from tlt_serve import LLM
    from tlt_serve.config import CacheConfig, CaptureConfig, EngineConfig, ModelConfig

    model, capture, on_device = ARMS[arm]
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(path), dtype="bfloat16", device=a.device,
                          max_model_len=a.context + a.tokens + 8, **model),
        # the same prompts are sent again and again: no cached prefixes, every run prefills
        cache=CacheConfig(max_num_seqs=max(a.batches), prefix_cache=False),
        capture=CaptureConfig(enabled=capture, on_device=on_device)))


def _generate_s(llm: Any, prompts: list[list[int]], tokens: int) -> float:
    from tlt_serve import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    if llm.engine.kv.storage.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t0


def run(a: argparse.Namespace) -> Path:
    """Per batch size: the milliseconds of one decode step of the engine, as the time to
    generate ``--tokens`` tokens less the time to generate one (the prefill and first
    token), over ``--tokens`` - 1; prompts of ``--context`` random tokens; median of
    ``--rounds`` rounds, CUDA graphs and eager alternating."""
    device = torch.device(a.device)
    cfg = SHAPES[a.shape]
    gen = torch.Generator().manual_seed(a.seed)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tlt-engine-steps-") as tmp:
        path = random_checkpoint(cfg, Path(tmp), device, a.seed)
        engines = {arm: _engine(path, a, arm) for arm in a.arms}
        for b in tqdm(a.batches, desc=f"engine {a.shape}"):
            prompts = torch.randint(0, cfg.vocab_size, (b, a.context), generator=gen).tolist()
            ms: dict[str, list[float]] = {name: [] for name in engines}
            for i in range(a.rounds):
                for name, llm in engines.items():
                    # warm-up: every step shape of a timed run (graphs), the first time
                    _generate_s(llm, prompts, a.tokens if i == 0 else 2)
                    one = _generate_s(llm, prompts, 1)
                    full = _generate_s(llm, prompts, a.tokens)
                    ms[name].append(1000 * (full - one) / (a.tokens - 1))
            row: dict[str, Any] = {"batch": b}
            for name, values in ms.items():
                row[f"{name}_ms"] = round(statistics.median(values), 4)
            for arm in a.arms[1:]:
                row[f"{arm}_vs_{a.arms[0]}"] = round(row[f"{arm}_ms"] / row[f"{a.arms[0]}_ms"], 3)
            rows.append(row)
            print(f"{a.shape} batch {b}: " + ", ".join(
                f"{arm} {row[f'{arm}_ms']:.3f} ms" for arm in a.arms) + " per step (" + ", ".join(
                f"{arm} x{row[f'{arm}_vs_{a.arms[0]}']}" for arm in a.arms[1:]) + ")")
        graphs = engines[a.arms[0]].engine.runner.graphs
        captured = [] if graphs is None else [vars(s) for s in graphs.steps]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return report(a, {"device": gpu or "cpu", "torch": torch.__version__, "shape": a.shape,
                      "arms": a.arms, "rows": rows, "graph_shapes": captured}, plot)


def plot(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in result.get("arms", ["graphs", "eager"]):
        pts = [(r["batch"], r[f"{name}_ms"]) for r in result["rows"]]
        ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("ms per engine decode step")
    ax.set_title(f"native engine, {result['shape']} shape, bf16", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"{result['device']} ({result['date']}, {result['commit']})", fontsize=9)
    save(fig, png)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="1.7b", choices=list(SHAPES))
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 64])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per timed run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", type=_arms, default=["graphs", "eager"],
                   help=f"engines side by side, the first the reference ({', '.join(ARMS)})")


def _arms(text: str) -> list[str]:
    arms = [t for t in text.split(",") if t]
    if not arms or any(t not in ARMS for t in arms) or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"a comma list of distinct arms from {', '.join(ARMS)}")
    return arms


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "engine_steps", {"run": (_arguments, run)}, argv)


if __name__ == "__main__":
    main()
