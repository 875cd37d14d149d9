"""What online adaptation costs serving under full load: capture, and the idle trainer.

The same closed-loop workload (``concurrency`` clients, greedy, varied lengths) against three
server configurations, interleaved over ``rounds`` (this machine is shared and noisy):
``base`` (speculating with a drafter, as deployed), ``capture`` (+ ``--capture``) and
``trainer`` (+ ``--train-drafter``: capture, and the trainer process polling its gate, which
stays closed while requests are in flight). Reported as medians and ratios to ``base``.

Capture takes the features from the serving forwards (on vLLM: what vLLM hands its EAGLE
drafter). The alternative, a teacher-forced target forward over the captured token ids in
idle time, is timed too on the captured sequences (in this process, the own engine, same
dtype): its tokens/s against the served tokens/s says what share of serving it would cost.

    python -m benchmarks.adaptation_cost --drafter PATH --rounds 2 [--backend vllm]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import report
from benchmarks.served_vs_offline import served, workload
from benchmarks.serverproc import running_server
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer


def wait_for_trainer(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/get_drafter_info", timeout=30).json()["training"]
        if info["trainer"] is not None:
            return
        time.sleep(1.0)
    raise RuntimeError("the trainer never reported")


def captured_sequences(url: str) -> list[list[int]]:
    """Token ids of the samples the capture server kept."""
    from tlt_serve.engine.capture import decode_samples

    blob = httpx.get(f"{url}/drafter/samples", params={"max_bytes": 1 << 30}, timeout=300)
    return [s.tokens.tolist() for s in decode_samples(blob.content)]


def teacher_forced_tok_s(model: str, dtype: str, seqs: list[list[int]]) -> float | None:
    """Tokens/s of the target's teacher-forced forward over ``seqs`` (features only)."""
    if not seqs:
        return None
    from tlt_serve import LLM
    from trainer.data import target_features

    llm = LLM(model, dtype=dtype, max_model_len=2048)
    target_features(llm.engine.model, seqs[:2], 4096)  # warm-up
    t0 = time.perf_counter()
    target_features(llm.engine.model, seqs, 4096)
    return sum(len(s) for s in seqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", choices=["native", "vllm"], default="native")
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/adaptation_cost[_vllm].json")
    args = ap.parse_args()
    if args.out is None:
        suffix = "" if args.backend == "native" else f"_{args.backend}"
        args.out = f"benchmarks/results/adaptation_cost{suffix}.json"
    reqs = workload(load_tokenizer(resolve_model_path(args.model)), args.requests,
                    args.min_new, args.max_new)
    base = ["--model", args.model, "--dtype", args.dtype, "--max-num-seqs",
            str(args.concurrency), "--max-model-len", "1024", "--speculative", "auto",
            "--drafter", str(Path(args.drafter).expanduser().resolve()),
            "--backend", args.backend]
    state = tempfile.mkdtemp(prefix="tlt-trainer-")
    configs = {
        "base": base,
        "capture": [*base, "--capture"],
        "trainer": [*base, "--train-drafter", "--trainer-state-dir", state],
    }
    runs: dict[str, list[float]] = {name: [] for name in configs}
    captured: list[list[int]] = []
    for r in range(args.rounds):
        for name, server_args in configs.items():
            with running_server(server_args) as url:
                if name == "trainer":
                    wait_for_trainer(url)
                res = asyncio.run(served(url, reqs, args.concurrency))
                if name == "capture":
                    captured = captured_sequences(url)
            runs[name].append(res["tok_s"])
            print(f"round {r + 1} {name}: {res['tok_s']:.1f} tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in runs.items()}
    forced = teacher_forced_tok_s(args.model, args.dtype, captured)
    out = {
        "benchmark": "adaptation_cost",
        "args": vars(args),
        "tok_s": runs,
        "median_tok_s": med,
        "ratio_to_base": {name: med[name] / med["base"] for name in med},
        "captured_sequences": len(captured),
        "teacher_forced_tok_s": forced,
        # features by a teacher-forced forward instead of capture: seconds of it per second
        # of serving the same tokens
        "teacher_forced_share_of_serving": med["base"] / forced if forced else None,
    }
    print(json.dumps(out["ratio_to_base"], indent=2))
    report.write(out, args.out)


if __name__ == "__main__":
    main()
