"""Suffix drafts on recorded RL rollouts: how well their acceptance estimates are calibrated
and how many drafts each setting gets accepted in the small-batch phase, without timing.

The rollouts are ``benchmarks/rl_epochs.py``'s (the same prompts x n samples at T = 1, drift
version e at epoch e), recorded once with speculation off (``--samples``: reused when the file
exists). They are then replayed through ``SuffixDrafts`` as the engine would feed it: every
sample of an epoch decodes one token per step without drafting until at most ``--tail``
remain (the small-batch phase), finished samples join their prompt's history; in that phase
each step every running sample asks for a draft and advances by the drafts its sampled
continuation agrees with, plus one. For a draft that is a chain or tree of single tokens,
"the sampled token equals the draft" is accepted with the probability the target's sampler
gives that token, the same as the verifier's rejection test, so the accept lengths are those
a served rollout of these samples would have (the timing is not modelled). Between epochs
the proposer hears that the weights changed, as the engine tells it on a weight update.

The ceiling: every verify accepts as much as the best of the occurrences the lookup found
would have given (a perfect choice among them, chains 8 deep): what better counting or
scoring can reach without indexing more.

Sources: the occurrences the lookups found, by who wrote them, and how often what followed
them was the sampled token.

Calibration: for every drafted chain node (depth 8, no cut) its estimated acceptance against
whether it was accepted, with and without count smoothing.

    python -m benchmarks.suffix_accept
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks import report, rl_epochs
from benchmarks.serverproc import running_server
from tlt_serve.engine.request import Request
from tlt_serve.sampling_params import SamplingParams
from tlt_serve.speculative.suffix import Match, SuffixConfig
from tlt_serve.speculative.suffix_proposer import SuffixDrafts

# (label, config, depth, budget, top-k)
SETTINGS = [
    ("chain, cut 0.1", SuffixConfig(), 8, 8, 1),
    ("chain, cut 0.3", SuffixConfig(min_prob=0.3), 8, 8, 1),
    ("chain, cut 0.6", SuffixConfig(min_prob=0.6), 8, 8, 1),
    ("tree 4 children, 16 nodes", SuffixConfig(), 8, 16, 4),
    ("chain, cut 0.1, earlier epochs not discounted", SuffixConfig(stale_weight=1.0), 8, 8, 1),
    ("chain, unsmoothed, 3-token keys, depth <= match",
     SuffixConfig(key_len=3, smoothing=0.0, spec_factor=1.0), 8, 8, 1),
]
CEILING = "ceiling: the best occurrence found, depth 8"
BINS = 10


def record(a: Any) -> list[list[dict[str, Any]]]:
    """Every epoch's samples (prompt ids and output ids), speculation off."""
    prompts, versions = rl_epochs.workload(a)
    epochs = []
    with running_server(rl_epochs.server_flags(a, "off")) as url:
        for e in range(a.epochs):
            rl_epochs.load_epoch_weights(url, versions, e)
            reqs = rl_epochs.epoch_requests(a, prompts, e)
            outs = asyncio.run(_generate(url, reqs, f"record epoch {e}"))
            epochs.append([{"prompt": ids, "ids": o} for (ids, _), o in zip(reqs, outs,
                                                                             strict=True)])
    return epochs


async def _generate(url: str, reqs: list, label: str) -> list[list[int]]:
    limits = httpx.Limits(max_connections=len(reqs) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=7200, limits=limits) as http:
        bar = tqdm(total=len(reqs), desc=label)

        async def one(ids: list[int], params: dict) -> list[int]:
            r = await http.post("/generate", json={"input_ids": ids, "sampling_params": params})
            r.raise_for_status()
            bar.update(1)
            return r.json()["output_ids"]

        outs = await asyncio.gather(*(one(i, p) for i, p in reqs))
        bar.close()
    return list(outs)


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


def _best_occurrence(match: Match, own: Sequence[int], truth: list[int], depth: int) -> int:
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


