"""What the fleet launchers (``launch.py`` on one machine, ``ray.py`` on a Ray cluster)
share about the processes they start and keep alive."""

from __future__ import annotations

import ctypes
import signal
import sys

START_TIMEOUT_S = 900.0  # a replica's first start may build the CPU kernels
MAX_RESTARTS = 5  # restarts in a row of a replica that dies within STABLE_S of starting
STABLE_S = 120.0


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the process that started it dies, so a launcher
    killed with SIGKILL leaves no router or replica behind (Linux). The signal follows the
    thread that forked: call it only from a child forked by the main thread."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def say(line: str) -> None:
    print(f"tlt-serve fleet: {line}", file=sys.stderr, flush=True)
