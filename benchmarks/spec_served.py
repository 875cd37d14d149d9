"""Speculative decoding speed through the servers, backend against backend: what
``python -m benchmarks.spec_decode --backends native,vllm`` measures.

Every backend x method (off | ngram | drafter) is a fresh ``tlt-serve serve --backend B
--speculative M`` that speculates at every batch size measured (``--spec-max-batch`` and
``--max-num-seqs`` = the largest batch), measured the same way: warmed up once, then at each
batch size B one ``/generate`` call with B chat prompts as ``input_ids`` (each sequence its
own prompt, every configuration the same ones), greedy, ``max_new_tokens`` with EOS ignored:
output tokens per wall second of that call, accept length (``spec_accept_length``: accepted
drafts per verify step, bonus token excluded) and verify steps (``spec_verify_ct``). With
``--vllm-serve`` plain ``vllm serve`` (same python, dtype, max-model-len and max-num-seqs;
OpenAI ``/v1/completions`` with token-id prompts) is measured beside them.

Repeats restart every server, in alternating order (this host's speed drifts within a run;
a fixed order hands the drift to the configurations measured last); the configurations a
ratio compares are measured next to each other, and each ratio is the median of the
repeats' paired ratios, with their range.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.prompts import chat_messages
from benchmarks.serverproc import VLLM_SERVED_NAME, running_server, running_vllm

BACKENDS = ("native", "vllm")
METHODS = ("off", "ngram", "drafter")
SERVE = "vllm-serve"  # plain `vllm serve`, measured with method "off"


@dataclass(frozen=True)
class Config:
    backend: str  # native | vllm | vllm-serve
    method: str  # off | ngram | drafter

    @property
    def name(self) -> str:
        return SERVE if self.backend == SERVE else f"{self.backend}/{self.method}"


@dataclass
class Run:
    """One measured call: ``batch`` prompts, one configuration, one repeat."""

    rep: int
    backend: str
    method: str
    batch: int
    seconds: float
    tokens: int  # output tokens, all sequences
    tokens_per_s: float
    verify_ct: int = 0  # verify steps, summed over the sequences
    accepted: float = 0.0  # accepted drafts, summed over the sequences
    accept_length: float | None = None  # accepted / verify_ct (None: no speculation)
    lengths: list[int] = field(default_factory=list)
    output_ids: list[list[int]] | None = None  # kept out of the JSON

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        del out["output_ids"]
        return out


def order(backends: list[str], methods: list[str], vllm_serve: bool) -> list[Config]:
    """The configurations of one repeat. The ones a ratio compares are neighbours: the first
    backend's methods end with ``off``, then plain vLLM, then the next backend from ``off``
    on (its ``off`` beside vllm serve and beside the first backend's ``off``)."""
    out: list[Config] = []
    backends = sorted(backends, key=BACKENDS.index)  # native first: vllm serve beside vllm
    for i, backend in enumerate(backends):
        ms = sorted(methods, key=lambda m: m != "off")  # off first
        if i == 0 and len(backends) > 1:
            ms = ms[::-1]
        if backend == "vllm" and vllm_serve:
            out.append(Config(SERVE, "off"))
        out += [Config(backend, m) for m in ms]
    return out


def server_args(a: argparse.Namespace, cfg: Config, rows: int) -> list[str]:
    """``tlt-serve serve`` flags of one configuration (no port, no log level)."""
    flags = ["--model", a.model, "--backend", cfg.backend, "--dtype", a.dtype,
             "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(rows),
             "--spec-max-batch", str(getattr(a, "served_max_batch", None) or rows),
             "--speculative", cfg.method,
             "--num-draft-tokens", str(a.depth)]
    if cfg.method == "drafter":
        flags += ["--drafter", a.drafter,
                  "--min-draft-confidence", str(getattr(a, "min_draft_confidence", 0.0))]
    return flags


def vllm_serve_args(a: argparse.Namespace, rows: int) -> list[str]:
    return ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
            "--max-num-seqs", str(rows), *shlex.split(a.vllm_serve_args or "")]


