"""The one interface the routes use: every backend answers every control, a backend that is
not installed is one line naming the install command, what vLLM cannot do is refused at
start naming the flag."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import typing

import pytest

from tlt_serve.backends import VLLM_INSTALL, missing
from tlt_serve.backends.native.controls import Background
from tlt_serve.config import CaptureConfig, ConfigError, EngineConfig, SpecConfig
from tlt_serve.contract.controls import (
    CONTROLS,
    ControlOp,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed,
)
from tlt_serve.flags import parse as parse_serve_flags


def _reply_type(op: type) -> type:
    """R of ``class Op(ControlOp[R])``."""
    (base,) = [b for b in op.__orig_bases__ if typing.get_origin(b) is ControlOp]
    return typing.get_args(base)[0]


@pytest.mark.parametrize("backend", ["native", "vllm"])
def test_every_backend_answers_every_control_with_its_reply_type(backend: str) -> None:
    """Read from the tables the engine loops dispatch on (importing them needs no vLLM): each
    control has one handler, which takes that control and returns its reply type."""
    handlers = importlib.import_module(f"tlt_serve.backends.{backend}.controls").HANDLERS
    assert set(CONTROLS) == set(ControlOp.__subclasses__())  # CONTROLS lists them all
    assert set(handlers) == set(CONTROLS)
    for op, handler in handlers.items():
        hints = typing.get_type_hints(handler)
        assert hints["op"] is op, (op, handler)
        returned = hints["return"]
        if backend == "vllm":  # async handlers
            assert inspect.iscoroutinefunction(handler), handler
        expected = _reply_type(op)
        allowed = (expected, Background) if op in (InitWeightsUpdateGroup,
                                                  UpdateWeightsFromDistributed) else (expected,)
        assert returned in allowed, (op, returned)


def test_a_missing_vllm_is_one_line_naming_the_install(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    assert VLLM_INSTALL in (missing("vllm") or "") and missing("native") is None
    with pytest.raises(SystemExit) as exc:
        parse_serve_flags(["--backend", "vllm"])
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
