"""The co-located drafter trainer as the front end sees it: its report (the body of
``POST /drafter/trainer_status``), the pause switch, and the supervisor that runs it.

The supervisor runs the trainer (``python -m trainer online``) beside the server, in its
own process: a crash in the trainer never touches serving; the supervisor restarts it
after ``restart_delay_s`` (it resumes from its newest good checkpoint) and counts restarts
for ``/get_drafter_info``. Load comes first: the moment more than ``max_running`` requests
are in flight the trainer process is suspended (SIGSTOP) and it resumes (SIGCONT) when load
drops again — it yields the cores at once, not after its current micro-step (the trainer's
own gate check stays as the mechanism for a trainer the server does not supervise).
It runs at the lowest CPU priority (``--trainer-nice``, default 19): when it may train but
something else on the machine wants the cores (an RL client's policy update on the same
host, the engine itself), that comes first, so the trainer uses only cycles nothing else
wants — the idle gaps TLT trains in.
The admin key (else the API key) reaches it through the environment, never argv (which
other users can read).
On shutdown it gets SIGTERM, checkpoints and exits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msgspec import Struct

from tlt_serve.config import ServerConfig
from tlt_serve.models.provision import default_cache_dir

log = logging.getLogger("tlt_serve.supervisor")
STOP_WAIT_S = 30.0  # SIGTERM → checkpoint → exit; then SIGKILL
PR_SET_PDEATHSIG = 1  # prctl option: signal sent to this process when its parent dies


class TrainerReport(Struct, forbid_unknown_fields=True):
    """What the trainer tells the server about itself (shown by /get_drafter_info)."""

    state: str  # starting | waiting | starving | training | evaluating
    pid: int | None = None  # the trainer's process
    step: int = 0
    published_version: int | None = None
    cursor: int = 0  # the last captured sample it pulled
    loss: float | None = None
    last_candidate: dict[str, Any] | None = None  # the promotion guard's last verdict
    resumed_from: str | None = None  # the checkpoint this process started from
    resumed_step: int | None = None  # that checkpoint's step
    device: str = "cpu"  # where it trains
    memory_budget_bytes: int | None = None  # on a GPU: its cap there
    memory_peak_bytes: int | None = None  # on a GPU: the most it has allocated there


@dataclass
class TrainingState:
    """The front end's side of drafter training: a pause switch and the trainer's report."""

    paused: bool = False
    report: TrainerReport | None = None
    reported_at: float | None = None  # unix time of the last report
    restarts: int = 0  # trainer processes restarted by the supervisor
    pid: int | None = None  # the running trainer process (started by the supervisor)
    suspended: bool = False  # SIGSTOPped by the supervisor while load is high

    def phase(self, enabled: bool) -> str:
        """One of off / paused / suspended / training / idle (``/metrics``' trainer_state).

        ``enabled``: the server supervises a trainer; a standalone trainer is seen through
        its reports only."""
        if not enabled and self.report is None:
            return "off"
        if self.paused:
            return "paused"
        if self.suspended:
            return "suspended"
        if self.report is not None and self.report.state in ("training", "evaluating"):
            return "training"
        return "idle"



def trainer_state_dir(config: ServerConfig) -> Path:
    if config.training.state_dir:
        return Path(config.training.state_dir)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", config.engine.model.model).strip("_") or "model"
    return default_cache_dir() / "trainer" / name


# The optimizer step (256 pairs) in ONE micro-step instead of the standalone trainer's four
# of 1 x 64: a suspended trainer yields at once whatever its tick's length, so the tick need
# not be short, and bigger products train faster (forward + backward, 2 threads: 1 x 64 pairs
# 87 ms = 735 pairs/s; 4 x 64 249 ms = 1027 pairs/s).
SUPERVISED_MICRO_STEP = ["--rows", "4", "--row-len", "64", "--accum", "1"]


def trainer_command(config: ServerConfig, url: str) -> list[str]:
    cmd = [sys.executable, "-m", "trainer", "online", "--server", url,
           "--state-dir", str(trainer_state_dir(config)), "--seed", str(config.engine.seed),
           "--log-level", config.log_level, *SUPERVISED_MICRO_STEP]
    if config.engine.spec.drafter:
        cmd += ["--init", config.engine.spec.drafter]
    if config.training.threads:
        cmd += ["--threads", str(config.training.threads)]
    cmd += ["--device", config.training.device]
    engine = config.engine
    if engine.backend == "native" and engine.model.device.startswith("cuda") \
            and engine.capture.on_device:
        cmd += ["--shared-feed"]  # the engine's GPU: features go by reference, never the host
    if config.training.memory_bytes:
        cmd += ["--memory-gib", f"{config.training.memory_bytes / 2**30:g}"]
    return cmd


def _child_setup(nice: int) -> Callable[[], None]:
    """In the child, before exec: lower its CPU priority by ``nice``, and get SIGKILL when
    the server dies, even uncleanly (a trainer left behind, possibly SIGSTOPped, would
    otherwise linger; Linux only)."""

    def setup() -> None:
        os.nice(nice)
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            return
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    return setup


class TrainerSupervisor:
    def __init__(self, config: ServerConfig, url: str, state: TrainingState) -> None:
        self.cmd = trainer_command(config, url)
        self.env = dict(os.environ)
        key = config.admin_key or config.api_key  # it pulls samples and swaps drafters
        if key:
            self.env["TLT_SERVE_API_KEY"] = key
        self.delay = config.training.restart_delay_s
        self.training = config.training
        self.state = state
        self._lock = threading.Lock()  # proc start / signal / stop
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainer-supervisor", daemon=True)

    def start(self) -> None:
        log.info("starting the drafter trainer: %s", " ".join(self.cmd))
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                self.proc = subprocess.Popen(
                    self.cmd, env=self.env, preexec_fn=_child_setup(self.training.nice)
                )
                self.state.pid, self.state.suspended = self.proc.pid, False
            code = self.proc.wait()
            self.state.pid, self.state.suspended = None, False
            if self._stopping.is_set():
                return
            self.state.restarts += 1
            log.warning("drafter trainer exited (code %s); restart %d in %.1fs",
                        code, self.state.restarts, self.delay)
            self._stopping.wait(self.delay)

    def on_load(self, in_flight: int) -> None:
        """Suspend the trainer above ``max_running`` requests in flight, resume below."""
        busy = self.training.busy(in_flight)
        with self._lock:
            proc = self.proc
            if proc is None or proc.poll() is not None or busy == self.state.suspended:
                return
            try:
                os.kill(proc.pid, signal.SIGSTOP if busy else signal.SIGCONT)
            except ProcessLookupError:
                return
            self.state.suspended = busy

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            proc = self.proc
            if proc is not None and proc.poll() is None and self.state.suspended:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                self.state.suspended = False
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._thread.join(STOP_WAIT_S)