def generate(http: httpx.Client, prompts: list[list[int]], a: argparse.Namespace,
             new_tokens: int) -> tuple[float, list[dict[str, Any]]]:
    """One ``/generate`` call with every prompt: (wall seconds, one output per prompt)."""
    params: dict[str, Any] = {"max_new_tokens": new_tokens, "temperature": a.temperature,
                              "ignore_eos": True}
    if a.temperature > 0:
        params["sampling_seed"] = 0
    t0 = time.perf_counter()
    resp = http.post("/generate", json={"input_ids": prompts, "sampling_params": params})
    dt = time.perf_counter() - t0
    resp.raise_for_status()
    outs = resp.json()
    return dt, outs if isinstance(outs, list) else [outs]


def complete(http: httpx.Client, prompts: list[list[int]], a: argparse.Namespace,
             new_tokens: int) -> tuple[float, list[dict[str, Any]]]:
    """One OpenAI ``/v1/completions`` call with every prompt (vLLM's ``ignore_eos`` and
    ``return_token_ids`` in the body): (wall seconds, one choice per prompt, in order)."""
    body: dict[str, Any] = {"model": VLLM_SERVED_NAME, "prompt": prompts,
                            "max_tokens": new_tokens, "temperature": a.temperature,
                            "ignore_eos": True, "return_token_ids": True}
    if a.temperature > 0:
        body["seed"] = 0
    t0 = time.perf_counter()
    resp = http.post("/v1/completions", json=body)
    dt = time.perf_counter() - t0
    resp.raise_for_status()
    return dt, sorted(resp.json()["choices"], key=lambda c: c["index"])


def measure(http: httpx.Client, cfg: Config, rep: int, prompts: list[list[int]],
            a: argparse.Namespace) -> Run:
    if cfg.backend == SERVE:
        dt, choices = complete(http, prompts, a, a.new_tokens)
        ids = [list(c.get("token_ids") or []) for c in choices]
        # without token ids (an older vLLM), every sequence ran to max_tokens (EOS ignored)
        lengths = [len(t) if t else a.new_tokens for t in ids]
        return Run(rep, cfg.backend, cfg.method, len(prompts), dt, sum(lengths),
                   sum(lengths) / dt, lengths=lengths, output_ids=ids if all(ids) else None)
    dt, outs = generate(http, prompts, a, a.new_tokens)
    ids = [list(o["output_ids"]) for o in outs]
    lengths = [len(t) for t in ids]
    verify = accepted = 0.0
    for o in outs:
        meta = o["meta_info"]
        n = int(meta.get("spec_verify_ct") or 0)
        verify += n
        accepted += float(meta.get("spec_accept_length") or 0.0) * n
    return Run(rep, cfg.backend, cfg.method, len(prompts), dt, sum(lengths), sum(lengths) / dt,
               verify_ct=int(verify), accepted=accepted,
               accept_length=accepted / verify if verify else None, lengths=lengths,
               output_ids=ids)


@contextmanager
def serving(cfg: Config, a: argparse.Namespace, rows: int,
            warmup: list[int]) -> Iterator[httpx.Client]:
    """A fresh server of ``cfg``, warmed up (one call: ``rows`` copies of the warm-up
    prompt, 8 tokens), as a client; stopped on the way out."""
    if cfg.backend == SERVE:
        from tlt_serve.models.provision import resolve_model_path

        server = running_vllm(sys.executable, str(resolve_model_path(a.model)),
                              vllm_serve_args(a, rows))
    else:
        server = running_server(server_args(a, cfg, rows))
    with server as url, httpx.Client(base_url=url, timeout=7200) as http:
        warm = [warmup] * rows
        (complete if cfg.backend == SERVE else generate)(http, warm, a, 8)
        yield http


def batches_of(cfg: Config, a: argparse.Namespace) -> list[int]:
    return a.vllm_serve_batches if cfg.backend == SERVE else a.batches


