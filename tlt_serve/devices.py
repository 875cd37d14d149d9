"""What GPUs this machine has, asked of the NVIDIA driver's management library (NVML),
never of CUDA.

A process that has initialised CUDA cannot fork a child that uses CUDA ("Cannot re-initialize
CUDA in forked subprocess"), and ``torch.cuda.is_available()`` initialises the CUDA driver. The
front end and the vLLM engine process (whose engine core vLLM may fork) therefore probe here:
NVML counts devices and reads their memory without a CUDA context, honouring
``CUDA_VISIBLE_DEVICES``. Without the driver library (a CPU machine) there are no GPUs.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int  # CUDA's index among the visible devices
    name: str
    total_bytes: int


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def is_device(name: str) -> bool:
    """``name`` is a device the engine and trainer take: cpu, cuda or cuda:N."""
    kind, _, index = name.partition(":")
    return name == "cpu" or (kind == "cuda" and (not index or index.isdigit()))


def visible(devices: str | None, count: int) -> list[str]:
    """The physical devices CUDA shows, by index or UUID, as ``CUDA_VISIBLE_DEVICES`` lists
    them (None: all ``count``): the list ends at the first entry that names no device."""
    if devices is None:
        return [str(i) for i in range(count)]
    out: list[str] = []
    for entry in (e.strip() for e in devices.split(",")):
        if not entry or entry.startswith("-"):
            break
        if entry.isdigit() and int(entry) >= count:
            break
        out.append(entry)
    return out


def gpus() -> list[Gpu]:
    """The CUDA devices this process would see, without initialising CUDA."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []  # no NVIDIA driver
    if nvml.nvmlInit_v2() != 0:
        return []
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        found = []
        for i, entry in enumerate(visible(os.environ.get("CUDA_VISIBLE_DEVICES"), count.value)):
            handle = ctypes.c_void_p()
            rc = (nvml.nvmlDeviceGetHandleByIndex_v2(int(entry), ctypes.byref(handle))
                  if entry.isdigit()
                  else nvml.nvmlDeviceGetHandleByUUID(entry.encode(), ctypes.byref(handle)))
            if rc != 0:
                break
            name = ctypes.create_string_buffer(96)
            memory = _Memory()
            nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(96))
            nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
            found.append(Gpu(i, name.value.decode(errors="replace"), int(memory.total)))
        return found
    finally:
        nvml.nvmlShutdown()


def device_problem(device: str) -> str | None:
    """Why the native engine cannot run on ``device`` here (one line), or None. Asks torch's
    build and NVML, not CUDA."""
    if not device.startswith("cuda"):
        return None
    import torch

    if torch.version.cuda is None:
        return (f"--device {device}: this torch ({torch.__version__}) is a CPU build; install "
                "a CUDA build of torch")
    index = int(device.split(":")[1]) if ":" in device else 0
    found = gpus()
    if index >= len(found):
        return f"--device {device}: no such CUDA device (NVML sees {len(found)})"
    return None
