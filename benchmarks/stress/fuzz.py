"""Fuzz the real server with schemathesis (its CLI) against the server's own OpenAPI
document: every operation, generated valid and invalid requests, phases examples + coverage
+ fuzzing. Passes when no response is a 5xx and none takes longer than --max-response-s.

    python -m benchmarks.stress.fuzz --max-examples 100

Serves the embedded default model (bf16) with separate API and admin keys and a 5 s
request timeout (which bounds every generation the fuzzer asks for); the fuzzer calls with
the admin key so each case reaches its handler. ``/init_weights_update_group`` and
``/update_weights_from_distributed`` are left out: by contract their replies wait (up to
``timeout_s``, default 120 s) until rank 0 of a torch.distributed group connects. Counts by
status and operation come from the HAR log; writes benchmarks/results/fuzz.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence

import httpx

from benchmarks.common.results import parse, parser, report
from benchmarks.common.servers import running_server

ADMIN = "fuzz-admin-key"
BLOCKING = ("/init_weights_update_group", "/update_weights_from_distributed")


def main(argv: Sequence[str] | None = None) -> None:
    ap = parser(__doc__, "fuzz")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-examples", type=int, default=100, help="per operation and phase")
    ap.add_argument("--max-response-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    a = parse(ap, argv)
    har = a.out.with_suffix(".har")
    args = ["--model", a.model, "--api-key", "fuzz-user-key", "--admin-key", ADMIN,
            "--request-timeout", "5", "--max-model-len", "1024", "--max-num-seqs", "16"]
    t0 = time.monotonic()
    with running_server(args) as url:
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
               "-H", f"Authorization: Bearer {ADMIN}", "--checks", "not_a_server_error",
               "--max-response-time", str(a.max_response_s), "-n", str(a.max_examples),
               "--seed", str(a.seed), "--phases", "examples,coverage,fuzzing",
               "--request-timeout", str(a.max_response_s + 30), "--report", "har",
               "--report-har-path", str(har), "--continue-on-failure", "--workers", "1"]
        for path in BLOCKING:
            cmd += ["--exclude-path", path]
        code = subprocess.call(cmd)
        auth = {"Authorization": f"Bearer {ADMIN}"}
        httpx.post(f"{url}/continue_generation", headers=auth, timeout=30)
        alive = httpx.post(f"{url}/generate", headers=auth, timeout=120, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        stats = httpx.get(f"{url}/get_server_info", headers=auth, timeout=30).json()["stats"]
        doc = httpx.get(f"{url}/openapi.json", headers=auth, timeout=30).json()
    operations = sum(len(ops) for path, ops in doc["paths"].items() if path not in BLOCKING)
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = Counter(e["response"]["status"] for e in entries)
    per_op = Counter(f'{e["request"]["method"]} {httpx.URL(e["request"]["url"]).path}'
                     for e in entries)
    result = {
        "schemathesis_exit_code": code,
        "cases": len(entries), "operations": operations,
        "method_path_pairs": len(per_op),  # incl. undocumented methods (405s)
        "by_status": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(v for k, v in statuses.items() if k >= 500),
        "slowest_s": max((e["time"] / 1000 for e in entries), default=0.0),
        "alive_after": alive.status_code == 200,
        "left_running": stats["running"], "left_waiting": stats["waiting"],
        "wall_s": round(time.monotonic() - t0, 1), "excluded": list(BLOCKING),
        "cases_per_operation": dict(sorted(per_op.items())),
    }
    report(a, result)
    har.unlink()
    print(json.dumps({k: v for k, v in result.items() if k != "cases_per_operation"}, indent=1))
    ok = code == 0 and result["server_errors"] == 0 and result["alive_after"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
