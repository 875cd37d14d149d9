"""A random-weight Llama checkpoint at a real shape, with the default model's tokenizer: a
larger model to time where no model hub is reachable (``benchmarks.kernels ab --model DIR``).
Random weights decode at the real shape's cost (greedy with EOS ignored); their text is noise.

    python -m benchmarks.random_model /tmp/llama-1b   # Llama-3.2-1B's layers, 49152 tokens
    python -m benchmarks.random_model DIR --hidden 4096 --intermediate 14336 --layers 32 \\
        --heads 32 --kv-heads 8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers


def write(out: Path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          seed: int = 0) -> Path:
    """An HF directory (config, bf16 safetensors, tokenizer) of a random tied-embedding
    Llama."""
    from tlt_serve.models.provision import resolve_model_path

    tok = transformers.AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {params / 1e9:.2f}B parameters")
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m benchmarks.random_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    return write(a.out, a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.seed)


if __name__ == "__main__":
    main()