def measure_all(a: argparse.Namespace, prompts: dict[tuple[int, int], list[list[int]]],
                configs: list[Config], rows: int, warmup: list[int]) -> list[Run]:
    """Every repeat: every configuration (alternating order) on a fresh server, every batch
    size. ``prompts[(rep, batch)]``: the prompts of that repeat and batch size; ``warmup``:
    the prompt that warms each server up."""
    runs: list[Run] = []
    total = sum(len(batches_of(c, a)) for c in configs) * a.repeats
    bar = tqdm(total=total, desc="spec_decode (served)")
    for rep in range(a.repeats):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            bar.set_postfix(rep=rep, config=cfg.name, phase="start")
            with serving(cfg, a, rows, warmup) as http:
                for bs in batches_of(cfg, a):
                    bar.set_postfix(rep=rep, config=cfg.name, bs=bs)
                    runs.append(measure(http, cfg, rep, prompts[(rep, bs)], a))
                    bar.update()
    bar.close()
    return runs


def _same(a: Run, b: Run) -> float | None:
    """Fraction of sequences whose tokens are equal (None: tokens of one unknown)."""
    if a.output_ids is None or b.output_ids is None:
        return None
    pairs = zip(a.output_ids, b.output_ids, strict=True)
    return sum(x == y for x, y in pairs) / len(a.output_ids)


def _ratio(runs: list[Run], base: list[Run]) -> dict[str, Any]:
    """Median and range of the paired (same repeat) tokens/s ratios, and the fraction of
    sequences with the same tokens as in ``base``."""
    by_rep = {r.rep: r for r in base}
    pairs = [(r, by_rep[r.rep]) for r in runs if r.rep in by_rep]
    ratios = [r.tokens_per_s / b.tokens_per_s for r, b in pairs]
    same = [s for s in (_same(r, b) for r, b in pairs) if s is not None]
    return {
        "ratio": round(statistics.median(ratios), 3) if ratios else None,
        "range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        "same_tokens": round(statistics.fmean(same), 3) if same else None,
    }


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Per backend x method x batch: tokens/s (median over repeats), speedup vs the same
    backend's ``off`` (median of paired ratios, range), accept length (accepted / verify
    steps over all repeats), verify steps per sequence, same tokens as that ``off``. Then
    native / vLLM ``off`` and our vLLM ``off`` / vllm serve, per batch size."""
    cells: dict[tuple[str, str, int], list[Run]] = {}
    rank = {name: i for i, name in enumerate((*BACKENDS, SERVE, *METHODS))}
    for r in sorted(runs, key=lambda r: (rank[r.backend], rank[r.method], r.batch, r.rep)):
        cells.setdefault((r.backend, r.method, r.batch), []).append(r)
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for (backend, method, bs), rs in cells.items():
        if backend == SERVE:
            continue
        off = cells.get((backend, "off", bs), [])
        verify = sum(r.verify_ct for r in rs)
        paired = _ratio(rs, off)
        results.setdefault(backend, {}).setdefault(method, {})[str(bs)] = {
            "tokens_per_s": round(statistics.median(r.tokens_per_s for r in rs), 2),
            "speedup": paired["ratio"],
            "speedup_range": paired["range"],
            "accept_length": round(sum(r.accepted for r in rs) / verify, 3) if verify else None,
            "verify_ct_per_seq": round(verify / sum(r.batch for r in rs), 2),
            "same_tokens_as_off": paired["same_tokens"],
            "repeats": len(rs),
        }
    cross: dict[str, dict[str, Any]] = {}
    for bs in sorted({b for (_, _, b) in cells}):
        native, vllm = cells.get(("native", "off", bs)), cells.get(("vllm", "off", bs))
        serve = cells.get((SERVE, "off", bs))
        if native and vllm:
            cross.setdefault("native_over_vllm_off", {})[str(bs)] = _ratio(native, vllm)
        if vllm and serve:
            cross.setdefault("vllm_backend_over_vllm_serve", {})[str(bs)] = {
                **_ratio(vllm, serve),
                "vllm_serve_tokens_per_s": round(
                    statistics.median(r.tokens_per_s for r in serve), 2),
            }
    return {"results": results, **cross}


def run_served(a: argparse.Namespace) -> dict[str, Any]:
    """Measure (``a``: spec_decode's arguments, parsed and checked) and summarize; the
    result's ``runs`` are every measured call."""
    from tlt_serve.models.provision import resolve_model_path
    from tlt_serve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(a.model))
    rows = max(a.batches + (a.vllm_serve_batches if a.vllm_serve else []))
    # Fresh prompts per repeat and batch size (at T=0 a repeated prompt would let the n-gram
    # proposer copy an earlier output); every configuration gets the same ones.
    prompts: dict[tuple[int, int], list[list[int]]] = {}
    first = 1  # prompt 0 warms up
    for rep in range(a.repeats):
        for bs in sorted(set(a.batches) | set(a.vllm_serve_batches if a.vllm_serve else [])):
            prompts[(rep, bs)] = [tok.apply_chat_template(chat_messages(first + i))
                                  for i in range(bs)]
            first += bs
    configs = order(a.backends, a.methods, a.vllm_serve)
    runs = measure_all(a, prompts, configs, rows, tok.apply_chat_template(chat_messages(0)))
    return {**summarize(runs), "configs": [c.name for c in configs], "rows": rows,
            "runs": [r.record() for r in runs]}


