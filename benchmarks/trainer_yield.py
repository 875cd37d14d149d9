"""How fast the online trainer gets out of the way: tick durations and yield latency.

A real server (capture on) gets a rollout so the trainer has data; the trainer then runs
(in this process, on the server's idle gaps) and, ``--trials`` times, a request arrives while
it trains. Yield latency = from sending the request to the trainer's first tick that saw the
gate closed (it does no training work after that). Also reported: the duration of training
ticks (gate check + one micro-step), which bounds the latency. Then the same with the trainer
supervised by the server (``--train-drafter``): time from sending a request until the trainer
process is stopped (SIGSTOP from the server).

    python -m benchmarks.trainer_yield --drafter PATH
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks import report
from benchmarks.prompts import chat_messages
from benchmarks.serverproc import running_server
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer
from trainer.link import ServerLink
from trainer.online import OnlineConfig, OnlineTrainer


class Recorder:
    """Wraps ``OnlineTrainer.tick`` to log (start, end, what) of every tick."""

    def __init__(self, trainer: OnlineTrainer) -> None:
        self.ticks: list[tuple[float, float, str]] = []
        inner = trainer.tick

        def tick() -> str:
            t0 = time.perf_counter()
            what = inner()
            self.ticks.append((t0, time.perf_counter(), what))
            return what

        trainer.tick = tick  # type: ignore[method-assign]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]


def proc_state(pid: int) -> str:
    """The process state letter from /proc (R running, S sleeping, T stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def post_then_set(http: httpx.Client, body: dict, done: threading.Event) -> None:
    http.post("/generate", json=body)
    done.set()


def supervised(args: argparse.Namespace, drafter: str, prompts: list[list[int]]) -> dict:
    """--train-drafter: latency from sending a request to the trainer process being stopped."""
    server = ["--model", args.model, "--speculative", "auto", "--drafter", drafter,
              "--train-drafter", "--trainer-state-dir", tempfile.mkdtemp(), "--max-num-seqs",
              "32"]
    latencies = []
    with running_server(server) as url, httpx.Client(base_url=url, timeout=1800) as http:
        params = {"max_new_tokens": 96, "temperature": 1.0, "ignore_eos": True}
        http.post("/generate", json={"input_ids": prompts, "sampling_params": params})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until it trains
            report = http.get("/get_drafter_info").json()["training"]["trainer"]
            if report and report["step"] > 0:
                break
            time.sleep(0.5)
        short = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
        for _ in range(args.trials):
            time.sleep(2.0)
            pid = http.get("/get_drafter_info").json()["training"]["pid"]
            done = threading.Event()
            body = {"input_ids": prompts[0], "sampling_params": short}
            t = threading.Thread(target=post_then_set, args=(http, body, done))
            sent = time.perf_counter()
            t.start()
            while proc_state(pid) != "T" and not done.is_set():
                time.sleep(0.0005)
            if not done.is_set():
                latencies.append(time.perf_counter() - sent)
            t.join()
    return {"n": len(latencies), "p50": statistics.median(latencies), "max": max(latencies),
            "all": [round(x, 4) for x in latencies]}


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--row-len", type=int, default=OnlineConfig.row_len)
    ap.add_argument("--out", default="benchmarks/results/trainer_yield.json")
    ap.add_argument("--skip-supervised", action="store_true")
    args = ap.parse_args()
    drafter = str(Path(args.drafter).expanduser().resolve())
    tok = load_tokenizer(resolve_model_path(args.model))
    server = ["--model", args.model, "--speculative", "auto", "--drafter", drafter,
              "--capture", "--max-num-seqs", "32"]
    with running_server(server) as url, httpx.Client(base_url=url, timeout=1800) as http:
        prompts = [tok.apply_chat_template(chat_messages(i)) for i in range(32)]
        params = {"max_new_tokens": 96, "temperature": 1.0, "ignore_eos": True}
        http.post("/generate", json={"input_ids": prompts, "sampling_params": params})
        cfg = OnlineConfig(server=url, state_dir=tempfile.mkdtemp(), init=drafter,
                           row_len=args.row_len, min_train_tokens=1024, eval_every=10**9)
        trainer = OnlineTrainer(cfg, ServerLink(url))
        rec = Recorder(trainer)
        thread = threading.Thread(target=trainer.run, daemon=True)
        thread.start()
        latencies, missed = [], 0
        # Long enough (~2 s here) that the trainer must notice it, short enough to repeat.
        short = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
        for _ in range(args.trials):
            time.sleep(2.0)  # let it train
            sent = time.perf_counter()
            http.post("/generate", json={"input_ids": prompts[0], "sampling_params": short})
            waiting = [t0 for t0, _, what in rec.ticks if what == "waiting" and t0 >= sent]
            if waiting:
                latencies.append(waiting[0] - sent)
            else:
                missed += 1
        trainer.stop.set()
        thread.join(30)
    train_ticks = [end - t0 for t0, end, what in rec.ticks if what == "trained"]
    out = {
        "benchmark": "trainer_yield",
        "args": vars(args),
        "train_tick_s": {"n": len(train_ticks), "p50": statistics.median(train_ticks),
                         "p99": pct(train_ticks, 0.99), "max": max(train_ticks)},
        "yield_latency_s": {"n": len(latencies), "missed": missed,
                            "p50": statistics.median(latencies), "max": max(latencies),
                            "all": [round(x, 4) for x in latencies]},
        "trainer_steps": trainer.step,
    }
    if not args.skip_supervised:
        prompts = [tok.apply_chat_template(chat_messages(i)) for i in range(32)]
        out["supervised_stop_latency_s"] = supervised(args, drafter, prompts)
    print(json.dumps(out, indent=2))
    report.write(out, args.out)


if __name__ == "__main__":
    main()
