"""What a result was measured on: the same benchmark differs ~2x between this project's hosts
(an AVX2 EPYC and an AVX512-BF16 one), so every result names its CPU."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from tlt_serve.kernels import native_bf16_gemm


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` knows."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host() -> str:
    """e.g. 'AMD EPYC, 2 cores, AVX512-BF16' — the ``machine`` of a benchmark's JSON."""
    units = "AVX512-BF16/AMX" if native_bf16_gemm() else "no bf16 GEMM units"
    return f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores, {units}"
