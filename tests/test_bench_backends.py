"""The backend-against-backend benchmarks' pure parts: which server each configuration
starts (``benchmarks.decode served``, ``benchmarks.rollout``), the order that keeps compared
configurations side by side, and the paired-ratio summary."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks import decode, rollout
from benchmarks.decode import SERVE, Config, Run


def _args(**kw: object) -> argparse.Namespace:
    base = dict(model="m", dtype="bfloat16", max_model_len=1024, depth=4, drafter="/d",
                vllm_serve_args="--enforce-eager", vllm_python=None, vllm_drafter=None,
                spec_max_batch=8, min_draft_confidence=0.0)
    return argparse.Namespace(**{**base, **kw})


def test_order_keeps_compared_configurations_side_by_side() -> None:
    names = [c.name for c in decode.order(["vllm", "native"], ["ngram", "off"], True)]
    assert names == ["native/ngram", "native/off", SERVE, "vllm/off", "vllm/ngram"]
    one = decode.order(["native"], ["off", "ngram", "drafter"], False)
    assert [c.name for c in one] == ["native/off", "native/ngram", "native/drafter"]


def test_served_flags_name_backend_method_and_capacity() -> None:
    a = _args()
    flags = decode.server_args(_args(spec_max_batch=None), Config("vllm", "drafter"), 64)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == {"--model": "m", "--backend": "vllm", "--dtype": "bfloat16",
                     "--max-model-len": "1024", "--max-num-seqs": "64",
                     "--spec-max-batch": "64", "--speculative": "drafter",
                     "--num-draft-tokens": "4", "--drafter": "/d",
                     "--min-draft-confidence": "0.0"}  # K drafts every step, as vLLM drafts
    assert "--drafter" not in decode.server_args(a, Config("native", "ngram"), 4)
    assert decode.vllm_serve_args(a, 64) == [
        "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64",
        "--enforce-eager"]


def _run(rep: int, backend: str, method: str, tps: float, ids: list[list[int]],
         verify: int = 0, accepted: float = 0.0) -> Run:
    n = sum(len(t) for t in ids)
    return Run(rep, backend, method, len(ids), n / tps, [len(t) for t in ids], verify,
               accepted, output_ids=ids)


def test_summary_pairs_each_repeat_with_the_same_backends_off() -> None:
    a, b = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    runs = [
        _run(0, "native", "off", 100, a), _run(0, "native", "ngram", 150, a, 4, 6.0),
        _run(1, "native", "off", 50, a), _run(1, "native", "ngram", 100, b, 2, 1.0),
        _run(0, "vllm", "off", 200, a), _run(1, "vllm", "off", 100, b),
        _run(0, SERVE, "off", 400, a), _run(1, SERVE, "off", 100, b),
    ]
    s = decode.summarize(runs)
    ngram = s["results"]["native"]["ngram"]["2"]
    assert ngram["speedup"] == 1.75 and ngram["speedup_range"] == [1.5, 2.0]  # not 125/75
    assert ngram["tokens_per_s"] == 125
    assert ngram["accept_length"] == round(7 / 6, 3)  # over all verify steps of all repeats
    assert ngram["verify_ct_per_seq"] == 1.5
    assert ngram["same_tokens_as_off"] == 0.75
    assert s["results"]["native"]["off"]["2"]["accept_length"] is None
    assert s["native_over_vllm_off"]["2"] == {"ratio": 0.5, "range": [0.5, 0.5],
                                              "same_tokens": 0.75}
    serve = s["vllm_backend_over_vllm_serve"]["2"]
    assert serve["ratio"] == 0.75 and serve["range"] == [0.5, 1.0]
    assert serve["vllm_serve_tokens_per_s"] == 250
    assert SERVE not in s["results"]
    assert "output_ids" not in runs[0].record()


def test_served_options_are_checked_and_completed_before_any_server() -> None:
    def served(**kw: object) -> argparse.Namespace:
        return _args(**{"backends": ["native"], "methods": None, "vllm_serve": False,
                        "vllm_serve_batches": None, "batches": [1, 4], "drafter": None, **kw})

    ns = served()
    decode.check_served(ns)
    assert ns.methods == ["off", "ngram"] and ns.vllm_serve_batches == []
    ns = served(drafter="/d")
    decode.check_served(ns)
    assert ns.methods == ["off", "ngram", "drafter"]
    bad: dict[str, Any]
    for bad in ({"methods": ["ngram"]}, {"methods": ["off", "drafter"]},
                {"backends": ["native", "sglang"]}, {"backends": []},
                {"methods": ["off", "bogus"]}, {"vllm_serve": True}):
        with pytest.raises(SystemExit):
            decode.check_served(served(**bad))


def test_offline_methods_default_to_what_the_arguments_allow() -> None:
    ns = _args(methods=None, drafter=None, temperature=0.0)
    decode.check_offline(ns)
    assert ns.methods == ["off", "ngram", "suffix", "auto"]
    ns = _args(methods=["hf"], drafter="/d", temperature=0.0)
    decode.check_offline(ns)
    assert ns.methods == ["off", "hf"]  # off is always the baseline
    for bad in ({"methods": ["hf"], "temperature": 1.0}, {"methods": ["drafter"]},
                {"methods": ["bogus"]}):
        with pytest.raises(SystemExit):
            decode.check_offline(_args(**{"drafter": None, "temperature": 0.0, **bad}))


def test_rollout_configs_name_the_backend() -> None:
    a = _args()
    assert rollout.split_config("off") == ("off", "native")
    assert rollout.split_config("auto@vllm") == ("auto", "vllm")
    native = rollout.server_args(a, "auto", 64)
    assert "--backend" not in native and native[-2:] == ["--drafter", "/d"]
    on_vllm = rollout.server_args(a, "auto@vllm", 64)
    assert on_vllm[on_vllm.index("--backend") + 1] == "vllm"
    assert on_vllm[on_vllm.index("--speculative") + 1] == "auto"
    assert rollout.config_error("off", a) is None
    assert rollout.config_error("drafter", a) is None
    assert "--drafter" in str(rollout.config_error("drafter@vllm", _args(drafter=None)))
    assert "--drafter" in str(rollout.config_error("tlt@vllm", _args(drafter=None)))
    assert "unknown" in str(rollout.config_error("off@sglang", a))
    assert "unknown" in str(rollout.config_error("bogus", a))
    assert "--vllm-python" in str(rollout.config_error("vllm", a))
    epochs = rollout.server_args(a, "suffix-tree", 128, 768)
    assert epochs[epochs.index("--max-model-len") + 1] == "768"
    assert epochs[epochs.index("--tree-topk") + 1] == "4" and "--drafter" not in epochs