def plot(result: dict[str, Any], path: Any) -> None:
    """Tokens/s per batch size for each backend x method (and vllm serve), speedup vs the
    same backend's off, and the cross-backend ratios; the title names ``machine``."""
    from benchmarks import report

    plt = report.pyplot()
    results = result["results"]
    bars = [(f"{b}/{m}", cells) for b, ms in results.items() for m, cells in ms.items()]
    serve = result.get("vllm_backend_over_vllm_serve", {})
    if serve:
        bars.append((SERVE, {b: {"tokens_per_s": v["vllm_serve_tokens_per_s"]}
                             for b, v in serve.items()}))
    batches = sorted({b for _, cells in bars for b in cells}, key=int)
    cross = [(k, result[k]) for k in ("native_over_vllm_off", "vllm_backend_over_vllm_serve")
             if result.get(k)]
    fig, axes = plt.subplots(1, 3 if cross else 2, figsize=(16 if cross else 11, 4.2))
    ax1, ax2 = axes[0], axes[1]
    width = 0.8 / len(bars)
    for i, (name, cells) in enumerate(bars):
        xs = [j + i * width for j, b in enumerate(batches) if b in cells]
        ax1.bar(xs, [cells[b]["tokens_per_s"] for b in batches if b in cells], width,
                label=name)
    ax1.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(batches))], batches)
    ax1.set(xlabel="batch size", ylabel="output tokens / s")
    ax1.legend(fontsize=7)
    for name, cells in bars:
        if name == SERVE or name.endswith("/off"):
            continue
        _errorbars(ax2, cells, "speedup", "speedup_range", name)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xlabel="batch size", ylabel="speedup vs the same backend's off")
    ax2.legend(fontsize=7)
    if cross:
        ax3 = axes[2]
        for key, cells in cross:
            label = {"native_over_vllm_off": "native / vLLM backend (off)",
                     "vllm_backend_over_vllm_serve": "vLLM backend (off) / vllm serve"}[key]
            _errorbars(ax3, cells, "ratio", "range", label)
        ax3.axhline(1.0, color="grey", lw=0.8)
        ax3.set(xlabel="batch size", ylabel="tokens/s ratio (median of paired repeats)")
        ax3.legend(fontsize=7)
    fig.suptitle(
        f"served: {result['model']} {result['dtype']}, {result['new_tokens']} new tokens, "
        f"depth {result['depth']}, T={result['temperature']} ({result['machine']})",
        fontsize=9,
    )
    report.save(fig, path)


def _errorbars(ax: Any, cells: dict[str, dict[str, Any]], mid_key: str, span_key: str,
               label: str) -> None:
    bs = [b for b in sorted(cells, key=int) if cells[b].get(mid_key) is not None]
    if not bs:
        return
    mid = [cells[b][mid_key] for b in bs]
    spans = [cells[b].get(span_key) or [m, m] for b, m in zip(bs, mid, strict=True)]
    err = [[m - lo for m, (lo, _) in zip(mid, spans, strict=True)],
           [hi - m for m, (_, hi) in zip(mid, spans, strict=True)]]
    ax.errorbar(bs, mid, yerr=err, marker="o", capsize=3, label=label)
