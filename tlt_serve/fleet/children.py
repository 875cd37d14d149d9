"""What the fleet launchers (``launch.py`` on one machine, ``ray.py`` on a Ray cluster)
share about the processes they start and keep alive."""

from __future__ import annotations

import ctypes
import signal
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

from tlt_serve.fleet.join import JoinError, join_fleet
from tlt_serve.fleet.router_api import RouterError

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


@dataclass
class Life:
    """A replica's restart record: restarted while it dies young, left out after
    ``MAX_RESTARTS`` starts in a row that did not last ``STABLE_S``."""

    name: str  # "replica 0"
    started: float = field(default_factory=time.monotonic)  # its current process's start
    restarts: int = 0  # in a row, each within STABLE_S of its start
    joining: bool = False  # restarted, not yet behind the router

    @property
    def left_out(self) -> bool:
        return self.restarts > MAX_RESTARTS

    def died(self, url: str, how: str) -> bool:
        """Count a death (``how``: "exited with code 1", ...); True when to restart."""
        young = time.monotonic() - self.started < STABLE_S
        self.restarts = self.restarts + 1 if young else 1
        if self.left_out:
            say(f"{self.name} ({url}) {how}, {MAX_RESTARTS} times within {STABLE_S:.0f} s "
                "of starting; left out of the router")
            return False
        say(f"{self.name} ({url}) {how}; taken out of the router and restarted")
        return True

    def restarted(self) -> None:
        self.started, self.joining = time.monotonic(), True

    def rejoin(self, router_url: str, url: str, shown: str = "") -> bool:
        """Bring the restarted replica to the fleet's weights and drafter, then behind the
        router (``join.join_fleet``); False (said why) when it could not. ``shown``: how the
        messages name it (default its URL)."""
        try:
            joined = join_fleet(router_url, url)
        except (JoinError, RouterError) as err:
            say(f"{self.name} ({url}) could not rejoin: {err}")
            return False
        self.joining = False
        say(f"{self.name} rejoined as {shown or url}: weight version {joined.weight_version}, "
            f"drafter version {joined.drafter_version}")
        return True


class Launcher:
    """Start the router and replicas, keep them alive until SIGTERM / SIGINT, stop them."""

    def __init__(self) -> None:
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            self._start()
            if not self.stopping:
                self._supervise()
            return 0
        except (RuntimeError, RouterError, ValueError) as err:
            say(str(err))
            return 1
        finally:
            self._stop()

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _start(self) -> None:
        raise NotImplementedError

    def _supervise(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError
