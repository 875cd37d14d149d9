"""Descriptors an engine process inherited stay out of the programs it (or a library) runs.

multiprocessing hands an engine process its end of the pipe to the front end and the write
end of its exit sentinel as inheritable descriptors. A helper that a library forks and execs
without closing descriptors would keep them open past the engine's exit: torch's shared-memory
manager, started the first time captured features are lent by reference, outlives the engine.
The front end would then see neither the pipe's end nor the sentinel: a shutdown waits out
its timeout, and an engine that died is not noticed. Marked close-on-exec at start, the
descriptors close with the engine; what the engine itself starts on purpose is passed
explicitly (``subprocess``, multiprocessing's spawn), never inherited by accident."""

from __future__ import annotations

import contextlib
import os


def close_inherited_on_exec() -> None:
    """Mark every open descriptor above stderr close-on-exec."""
    listing = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    for name in os.listdir(listing):
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):  # the listing's own, closed by now
                os.set_inheritable(fd, False)
