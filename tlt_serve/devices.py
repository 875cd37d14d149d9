"""What GPUs this machine has, asked of the NVIDIA driver's management library (NVML),
never of CUDA.

A process that has initialised CUDA cannot fork a child that uses CUDA ("Cannot re-initialize
CUDA in forked subprocess"), and ``torch.cuda.is_available()`` initialises the CUDA driver. The
front end and the vLLM engine process (whose engine core vLLM may fork) therefore probe here:
NVML counts devices and reads their memory without a CUDA context, honouring
``CUDA_VISIBLE_DEVICES``. Without the driver library (a CPU machine) there are no GPUs; a
device the driver counts but cannot describe is an error naming the failed call.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any


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


class NvmlError(RuntimeError):
    """NVML failed to say what a device it counts is: the call, the device, NVML's reason."""


def gpus() -> list[Gpu]:
    """The CUDA devices this process would see, without initialising CUDA; NvmlError when
    the driver cannot describe one of them."""
    nvml = _driver()
    if nvml is None or nvml.nvmlInit_v2() != 0:
        return []  # no NVIDIA driver
    try:
        return probe(nvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
    finally:
        nvml.nvmlShutdown()


def _driver() -> Any:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    nvml.nvmlErrorString.restype = ctypes.c_char_p
    return nvml


def probe(nvml: Any, devices: str | None) -> list[Gpu]:
    """The devices an initialised NVML library ``nvml`` counts, as ``CUDA_VISIBLE_DEVICES``
    = ``devices`` shows them to CUDA."""
    count = ctypes.c_uint()
    _check(nvml, nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
    found = []
    for i, entry in enumerate(visible(devices, count.value)):
        handle = ctypes.c_void_p()
        rc = (nvml.nvmlDeviceGetHandleByIndex_v2(int(entry), ctypes.byref(handle))
              if entry.isdigit()
              else nvml.nvmlDeviceGetHandleByUUID(entry.encode(), ctypes.byref(handle)))
        if rc != 0:
            break  # as CUDA: the list ends at an entry that names no device
        found.append(_describe(nvml, handle, i))
    return found


def _describe(nvml: Any, handle: ctypes.c_void_p, index: int) -> Gpu:
    """Device ``index``'s name and memory; NvmlError rather than a made-up size, which the
    memory shares derived from it would divide by."""
    where = f"CUDA device {index}"
    name = ctypes.create_string_buffer(96)
    _check(nvml, nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)), "nvmlDeviceGetName",
           where)
    memory = _Memory()
    _check(nvml, nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)),
           "nvmlDeviceGetMemoryInfo", where)
    if memory.total == 0:
        raise NvmlError(f"NVML: {where} reports no memory")
    return Gpu(index, name.value.decode(errors="replace"), int(memory.total))


def _check(nvml: Any, rc: int, call: str, where: str = "") -> None:
    if rc != 0:
        reason = nvml.nvmlErrorString(rc)
        reason = reason.decode(errors="replace") if isinstance(reason, bytes) else reason
        on = f" for {where}" if where else ""
        raise NvmlError(f"NVML {call} failed{on}: {reason} (error {rc})")


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
    try:
        found = gpus()
    except NvmlError as err:
        return f"--device {device}: {err}"
    if index >= len(found):
        return f"--device {device}: no such CUDA device (NVML sees {len(found)})"
    return None
