"""Drafts from rollout history: suffix drafts (``tlt_serve/speculative/suffix_proposer.py``)
on recorded RL rollouts, and what their index costs.

  accept  suffix drafts replayed over recorded epochs (``rollout epochs``' rollouts, recorded
          once with speculation off): how well their acceptance estimates are calibrated and
          the accept length each setting gets in the small-batch phase, no timing
  index   the suffix index's cost (memory, time per token and per draft) against
          arctic-inference's, on rollout-shaped token streams

    python -m benchmarks.history accept
    python -m benchmarks.history index
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import load
from benchmarks.common.results import RESULTS, pyplot, report, save, tool
from benchmarks.common.servers import running_server
from benchmarks.rollout import (
    epoch_arguments,
    epoch_requests,
    epoch_server,
    epoch_workload,
    load_epoch_weights,
)

# ---- accept ------------------------------------------------------------------------------

# (label, SuffixConfig overrides, depth, budget, top-k)
SETTINGS: list[tuple[str, dict[str, float], int, int, int]] = [
    ("chain, cut 0.1", {}, 8, 8, 1),
    ("chain, cut 0.3", {"min_prob": 0.3}, 8, 8, 1),
    ("chain, cut 0.6", {"min_prob": 0.6}, 8, 8, 1),
    ("tree 4 children, 16 nodes", {}, 8, 16, 4),
    ("chain, cut 0.1, earlier epochs not discounted", {"stale_weight": 1.0}, 8, 8, 1),
    ("chain, unsmoothed, 3-token keys, depth <= match",
     {"key_len": 3, "smoothing": 0.0, "spec_factor": 1.0}, 8, 8, 1),
]
CEILING = "ceiling: the best occurrence found, depth 8"
BINS = 10


def record(a: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """Every epoch's samples (prompt ids and output ids), speculation off."""
    prompts, versions = epoch_workload(a)
    out = []
    with running_server(epoch_server(a, "off")) as url:
        for e in range(a.epochs):
            load_epoch_weights(url, versions, e)
            reqs = epoch_requests(a, prompts, e)
            outs = asyncio.run(load.generate_all(url, reqs, f"record epoch {e}"))
            out.append([{"prompt": ids, "ids": o["output_ids"]}
                        for (ids, _), o in zip(reqs, outs, strict=True)])
    return out


def _accepted(tokens: list[int], parents: list[int], truth: list[int]) -> tuple[int, list[bool]]:
    """The deepest draft node whose path the sampled continuation follows, and per node
    whether it is on that path's prefix (accepted)."""
    depth, ok, best = [0], [True], 0
    for t, p in zip(tokens, parents, strict=True):
        d = depth[p] + 1
        depth.append(d)
        ok.append(ok[p] and d < len(truth) and truth[d - 1] == t)
        best = max(best, d) if ok[-1] else best
    return best, ok[1:]


def _best_occurrence(match: Any, own: Sequence[int], truth: list[int], depth: int) -> int:
    """How far the sampled continuation agrees with what followed the best occurrence of the
    match (an occurrence in the sequence itself that reaches its end goes on with the
    continuation: the period of a loop)."""
    best = 0
    for seq, pos, _ in match.at:
        n = 0
        while n < min(depth, len(truth)):
            i = pos + n
            t = seq[i] if i < len(seq) else truth[i - len(seq)] if seq is own else None
            if t != truth[n]:
                break
            n += 1
        best = max(best, n)
    return best


