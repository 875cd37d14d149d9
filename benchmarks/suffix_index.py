"""Suffix index cost: memory per indexed token, time per appended token and per draft, and
how often a draft is right, for the own index (``tlt_serve/speculative/suffix_proposer.py``)
and, when importable, arctic-inference's ``SuffixDecodingCache`` (what vLLM's ``suffix``
method uses), on the same token streams.

The streams are rollout-shaped: ``--groups`` prompts x ``--n`` samples of ``--length`` tokens
over a 49152-token vocabulary; the samples of a prompt share most of their text (each
``--span``-token span is replaced by fresh tokens with probability ``--mutate``), as sibling
samples of one prompt at T = 1 do. Samples are appended token by token, a prompt's samples
interleaved (they decode side by side); after each token one draft of up to ``--k`` tokens
is asked for, and scored by how many of its leading tokens the sample then writes.

    python -m benchmarks.suffix_index
"""

from __future__ import annotations

import gc
import os
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import report
from tlt_serve.engine.request import Request
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative.suffix_proposer import SuffixDrafts

VOCAB = 49152


def streams(a: Any) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt, samples) per group."""
    rng = random.Random(a.seed)
    out = []
    for _ in range(a.groups):
        prompt = [rng.randrange(VOCAB) for _ in range(64)]
        base = [rng.randrange(VOCAB) for _ in range(a.length)]
        samples = []
        for _ in range(a.n):
            s = list(base)
            for lo in range(0, a.length, a.span):
                if rng.random() < a.mutate:
                    s[lo : lo + a.span] = [rng.randrange(VOCAB) for _ in s[lo : lo + a.span]]
            samples.append(s)
        out.append((prompt, samples))
    return out


class Own:
    name = "tlt-serve suffix"

    def __init__(self) -> None:
        self.drafts = SuffixDrafts()
        self.reqs: dict[str, Request] = {}

    def start(self, rid: str, prompt: list[int]) -> None:
        self.reqs[rid] = Request(rid, prompt, SamplingParams(max_new_tokens=1 << 20), None)

    def append(self, rid: str, token: int) -> None:
        self.reqs[rid].output_ids.append(token)

    def draft(self, rid: str, k: int) -> list[int]:
        return self.drafts.propose([self.reqs[rid]], [k])[0]

    def stop(self, rid: str) -> None:
        self.drafts.release(self.reqs.pop(rid))


class Arctic:
    name = "arctic-inference SuffixDecodingCache"

    def __init__(self) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=-1)
        self.context: dict[str, list[int]] = {}

    def start(self, rid: str, prompt: list[int]) -> None:
        self.cache.start_request(rid, prompt)
        self.context[rid] = list(prompt)

    def append(self, rid: str, token: int) -> None:
        self.cache.add_active_response(rid, [token])
        self.context[rid].append(token)

    def draft(self, rid: str, k: int) -> list[int]:
        d = self.cache.speculate(rid, self.context[rid][-24:], max_spec_tokens=k,
                                 max_spec_factor=1.0, min_token_prob=0.1)
        return list(d.token_ids)

    def stop(self, rid: str) -> None:
        self.cache.stop_request(rid)
        del self.context[rid]

    def estimate_memory(self) -> int:
        """Bytes its C++ trees hold, as they count them (tracemalloc cannot see them)."""
        return int(self.cache._global_tree.estimate_memory())


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(index_cls: Any, data: list, a: Any) -> dict[str, Any]:
    """Two passes over the streams: timed, then with memory tracing (which slows Python)."""
    timed = one_pass(index_cls, data, a, trace=False)
    traced = one_pass(index_cls, data, a, trace=True)
    return {**timed, **{k: v for k, v in traced.items() if "bytes" in k}}


def one_pass(index_cls: Any, data: list, a: Any, trace: bool) -> dict[str, Any]:
    gc.collect()
    rss0 = rss()
    if trace:
        tracemalloc.start()
    index = index_cls()
    append_s = draft_s = 0.0
    drafted = right = drafts = tokens = 0
    for g, (prompt, samples) in enumerate(tqdm(data, desc=index_cls.name)):
        rids = [f"{g}-{j}" for j in range(len(samples))]
        for rid in rids:
            index.start(rid, prompt)
        for step in range(a.length + a.lag * (len(samples) - 1)):
            for j, (rid, s) in enumerate(zip(rids, samples, strict=True)):
                pos = step - a.lag * j
                if not 0 <= pos < a.length:
                    continue
                t0 = time.perf_counter()
                index.append(rid, s[pos])
                t1 = time.perf_counter()
                d = index.draft(rid, a.k)
                draft_s += time.perf_counter() - t1
                append_s += t1 - t0
                tokens += 1
                drafts += 1
                drafted += len(d)
                for x, y in zip(d, s[pos + 1 :], strict=False):
                    if x != y:
                        break
                    right += 1
        for rid in rids:
            index.stop(rid)
    current = tracemalloc.get_traced_memory()[0] if trace else 0
    tracemalloc.stop()
    grown = rss() - rss0
    own_tokens = getattr(getattr(index, "drafts", None), "num_tokens", None)
    estimated = index.estimate_memory() if hasattr(index, "estimate_memory") else None
    del index
    gc.collect()
    return {"index": index_cls.name, "tokens": tokens,
            "traced_bytes_per_token": round(current / tokens, 1),
            "rss_bytes_per_token": round(grown / tokens, 1),
            "estimated_bytes_per_token": estimated and round(estimated / tokens, 1),
            "indexed_tokens": own_tokens,
            "append_us_per_token": round(append_s / tokens * 1e6, 2),
            "draft_us": round(draft_s / drafts * 1e6, 2),
            "drafted_per_draft": round(drafted / drafts, 2),
            "right_per_draft": round(right / drafts, 2)}


def plot(result: dict[str, Any], png: Path) -> None:
    plt = report.pyplot()
    rows = result["results"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, label in zip(axes, ("rss_bytes_per_token", "draft_us", "right_per_draft"),
                              ("bytes per token", "us per draft", "right tokens per draft"),
                              strict=True):
        ax.bar([r["index"].split()[0] for r in rows], [r[key] or 0 for r in rows])
        ax.set_title(label)
    fig.suptitle(f"{result['machine']}, {result['date']}", fontsize=8)
    report.save(fig, png)


def main() -> None:
    p = report.parser(__doc__)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--span", type=int, default=20)
    p.add_argument("--mutate", type=float, default=0.2)
    p.add_argument("--lag", type=int, default=16)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/suffix_index.json")
    a = p.parse_args()
    data = streams(a)
    indexes: list[Any] = [Own]  # first: its resident-set growth is the one that means much
    try:
        import arctic_inference.suffix_decoding  # noqa: F401

        indexes.append(Arctic)
    except ImportError:
        print("arctic-inference is not importable here: measuring the own index only")
    results = [measure(cls, data, a) for cls in indexes]
    for r in results:
        print(r)
    report.write({"benchmark": "suffix_index", "args": vars(a), "results": results}, a.out,
                 plot)


if __name__ == "__main__":
    main()
