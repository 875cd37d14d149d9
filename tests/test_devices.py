"""GPU discovery without CUDA: the probe the front end and the vLLM engine process use
(``tlt_serve/devices.py``) asks NVML, so CUDA stays uninitialised and a forked child can
still use it. Checked in a fresh interpreter whose CUDA entry points fail when called; what
NVML reports, and each failed call named, through a stand-in NVML library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tlt_serve.devices import Gpu, NvmlError, probe, visible

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import torch

def asked(*args, **kwargs):
    raise AssertionError("the probe asked CUDA")

torch.cuda.is_available = asked
torch.cuda.device_count = asked
torch.cuda.init = asked
torch.cuda._lazy_init = asked
torch._C._cuda_getDeviceCount = asked

from tlt_serve.backends import missing
from tlt_serve.devices import gpus
from tlt_serve.flags import parse

found = gpus()
parse([])  # the front end's flags
missing("vllm")
assert not torch.cuda.is_initialized()
print("GPUS", len(found), [g.name for g in found])
"""


def test_the_probe_leaves_cuda_uninitialised() -> None:
    import torch

    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = int(proc.stdout.split("GPUS ")[1].split()[0])
    # here, after the probe's process is done, CUDA may be asked: the probe found what it sees
    assert found == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_visible_devices_follow_cuda_rules() -> None:
    assert visible(None, 2) == ["0", "1"]
    assert visible("1", 2) == ["1"]
    assert visible("1,0", 2) == ["1", "0"]
    assert visible("", 2) == []
    assert visible("-1", 2) == []
    assert visible("0,-1,1", 2) == ["0"]  # CUDA stops at the first invalid entry
    assert visible("0,5,1", 2) == ["0"]
    assert visible("GPU-8f3a", 1) == ["GPU-8f3a"]


def test_device_cuda_without_cuda_is_a_one_line_error(capsys) -> None:
    import pytest
    import torch

    from tlt_serve.flags import parse

    if torch.version.cuda is not None and torch.cuda.device_count() > 0:
        pytest.skip("this machine has a CUDA device")  # the error is for machines without one
    with pytest.raises(SystemExit) as exit_:
        parse(["--device", "cuda"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tlt-serve: --device cuda: "), err
    with pytest.raises(SystemExit):
        parse(["--device", "tpu"])
    assert "argument --device: device: 'tpu' is not cpu, cuda or cuda:N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--backend", "vllm", "--device", "cpu"])
    assert "argument --device: the vllm backend runs where its build runs" in (
        capsys.readouterr().err)


class FakeNvml:
    """NVML's C entry points as the probe calls them (ctypes arguments), over devices given
    as (name, total bytes); ``fail`` = {call: NVML error code}."""

    def __init__(self, devices: list[tuple[str, int]], fail: dict[str, int] | None = None):
        self.devices = devices
        self.fail = fail or {}

    def nvmlDeviceGetCount_v2(self, count) -> int:
        count._obj.value = len(self.devices)
        return self.fail.get("count", 0)

    def nvmlDeviceGetHandleByIndex_v2(self, index: int, handle) -> int:
        if index >= len(self.devices):
            return 2  # NVML_ERROR_INVALID_ARGUMENT
        handle._obj.value = index + 1  # a null handle reads as None
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes, handle) -> int:
        return 6  # NVML_ERROR_NOT_FOUND

    def nvmlDeviceGetName(self, handle, name, length) -> int:
        if "name" in self.fail:
            return self.fail["name"]
        name.value = self.devices[handle.value - 1][0].encode()
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, memory) -> int:
        if "memory" in self.fail:
            return self.fail["memory"]
        memory._obj.total = self.devices[handle.value - 1][1]
        return 0

    def nvmlErrorString(self, rc: int) -> bytes:
        return {15: b"GPU is lost", 3: b"Not Supported"}.get(rc, b"Unknown Error")


def test_probe_describes_the_visible_devices() -> None:
    nvml = FakeNvml([("NVIDIA H200", 141 << 30), ("NVIDIA H100", 80 << 30)])
    assert probe(nvml, None) == [Gpu(0, "NVIDIA H200", 141 << 30), Gpu(1, "NVIDIA H100", 80 << 30)]
    assert probe(nvml, "1") == [Gpu(0, "NVIDIA H100", 80 << 30)]
    assert probe(nvml, "GPU-8f3a,0") == []


@pytest.mark.parametrize(("fail", "call"), [
    ({"memory": 15}, "nvmlDeviceGetMemoryInfo failed for CUDA device 0: GPU is lost (error 15)"),
    ({"name": 3}, "nvmlDeviceGetName failed for CUDA device 0: Not Supported (error 3)"),
    ({"count": 999}, "nvmlDeviceGetCount_v2 failed: Unknown Error (error 999)"),
])
def test_a_failed_nvml_call_is_named_not_a_device_without_memory(
    fail: dict[str, int], call: str
) -> None:
    """The memory shares on a GPU divide by its total: a call that failed must not leave
    it 0."""
    with pytest.raises(NvmlError) as err:
        probe(FakeNvml([("NVIDIA H200", 141 << 30)], fail), None)
    assert str(err.value) == f"NVML {call}"
    with pytest.raises(NvmlError, match="^NVML: CUDA device 0 reports no memory$"):
        probe(FakeNvml([("NVIDIA H200", 0)]), None)


def test_vllm_on_cuda_without_a_visible_gpu_is_refused(monkeypatch) -> None:
    """vLLM's platform is CUDA but NVML finds no GPU: a start-up error naming it, not an
    engine configured for a CPU on a CUDA platform."""
    from tlt_serve.backends.vllm import process

    h200 = Gpu(0, "NVIDIA H200", 141 << 30)
    monkeypatch.setattr(process, "gpus", lambda: [h200])
    assert process.platform_gpu(True) == h200
    assert process.platform_gpu(False) is None  # vLLM's CPU build, whatever NVML sees
    monkeypatch.setattr(process, "gpus", lambda: [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3a")
    with pytest.raises(RuntimeError, match=r"^vLLM's platform is CUDA but NVML finds no GPU "
                       r"this process may use \(CUDA_VISIBLE_DEVICES='GPU-8f3a'\)"):
        process.platform_gpu(True)