def replay(epochs: list[list[dict[str, Any]]], config: SuffixConfig, depth: int, budget: int,
           topk: int, tail: int, calibration: list | None = None, ceiling: bool = False,
           sources: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    """Accept length per epoch in the small-batch phase (module docstring). ``ceiling``: each
    verify accepts what the best of the occurrences the lookup found would have (the most
    a choice among them can get, chains ``depth`` deep). ``sources``: per writer of the
    occurrences found (the sample itself, this epoch, k epochs before, the prompt or other
    prompts), [occurrences, those followed by the sampled token]."""
    drafts = SuffixDrafts(config)
    written: dict[int, int] = {}  # id of a sample's indexed sequence -> its epoch
    rows = []
    for e, samples in enumerate(epochs):
        if e:
            drafts.weights_changed()  # the next drift version writes this epoch
        reqs = []
        for i, s in enumerate(samples):
            params = SamplingParams(max_new_tokens=max(1, len(s["ids"])))
            r = Request(f"{e}-{i}", s["prompt"], params, None)
            reqs.append((r, s["ids"]))
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


def _count_sources(sources: dict[str, list[int]], lookup: tuple[Match, Sequence[int]],
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
    pairs: list[tuple[float, bool]] = []
    cfg = SuffixConfig(smoothing=smoothing, min_prob=0.0, spec_factor=8.0)
    replay(epochs, cfg, 8, 8, 1, tail, calibration=pairs)
    bins = [[0, 0] for _ in range(BINS)]
    for p, ok in pairs:
        b = bins[min(int(p * BINS), BINS - 1)]
        b[0], b[1] = b[0] + 1, b[1] + ok
    return [{"estimated": [i / BINS, (i + 1) / BINS], "nodes": n,
             "accepted": round(k / n, 3) if n else None} for i, (n, k) in enumerate(bins)]


def plot(result: dict[str, Any], png: Path) -> None:
    plt = report.pyplot()
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
    report.save(fig, png)


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__)
    rl_epochs.workload_arguments(p)
    p.set_defaults(max_len=1024)
    p.add_argument("--tail", type=int, default=8, help="the small-batch phase: this many left")
    p.add_argument("--samples", default="benchmarks/results/suffix_accept_samples.json",
                   help="recorded rollouts (written when missing)")
    p.add_argument("--out", default="benchmarks/results/suffix_accept.json")
    a = p.parse_args(argv)
    a.spec_max_batch, a.configs, a.drafter = a.tail, "off", None
    path = Path(a.samples)
    if not path.exists():
        path.write_text(json.dumps(record(a)))
    epochs = json.loads(path.read_text())
    calibration = {f"smoothing {s}": calibrate(epochs, s, a.tail) for s in (0.0, 0.5)}
    accept = {}
    for label, cfg, depth, budget, topk in tqdm(SETTINGS, desc="settings"):
        accept[label] = replay(epochs, cfg, depth, budget, topk, a.tail)
    accept[CEILING] = replay(epochs, SuffixConfig(), 8, 8, 1, a.tail, ceiling=True)
    counts: dict[str, list[int]] = {}
    replay(epochs, SuffixConfig(), 8, 8, 1, a.tail, sources=counts)
    sources = {k: {"occurrences": n, "next_token_right": round(k_ / n, 3)}
               for k, (n, k_) in sorted(counts.items())}
    print("occurrences found, by writer:", sources)
    for label, rows in accept.items():
        print(f"{label}: " + ", ".join(
            f"e{r['epoch']} {r['accept_length']} ({r['drafted_per_verify']} drafted)"
            for r in rows))
    for label, table in calibration.items():
        print(label, [(r["estimated"][0], r["nodes"], r["accepted"]) for r in table])
    args = {k: v for k, v in vars(a).items() if isinstance(v, (int, float, str, type(None)))}
    report.write({"benchmark": "suffix_accept", "args": args, "sources": sources,
                  "calibration": calibration,
                  "accept": accept}, a.out, plot)


if __name__ == "__main__":
    main()
