"""How long one GRPO policy update takes on this machine: the idle gap a rollout server sees.

The update of ``clients/grpo.py`` (fp32 policy, clipped policy-gradient loss, micro-batches of
``--micro-batch`` sequences) over ``--seqs`` task prompts with responses of ``--tokens``
tokens, every sequence carrying an advantage (the most work a step of that size does).
``benchmarks/adaptation.py`` idles its server this long between rollout phases.

    python -m benchmarks.grpo_step --seqs 96 --tokens 60
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks import report
from clients.grpo import Rollout, policy_update
from clients.policy import load_policy
from clients.results import Sample
from clients.tasks import make_problems, prompt_ids
from tlt_serve.models.provision import resolve_model_path
from tlt_serve.models.tokenizer import load_tokenizer


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seqs", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=60, help="response tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON result path")
    a = ap.parse_args()
    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    policy = load_policy(path)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-7)
    problems = make_problems(a.seqs, seed=1)
    answer = tok.encode(" Let me work it out step by step." * a.tokens)[: a.tokens]
    rollouts = [
        Rollout(p, ids, Sample("", tuple(answer), tuple([-1.0] * len(answer)), "length",
                               len(ids), "0", ("0",), None, f"r{i}", 0.0),
                1.0, 1.0 if i % 2 else -1.0)
        for i, (p, ids) in enumerate(zip(problems, prompt_ids(tok, problems), strict=True))
    ]
    seconds = []
    for r in range(a.repeats):
        t0 = time.perf_counter()
        policy_update(policy, opt, rollouts, a.micro_batch, clip=0.2)
        seconds.append(time.perf_counter() - t0)
        print(f"update {r}: {seconds[-1]:.1f} s ({a.seqs} sequences x {a.tokens} tokens)")
    result = {"benchmark": "grpo_step", "args": vars(a), "threads": torch.get_num_threads(),
              "seconds": [round(s, 2) for s in seconds],
              "median_s": round(statistics.median(seconds), 2)}
    print(json.dumps({**result, **report.stamp()}))  # the only output without --out
    if a.out:
        report.write(result, a.out)


if __name__ == "__main__":
    main()
