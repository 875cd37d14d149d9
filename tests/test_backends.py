"""The one interface the routes use: every backend answers every control, a backend that is
not installed is one line naming the install command, what vLLM cannot do is refused at
start naming the flag."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from tlt_serve.backends import CONTROLS, VLLM_INSTALL, missing
from tlt_serve.config import CaptureConfig, ConfigError, EngineConfig, SpecConfig
from tlt_serve.server.cli import parse_args


def test_the_native_engine_answers_every_control(tiny_model_dir: Path) -> None:
    from tlt_serve import LLM
    from tlt_serve.server.engine_proc import EngineLoop

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    assert set(CONTROLS) <= set(EngineLoop(llm.engine, conn=None).controls)


def test_the_vllm_engine_answers_every_control(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Built without vLLM: the handlers only reach vLLM when called."""
    from tlt_serve.backends.vllm.controls import BasicControls
    from tlt_serve.backends.vllm.drafter import VllmDrafter
    from tlt_serve.backends.vllm.engine import VllmSpec
    from tlt_serve.backends.vllm.weights import VllmWeights

    loop = SimpleNamespace(info=SimpleNamespace(model_path=str(tiny_model_dir)), version="0")
    handlers = {
        **BasicControls(loop).handlers(),  # type: ignore[arg-type]
        **VllmWeights(loop, tiny_model_dir, tmp_path).handlers(),  # type: ignore[arg-type]
        **VllmDrafter(loop, VllmSpec("none", None), tmp_path).handlers(),  # type: ignore[arg-type]
    }
    assert set(handlers) == set(CONTROLS)


def test_a_missing_vllm_is_one_line_naming_the_install(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    assert VLLM_INSTALL in (missing("vllm") or "") and missing("native") is None
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--backend", "vllm"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and VLLM_INSTALL in err


@pytest.mark.parametrize(("engine_kw", "field"), [
    ({"spec": SpecConfig(method="drafter", drafter="/d", tree_topk=2)}, "tree_topk"),
    ({"capture": CaptureConfig(enabled=True)}, "capture"),
    ({"backend": "tensorrt"}, "backend"),
])
def test_what_vllm_cannot_do_is_refused_at_start(engine_kw, field) -> None:
    config = EngineConfig(**{"backend": "vllm", **engine_kw})
    with pytest.raises(ConfigError, match=f"^{field}:"):
        config.validate()