def replay(epochs: list[list[dict[str, Any]]], config: Any, depth: int, budget: int,
           topk: int, tail: int, calibration: list | None = None, ceiling: bool = False,
           sources: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    """Accept length per epoch in the small-batch phase (``accept``'s docstring).
    ``ceiling``: each verify accepts what the best of the occurrences the lookup found would
    have (the most a choice among them can get, chains ``depth`` deep). ``sources``: per
    writer of the occurrences found (the sample itself, this epoch, k epochs before, the
    prompt or other prompts), [occurrences, those followed by the sampled token]."""
    from tlt_serve.engine.request import Request
    from tlt_serve.sampling_params import SamplingParams
    from tlt_serve.speculative.suffix_proposer import SuffixDrafts

    drafts = SuffixDrafts(config)
    written: dict[int, int] = {}  # id of a sample's indexed sequence -> its epoch
    rows = []
    for e, samples in enumerate(epochs):
        if e:
            drafts.weights_changed()  # the next drift version writes this epoch
        reqs = [(Request(f"{e}-{i}", s["prompt"],
                         SamplingParams(max_new_tokens=max(1, len(s["ids"]))), None), s["ids"])
                for i, s in enumerate(samples)]
        lengths = sorted(len(ids) for _, ids in reqs)
        start = lengths[-tail - 1] if len(lengths) > tail else 0
        running = []
        for r, ids in reqs:
            r.output_ids = ids[:start]
            written[id(drafts.lookup(r)[1])] = e
            if len(r.output_ids) >= len(ids):
                drafts.release(r)
            else:
                running.append((r, ids))
        verifies = accepted = drafted = 0
        while running:
            nxt = []
            for r, ids in running:
                truth = ids[len(r.output_ids):]
                if sources is not None:
                    _count_sources(sources, drafts.lookup(r), truth[0], written, e)
                if ceiling:
                    match, own = drafts.lookup(r)
                    best, n = _best_occurrence(match, own, truth, depth), depth
                else:
                    d = drafts.draft(r, depth, budget, topk)
                    (best, ok), n = _accepted(d.tokens, d.parents, truth), len(d.tokens)
                    if calibration is not None:
                        calibration += zip(d.probs, ok, strict=True)
                verifies, accepted, drafted = verifies + 1, accepted + best, drafted + n
                r.output_ids = ids[: len(r.output_ids) + best + 1]
                if len(r.output_ids) >= len(ids):
                    drafts.release(r)
                else:
                    nxt.append((r, ids))
            running = nxt
        rows.append({"epoch": e, "phase_starts_at": start, "verifies": verifies,
                     "accept_length": round(accepted / verifies, 3) if verifies else None,
                     "drafted_per_verify": round(drafted / verifies, 2) if verifies else None})
    return rows


def _count_sources(sources: dict[str, list[int]], lookup: tuple[Any, Sequence[int]],
                   truth: int, written: dict[int, int], epoch: int) -> None:
    match, own = lookup
    for seq, pos, _ in match.at:
        if pos >= len(seq):
            continue
        e = written.get(id(seq))
        label = ("itself" if seq is own else "prompt or other prompts" if e is None
                 else "this epoch" if e == epoch else f"{epoch - e} epoch(s) before")
        n = sources.setdefault(label, [0, 0])
        n[0], n[1] = n[0] + 1, n[1] + (seq[pos] == truth)


def calibrate(epochs: list, smoothing: float, tail: int) -> list[dict[str, Any]]:
    """Per estimated-acceptance bin: drafted nodes and the fraction accepted."""
    from tlt_serve.speculative.suffix import SuffixConfig

    pairs: list[tuple[float, bool]] = []
    cfg = SuffixConfig(smoothing=smoothing, min_prob=0.0, spec_factor=8.0)
    replay(epochs, cfg, 8, 8, 1, tail, calibration=pairs)
    bins = [[0, 0] for _ in range(BINS)]
    for p, ok in pairs:
        b = bins[min(int(p * BINS), BINS - 1)]
        b[0], b[1] = b[0] + 1, b[1] + ok
    return [{"estimated": [i / BINS, (i + 1) / BINS], "nodes": n,
             "accepted": round(k / n, 3) if n else None} for i, (n, k) in enumerate(bins)]


def accept(a: argparse.Namespace) -> Path:
    """Suffix drafts on recorded RL rollouts: how well their acceptance estimates are
    calibrated and how many drafts each setting gets accepted in the small-batch phase,
    without timing. The rollouts are ``epochs``' (the same prompts x n samples at T = 1,
    drift version e at epoch e), recorded once with speculation off (``--samples``: reused
    when the file exists). They are replayed through ``SuffixDrafts`` as the engine feeds
    it: every sample of an epoch decodes one token per step without drafting until at most
    ``--tail`` remain (the small-batch phase), finished samples join their prompt's
    history; in that phase each step every running sample asks for a draft and advances by
    the drafts its sampled continuation agrees with, plus one (the verifier's rejection
    test accepts a single-token draft with the probability the target's sampler gives it,
    so these are the accept lengths a served rollout of these samples would have). Between
    epochs the proposer hears that the weights changed. The ceiling: every verify accepts
    what the best of the occurrences the lookup found would have given (what better
    counting or scoring can reach without indexing more). Sources: the occurrences found,
    by who wrote them, and how often what followed them was the sampled token.
    Calibration: every drafted chain node's (depth 8, no cut) estimated acceptance against
    whether it was accepted, with and without count smoothing."""
    from tlt_serve.speculative.suffix import SuffixConfig

    path = Path(a.samples)
    if not path.exists():
        path.write_text(json.dumps(record(a)))
    recorded = json.loads(path.read_text())
    calibration = {f"smoothing {s}": calibrate(recorded, s, a.tail) for s in (0.0, 0.5)}
    accept = {label: replay(recorded, SuffixConfig(**kw), depth, budget, topk, a.tail)
              for label, kw, depth, budget, topk in tqdm(SETTINGS, desc="settings")}
    accept[CEILING] = replay(recorded, SuffixConfig(), 8, 8, 1, a.tail, ceiling=True)
    counts: dict[str, list[int]] = {}
    replay(recorded, SuffixConfig(), 8, 8, 1, a.tail, sources=counts)
    sources = {k: {"occurrences": n, "next_token_right": round(right / n, 3)}
               for k, (n, right) in sorted(counts.items())}
    print("occurrences found, by writer:", sources)
    for label, rows in accept.items():
        print(f"{label}: " + ", ".join(f"e{r['epoch']} {r['accept_length']} "
                                       f"({r['drafted_per_verify']} drafted)" for r in rows))
    return report(a, {"sources": sources, "calibration": calibration, "accept": accept},
                  plot_accept)


def plot_accept(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, table in result["calibration"].items():
        xs = [sum(r["estimated"]) / 2 for r in table if r["nodes"]]
        ax1.plot(xs, [r["accepted"] for r in table if r["nodes"]], marker="o", label=label)
    ax1.plot([0, 1], [0, 1], color="grey", linestyle=":")
    ax1.set(xlabel="estimated acceptance of a drafted node", ylabel="fraction accepted",
            title="calibration (chain nodes, depth 8)")
    ax1.legend(fontsize=7)
    for label, rows in result["accept"].items():
        ax2.plot([r["epoch"] for r in rows], [r["accept_length"] or 0 for r in rows],
                 marker="o", label=label)
    ax2.set(xlabel="epoch (weights drift between epochs)", ylabel="accepted drafts per verify",
            title=f"small-batch phase (<= {result['args']['tail']} running)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"recorded rollouts, {result['machine']}, {result['date']}", fontsize=8)
    save(fig, png)


def _accept_arguments(p: argparse.ArgumentParser) -> None:
    epoch_arguments(p, None, 1024)
    p.add_argument("--tail", type=int, default=8, help="the small-batch phase: this many left")
    p.add_argument("--samples", default=str(RESULTS / "suffix_accept_samples.json"),
                   help="recorded rollouts (written when missing)")


# ---- index -------------------------------------------------------------------------------

VOCAB = 49152


def streams(a: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
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


class OwnIndex:
    name = "tlt-serve suffix"

    def __init__(self) -> None:
        from tlt_serve.speculative.suffix_proposer import SuffixDrafts

        self.drafts = SuffixDrafts()
        self.reqs: dict[str, Any] = {}

    def start(self, rid: str, prompt: list[int]) -> None:
        from tlt_serve.engine.request import Request
        from tlt_serve.sampling_params import SamplingParams

        self.reqs[rid] = Request(rid, prompt, SamplingParams(max_new_tokens=1 << 20), None)

    def append(self, rid: str, token: int) -> None:
        self.reqs[rid].output_ids.append(token)

    def draft(self, rid: str, k: int) -> list[int]:
        return self.drafts.propose([self.reqs[rid]], [k])[0]

    def stop(self, rid: str) -> None:
        self.drafts.release(self.reqs.pop(rid))


class ArcticIndex:
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


def index_pass(index_cls: Any, data: list, a: argparse.Namespace,
               trace: bool) -> dict[str, Any]:
    """Every stream appended token by token into a fresh index, a prompt's samples
    interleaved ``--lag`` tokens apart, a draft asked for after each token."""
    gc.collect()
    rss0 = rss()
    if trace:
        tracemalloc.start()
    idx = index_cls()
    append_s = draft_s = 0.0
    drafted = right = tokens = 0
    for g, (prompt, samples) in enumerate(tqdm(data, desc=index_cls.name)):
        rids = [f"{g}-{j}" for j in range(len(samples))]
        for rid in rids:
            idx.start(rid, prompt)
        for step in range(a.length + a.lag * (len(samples) - 1)):
            for j, (rid, s) in enumerate(zip(rids, samples, strict=True)):
                pos = step - a.lag * j
                if not 0 <= pos < a.length:
                    continue
                t0 = time.perf_counter()
                idx.append(rid, s[pos])
                t1 = time.perf_counter()
                d = idx.draft(rid, a.k)
                draft_s += time.perf_counter() - t1
                append_s += t1 - t0
                tokens += 1
                drafted += len(d)
                for x, y in zip(d, s[pos + 1 :], strict=False):
                    if x != y:
                        break
                    right += 1
        for rid in rids:
            idx.stop(rid)
    current = tracemalloc.get_traced_memory()[0] if trace else 0
    tracemalloc.stop()
    grown = rss() - rss0
    own_tokens = getattr(getattr(idx, "drafts", None), "num_tokens", None)
    estimated = idx.estimate_memory() if hasattr(idx, "estimate_memory") else None
    del idx
    gc.collect()
    return {"index": index_cls.name, "tokens": tokens,
            "traced_bytes_per_token": round(current / tokens, 1),
            "rss_bytes_per_token": round(grown / tokens, 1),
            "estimated_bytes_per_token": estimated and round(estimated / tokens, 1),
            "indexed_tokens": own_tokens,
            "append_us_per_token": round(append_s / tokens * 1e6, 2),
            "draft_us": round(draft_s / tokens * 1e6, 2),
            "drafted_per_draft": round(drafted / tokens, 2),
            "right_per_draft": round(right / tokens, 2)}


def index(a: argparse.Namespace) -> Path:
    """The suffix index's cost against arctic-inference's. Memory per indexed token, time per
    appended token and per draft, and how often a draft is right, for the own index
    (``SuffixDrafts``) and, when importable, arctic-inference's ``SuffixDecodingCache`` (what
    vLLM's ``suffix`` method uses), on the same token streams. The streams are rollout-shaped:
    ``--groups`` prompts x ``--n`` samples of ``--length`` tokens over a 49152-token
    vocabulary; the samples of a prompt share most of their text (each ``--span``-token span is
    replaced by fresh tokens with probability ``--mutate``), as sibling samples of one prompt
    at T = 1 do. After each token one draft of up to ``--k`` tokens is asked for, and scored by
    how many of its leading tokens the sample then writes. Two passes per index: timed, then
    with memory tracing (which slows Python)."""
    data = streams(a)
    indexes: list[Any] = [OwnIndex]  # first: its resident-set growth is the one that means much
    try:
        import arctic_inference.suffix_decoding  # noqa: F401

        indexes.append(ArcticIndex)
    except ImportError:
        print("arctic-inference is not importable here: measuring the own index only")
    results = []
    for cls in indexes:
        timed, traced = index_pass(cls, data, a, False), index_pass(cls, data, a, True)
        results.append({**timed, **{k: v for k, v in traced.items() if "bytes" in k}})
        print(results[-1])
    return report(a, {"results": results}, plot_index)


def plot_index(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    rows = result["results"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, label in zip(axes, ("rss_bytes_per_token", "draft_us", "right_per_draft"),
                              ("bytes per token", "us per draft", "right tokens per draft"),
                              strict=True):
        ax.bar([r["index"].split()[0] for r in rows], [r[key] or 0 for r in rows])
        ax.set_title(label)
    fig.suptitle(f"{result['machine']}, {result['date']}", fontsize=8)
    save(fig, png)


def _index_arguments(p: argparse.ArgumentParser) -> None:
    for flag, default in (("groups", 32), ("n", 8), ("length", 512), ("span", 20),
                          ("lag", 16), ("k", 8), ("seed", 0)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--mutate", type=float, default=0.2)


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "history", {
        "accept": (_accept_arguments, accept),
        "index": (_index_arguments, index),
    }, argv)


if __name__ == "__main__":
    main()
