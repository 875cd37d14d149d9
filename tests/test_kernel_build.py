"""The CPU kernels' build directory and its lock: keyed by what the build depends on, and a
builder that waits on a live one gives up with a message naming the lock file (the stale
lock of a killed build: test_server_lifecycle)."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tlt_serve import kernels


def test_build_key_follows_sources_flags_and_header(tmp_path: Path) -> None:
    here = Path(kernels.__file__).parent
    for f in kernels.SOURCES:
        shutil.copy(here / f, tmp_path / f)
    key = kernels.build_key(tmp_path, ["-O3"])
    assert key == kernels.build_key(here, ["-O3"])  # a copy elsewhere: the same build
    assert kernels.build_key(tmp_path, ["-O2"]) != key
    header = tmp_path / "bf16_kernels.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert kernels.build_key(tmp_path, ["-O3"]) != key


def test_waiting_on_a_live_builder_gives_up_naming_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tlt-build.flock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another builder, alive
    monkeypatch.setattr(kernels, "BUILD_WAIT_S", 0.5)
    try:
        with pytest.raises(TimeoutError, match=str(path)), kernels._builder_lock(path):
            pass
    finally:
        os.close(holder)
    with kernels._builder_lock(path):  # free now
        pass
