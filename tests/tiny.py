"""A tiny random Llama-family model with a real (trained byte-level BPE) tokenizer.

Built in well under a second, fully offline, so most tests need no real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "What is 12 + 7? Let me think step by step. 12 + 7 = 19. The answer is 19.",
    "Reinforcement learning trains a policy from rewards; rollouts dominate the time.",
    "Speculative decoding drafts tokens cheaply and verifies them in one forward pass.",
    "Bonjour, ça va? Très bien, merci. 你好，世界。 🙂",
] * 20


def build_tokenizer(vocab_size: int = 400) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    return fast


def make_tiny_model(
    out: Path, model_type: str = "llama", seed: int = 0, layers: int = 2, vocab: int = 400,
    hidden: int = 64, heads: int = 4, kv_heads: int = 2,
) -> Path:
    """Write an HF directory (config, safetensors, tokenizer) of a random tiny model (head
    size 16 unless ``hidden`` / ``heads`` of a Llama say otherwise)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(vocab)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[model_type]
    extra = {"tie_word_embeddings": True} if model_type == "llama" else {"head_dim": 16}
    config = cls(**common, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy decoding is decisive and
    # sampled outputs differ visibly between seeds.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_drafter(
    target_dir: Path,
    out: Path,
    seed: int = 0,
    feature_layers: tuple[int, ...] = (),
    draft_vocab_size: int = 0,
) -> Path:
    """Write a randomly initialised drafter checkpoint for the tiny target at ``target_dir``.

    Random drafters are never confident: tests that need drafts from one set
    ``min_draft_confidence=0``."""
    import json

    from tlt_serve.models.loader import build_model
    from tlt_serve.speculative.checkpoint import save_drafter
    from tlt_serve.speculative.drafter import DrafterSpec, new_drafter

    target = build_model(target_dir, torch.float32, 256)
    spec = DrafterSpec(feature_layers=feature_layers, draft_vocab_size=draft_vocab_size)
    drafter = new_drafter(target, spec, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2 and not name.startswith("fc."):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        if feature_layers:  # read the last fused layer's stream: some drafts get accepted
            H = target.cfg.hidden_size
            drafter.fuse.weight.zero_()
            drafter.fuse.weight[:, -H:].copy_(torch.eye(H))
            drafter.fuse_norm.weight.copy_(target.norm.weight)  # = the target's final norm
        if draft_vocab_size:
            drafter.draft_vocab.copy_(
                torch.randperm(target.cfg.vocab_size, generator=gen)[:draft_vocab_size]
            )
    hf = json.loads((target_dir / "config.json").read_text())
    return save_drafter(drafter, out, hf, spec)
