"""The harness's own pieces (``tests/harness.py``): the CLI's flags parse into the config a
server is built from, the SSE parser insists on the stream's end, a missing optional piece
skips unless its switch requires it, and waiting names what it waited for."""

from __future__ import annotations

import pytest

from tests.harness import need, sse_events, wait_for
from tlt_serve.flags import parse as parse_serve_flags


def test_cli_parses_into_a_frozen_server_config() -> None:
    cfg = parse_serve_flags([
        "--model", "m", "--port", "1234", "--dtype", "float32", "--api-key", "k",
        "--max-model-len", "512", "--max-num-seqs", "4", "--seed", "7", "--log-level", "debug",
    ])
    assert (cfg.port, cfg.api_key, cfg.log_level) == (1234, "k", "debug")
    assert cfg.engine.model.model == "m" and cfg.engine.model.dtype == "float32"
    assert cfg.engine.model.max_model_len == 512 and cfg.engine.cache.max_num_seqs == 4
    assert cfg.engine.seed == 7


def test_cli_defaults() -> None:
    cfg = parse_serve_flags([])
    assert (cfg.host, cfg.port, cfg.engine.model.dtype) == ("127.0.0.1", 30000, "bfloat16")
    assert cfg.engine.model.model == "smollm2-135m"


def test_sse_parser_requires_done() -> None:
    assert sse_events(iter(['data: {"a": 1}', "", "data: [DONE]"])) == [{"a": 1}]


def test_a_missing_piece_skips_unless_its_switch_requires_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TLT_REQUIRE_NOTHING", raising=False)
    need("json", "", "TLT_REQUIRE_NOTHING")  # there: neither
    for load in (True, False):
        with pytest.raises(pytest.skip.Exception, match="tlt_no_such_module"):
            need("tlt_no_such_module", "pip install it", "TLT_REQUIRE_NOTHING", load=load)
    monkeypatch.setenv("TLT_REQUIRE_NOTHING", "1")
    with pytest.raises(pytest.fail.Exception, match="TLT_REQUIRE_NOTHING=1 requires it"):
        need("tlt_no_such_module", "pip install it", "TLT_REQUIRE_NOTHING")


def test_wait_for_returns_the_value_or_names_what_it_waited_for() -> None:
    calls = iter([0, None, 7])
    assert wait_for(lambda: next(calls), 5, "a value", interval=0) == 7
    with pytest.raises(AssertionError, match="waited 0.1 s for the moon"):
        wait_for(lambda: False, 0.1, "the moon")
