"""GPU discovery without CUDA: the probe the front end and the vLLM engine process use
(``tlt_serve/devices.py``) asks NVML, so CUDA stays uninitialised and a forked child can
still use it. Checked in a fresh interpreter whose CUDA entry points fail when called."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tlt_serve.devices import visible

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
