"""What a result was measured on: the same benchmark differs ~2x between hosts of one kind
(an AVX2-only EPYC, a Zen 4 EPYC with AVX512-BF16, a Xeon with AMX), so every result names
its CPU and the vector extensions that decide the kernels' speed, read from /proc/cpuinfo."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# /proc/cpuinfo flag → how results name it; in this order
FLAGS = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_bf16": "AVX512-BF16",
         "amx_bf16": "AMX-BF16"}


def _cpuinfo_field(name: str) -> str | None:
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return None
    for line in info.read_text().splitlines():
        if line.split(":", 1)[0].strip() == name:
            return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Which of AVX2, AVX512F, AVX512-BF16, AMX-BF16 the CPU has (empty if unknown)."""
    have = set((_cpuinfo_field("flags") or "").split())
    return [label for flag, label in FLAGS.items() if flag in have]


def host() -> str:
    """e.g. 'AMD EPYC 9R14, 2 cores, AVX2 AVX512F AVX512-BF16': a result's ``machine``."""
    flags = " ".join(cpu_flags()) or "no AVX2"
    return f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores, {flags}"
