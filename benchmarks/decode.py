"""Decode speed by batch size, with and without speculation.

  offline   in-process engines side by side: plain decoding (off), n-gram, suffix, drafter
            and adaptive (auto: with --drafter its arms too; auto-nodrafter: never)
            speculation, and HF transformers' generate loop (hf)
  served    the same through the servers, backend against backend: each backend x method a
            fresh ``tlt-serve serve``, with ``--vllm-serve`` plain ``vllm serve`` beside them
  frontend  the HTTP front end's cost: one closed-loop workload on the offline engine and
            through the server

offline and served give every sequence of a run its own chat/reasoning/code prompt (fresh
per repeat and batch size: at T=0 a repeated prompt would let the n-gram proposer copy an
earlier output), every configuration the same ones and the same number of new tokens (EOS
ignored). Repeats run the configurations in alternating order (this host's speed drifts
within a run; a fixed order hands the drift to the configurations measured last), and a
speedup is the median of each repeat's ratio to plain decoding measured beside it, with
their range (the speed drifts by more than ±10% between repeats, so paired ratios say more
than a ratio of medians). Accept length: accepted drafts per verification, bonus excluded.

    python -m benchmarks.decode offline --drafter ~/.cache/tlt-serve/drafters/smollm2-135m
    python -m benchmarks.decode offline --methods off,hf --batches 1,16,64 --new-tokens 64
    python -m benchmarks.decode served --backends native,vllm --methods off,ngram,drafter \\
        --drafter D --vllm-serve --vllm-serve-args "--enforce-eager --block-size 32"
    python -m benchmarks.decode frontend --concurrency 64 --requests 256
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common.load import Endpoint, closed_loop
from benchmarks.common.prompts import chat_messages, chat_prompts, tokenizer, varied_requests
from benchmarks.common.results import grouped_bars, ints, names, pyplot, report, save, tool
from benchmarks.common.servers import VLLM_SERVED_NAME, running_server, running_vllm
from clients.results import spec_verifies
from tlt_serve.config import SpecConfig

IN_PROCESS = "in-process"  # the backend name of offline runs
WARM_TOKENS = 32  # untimed tokens per engine before each batch size
OFFLINE_METHODS = ("off", "ngram", "suffix", "drafter", "auto", "auto-nodrafter", "hf")
BACKENDS = ("native", "vllm")
METHODS = ("off", "ngram", "suffix", "drafter", "auto")
SERVE = "vllm-serve"  # plain `vllm serve`, measured with method "off"


@dataclass
class Run:
    """One measured call: ``batch`` prompts, one configuration, one repeat."""

    rep: int
    backend: str  # in-process | native | vllm | vllm-serve
    method: str
    batch: int
    seconds: float
    lengths: list[int]  # output tokens per sequence
    verify_ct: int = 0  # sequences verified, summed over verify steps
    accepted: float = 0.0  # accepted drafts, summed over the sequences
    verify_fraction: float | None = None  # offline: decode steps that verified drafts
    output_ids: list[list[int]] | None = None  # kept out of the JSON

    @property
    def tokens_per_s(self) -> float:
        return sum(self.lengths) / self.seconds

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        del out["output_ids"]
        return {**out, "tokens_per_s": round(self.tokens_per_s, 2)}


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


def _cell(rs: list[Run], off: list[Run]) -> dict[str, Any]:
    verify = sum(r.verify_ct for r in rs)
    paired = _ratio(rs, off)
    out = {
        "tokens_per_s": round(statistics.median(r.tokens_per_s for r in rs), 2),
        "speedup": paired["ratio"],
        "speedup_range": paired["range"],
        "accept_length": round(sum(r.accepted for r in rs) / verify, 3) if verify else None,
        "verify_ct_per_seq": round(verify / sum(r.batch for r in rs), 2),
        "same_tokens_as_off": paired["same_tokens"],
        "repeats": len(rs),
    }
    fractions = [r.verify_fraction for r in rs if r.verify_fraction is not None]
    if fractions:
        out["verify_fraction"] = round(statistics.fmean(fractions), 3)
    return out


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Per backend x method x batch: tokens/s (median over repeats), speedup vs the same
    backend's ``off`` (median of paired ratios, range), accept length (over all verify steps
    of all repeats), verifications per sequence, same tokens as that ``off``. Then native /
    vLLM ``off`` and our vLLM ``off`` / vllm serve, per batch size."""
    cells: dict[tuple[str, str, int], list[Run]] = {}
    rank = {n: i for i, n in enumerate((IN_PROCESS, *BACKENDS, SERVE, *OFFLINE_METHODS))}
    for r in sorted(runs, key=lambda r: (rank[r.backend], rank[r.method], r.batch, r.rep)):
        cells.setdefault((r.backend, r.method, r.batch), []).append(r)
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for (backend, method, bs), rs in cells.items():
        if backend != SERVE:
            off = cells.get((backend, "off", bs), [])
            results.setdefault(backend, {}).setdefault(method, {})[str(bs)] = _cell(rs, off)
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


def fresh_prompts(tok: Any, repeats: int,
                  batches: Sequence[int]) -> dict[tuple[int, int], list[list[int]]]:
    """``[(repeat, batch)]``: that batch's prompts, each its own (prompt 0 warms up)."""
    out, first = {}, 1
    for rep in range(repeats):
        for bs in sorted(set(batches)):
            out[(rep, bs)] = chat_prompts(tok, first, bs)
            first += bs
    return out


# ---- offline ------------------------------------------------------------------------------

Arm = Callable[[list[list[int]], int], Run]  # (prompts, repeat) → one measured call


def engine_arm(llm: Any, method: str, params: Any) -> Arm:
    """An in-process engine: tokens, verifications and accepted drafts of one generate."""

    def run(prompts: list[list[int]], rep: int) -> Run:
        s = llm.engine.stats
        before = (s.spec.accepted, s.spec.verifies, s.spec.steps, s.decode_steps)
        t0 = time.perf_counter()
        res = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        now = (s.spec.accepted, s.spec.verifies, s.spec.steps, s.decode_steps)
        accepted, verifies, steps, decodes = (a - b for a, b in zip(now, before, strict=True))
        ids = [r.samples[0].token_ids for r in res]
        return Run(rep, IN_PROCESS, method, len(prompts), dt, [len(t) for t in ids], verifies,
                   accepted, steps / decodes if decodes else 0.0, ids)

    return run


def hf_arm(model_path: Path, dtype: str, pad_id: int, new_tokens: int) -> Arm:
    """HF transformers' ``generate`` loop on the same weights, greedy, left-padded."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()

    def run(prompts: list[list[int]], rep: int) -> Run:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        dt = time.perf_counter() - t0
        new = out[:, width:].tolist()
        return Run(rep, IN_PROCESS, "hf", len(prompts), dt, [len(t) for t in new],
                   output_ids=new)

    return run


def offline_arms(a: argparse.Namespace) -> tuple[dict[str, Arm], Any]:
    """An engine per method (``hf``: HF generate), warmed up; and the plain engine."""
    from tlt_serve import LLM, SamplingParams
    from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig

    rows = max(a.batches)
    forced = dict(num_draft_tokens=a.depth, max_batch=rows,
                  min_draft_confidence=a.min_draft_confidence)
    specs = {
        "off": SpecConfig(),
        "ngram": SpecConfig(method="ngram", **forced),
        "suffix": SpecConfig(method="suffix", **{**forced, "num_draft_tokens": a.suffix_depth}),
        "drafter": SpecConfig(method="drafter", drafter=a.drafter, **forced),
        "auto": SpecConfig(method="auto", drafter=a.drafter, num_draft_tokens=a.depth,
                           max_batch=a.max_batch, min_draft_confidence=a.min_draft_confidence),
        "auto-nodrafter": SpecConfig(method="auto", num_draft_tokens=a.depth,
                                     max_batch=a.max_batch),
    }
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=a.temperature,
                            ignore_eos=True, seed=0)
    llms = {m: LLM(config=EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, max_model_len=1024),
        cache=CacheConfig(max_num_seqs=rows), spec=specs[m])) for m in a.methods if m != "hf"}
    tok = llms["off"].tokenizer
    warm = [tok.apply_chat_template(chat_messages(0))]
    arms: dict[str, Arm] = {}
    for m in a.methods:  # each warmed up: kernels, allocator, first-call overheads
        if m == "hf":
            arms[m] = hf_arm(llms["off"].engine.model_path, a.dtype, tok.hf.pad_token_id or 0,
                             a.new_tokens)
            arms[m](warm, -1)
        else:
            llms[m].generate(warm, SamplingParams(max_new_tokens=8))
            arms[m] = engine_arm(llms[m], m, params)
    return arms, llms


def offline(a: argparse.Namespace) -> Path:
    """Decode speed of in-process engines, one per method, side by side by batch size.
    Reported: tokens/s, speedup over plain decoding, accept length, the fraction of decode
    steps that verified, and the fraction of sequences whose tokens equal plain decoding's.
    ``ngram``, ``suffix`` and ``drafter`` speculate at every batch size (to show where
    speculation stops paying); ``auto`` is what the server does by default: speculate only
    while at most ``--max-batch`` sequences run. ``hf``: HF transformers' generate loop (greedy
    only). Before each batch size every engine generates ``WARM_TOKENS`` tokens for a batch of
    prompts of its own, untimed: the verify path's first shapes at that size (a first timed
    batch 1 ran at a third of the speed of later ones) and auto's first measurements there."""
    import torch

    check_offline(a)
    torch.set_num_threads(a.threads)
    from tlt_serve import SamplingParams

    arms, llms = offline_arms(a)
    # the repeats' prompts, then a set per batch size that warms every engine up untimed
    prompts = fresh_prompts(llms["off"].tokenizer, a.repeats + 1, a.batches)
    warm = SamplingParams(max_new_tokens=min(WARM_TOKENS, a.new_tokens),
                          temperature=a.temperature, ignore_eos=True, seed=0)
    runs: list[Run] = []
    bar = tqdm(total=len(a.batches) * a.repeats * len(arms), desc="decode offline")
    for bs in a.batches:
        for llm in llms.values():
            llm.generate(prompts[(a.repeats, bs)], warm)
        for rep in range(a.repeats):
            order = list(arms.items())
            for name, arm in order if rep % 2 == 0 else order[::-1]:
                bar.set_postfix(bs=bs, method=name)
                runs.append(arm(prompts[(rep, bs)], rep))
                bar.update()
    bar.close()
    results = summarize(runs)["results"][IN_PROCESS]
    print_cells({IN_PROCESS: results})
    # The adaptive policy's measured tokens/s per batch-size bucket and strategy: where it
    # chose to speculate, and with what.
    policy = llms["auto"].engine.spec.policy.table() if "auto" in llms else None
    return report(a, {"mode": "offline", "results": results, "adaptive_policy": policy,
                      "runs": [r.record() for r in runs]}, plot)


def check_offline(a: argparse.Namespace) -> None:
    """Checks the offline options; the default methods: every one the arguments allow."""
    a.methods = a.methods or ["ngram", "suffix", *(["drafter"] if a.drafter else []), "auto"]
    for m in a.methods:
        if m not in OFFLINE_METHODS:
            raise SystemExit(f"--methods: unknown {m!r} (from {','.join(OFFLINE_METHODS)})")
    if "drafter" in a.methods and not a.drafter:
        raise SystemExit("--methods drafter: needs --drafter (a tlt-train warmup checkpoint)")
    if "hf" in a.methods and a.temperature > 0:
        raise SystemExit("--methods hf: greedy only (--temperature 0)")
    a.methods = list(dict.fromkeys(["off", *a.methods]))


# ---- served -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    backend: str  # native | vllm | vllm-serve
    method: str  # off | ngram | suffix | drafter | auto

    @property
    def name(self) -> str:
        return SERVE if self.backend == SERVE else f"{self.backend}/{self.method}"


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
             "--spec-max-batch", str(a.spec_max_batch or rows), "--speculative", cfg.method,
             "--num-draft-tokens", str(a.depth)]
    if cfg.method in ("drafter", "auto") and a.drafter:
        flags += ["--drafter", a.drafter, "--min-draft-confidence", str(a.min_draft_confidence)]
    return flags


def vllm_serve_args(a: argparse.Namespace, rows: int) -> list[str]:
    return ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
            "--max-num-seqs", str(rows), *shlex.split(a.vllm_serve_args or "")]


def call(http: httpx.Client, serve: bool, prompts: list[list[int]], a: argparse.Namespace,
         new_tokens: int) -> tuple[float, list[dict[str, Any]]]:
    """One call with every prompt: ``/generate`` or, for plain vLLM, OpenAI
    ``/v1/completions`` (vLLM's ``ignore_eos`` and ``return_token_ids`` in the body). Wall
    seconds and one output per prompt, in order."""
    seeded = a.temperature > 0
    if serve:
        body: dict[str, Any] = {"model": VLLM_SERVED_NAME, "prompt": prompts,
                                "max_tokens": new_tokens, "temperature": a.temperature,
                                "ignore_eos": True, "return_token_ids": True,
                                **({"seed": 0} if seeded else {})}
        path = "/v1/completions"
    else:
        params = {"max_new_tokens": new_tokens, "temperature": a.temperature,
                  "ignore_eos": True, **({"sampling_seed": 0} if seeded else {})}
        body, path = {"input_ids": prompts, "sampling_params": params}, "/generate"
    t0 = time.perf_counter()
    resp = http.post(path, json=body)
    dt = time.perf_counter() - t0
    resp.raise_for_status()
    outs = resp.json()
    if serve:
        return dt, sorted(outs["choices"], key=lambda c: c["index"])
    return dt, outs if isinstance(outs, list) else [outs]


def measure(http: httpx.Client, cfg: Config, rep: int, prompts: list[list[int]],
            a: argparse.Namespace) -> Run:
    dt, outs = call(http, cfg.backend == SERVE, prompts, a, a.new_tokens)
    if cfg.backend == SERVE:
        ids = [list(c.get("token_ids") or []) for c in outs]
        # without token ids (an older vLLM), every sequence ran to max_tokens (EOS ignored)
        lengths = [len(t) if t else a.new_tokens for t in ids]
        return Run(rep, cfg.backend, cfg.method, len(prompts), dt, lengths,
                   output_ids=ids if all(ids) else None)
    ids = [list(o["output_ids"]) for o in outs]
    verify = accepted = 0.0
    for o in outs:
        steps, took = spec_verifies(o["meta_info"])
        verify += steps
        accepted += took
    return Run(rep, cfg.backend, cfg.method, len(prompts), dt, [len(t) for t in ids],
               int(verify), accepted, output_ids=ids)


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
        call(http, cfg.backend == SERVE, [warmup] * rows, a, 8)
        yield http


def batches_of(cfg: Config, a: argparse.Namespace) -> list[int]:
    return a.vllm_serve_batches if cfg.backend == SERVE else a.batches


def served(a: argparse.Namespace) -> Path:
    """Decode speed through the servers, backend against backend. Every backend x method
    (``--methods``) a fresh ``tlt-serve serve --backend B --speculative M`` (speculating at
    every batch size measured unless ``--spec-max-batch``), measured the same way: warmed up
    once, then at each batch size B one ``/generate`` call with B prompts as ``input_ids``:
    output tokens per wall second of that call, accept length (accepted drafts per verify
    step that drafted) and verify steps (``spec_draft_steps``). With ``--vllm-serve`` plain
    ``vllm serve`` (same python, dtype, max-model-len and max-num-seqs; OpenAI
    ``/v1/completions`` with token-id prompts) is measured beside them. Repeats restart every
    server; speedups are against the same backend's ``off``; also native / vLLM ``off`` and
    our vLLM backend / ``vllm serve``."""
    check_served(a)
    tok = tokenizer(a.model)
    rows = max(a.batches + (a.vllm_serve_batches if a.vllm_serve else []))
    prompts = fresh_prompts(tok, a.repeats, a.batches + a.vllm_serve_batches)
    warmup = tok.apply_chat_template(chat_messages(0))
    configs = order(a.backends, a.methods, a.vllm_serve)
    runs: list[Run] = []
    bar = tqdm(total=sum(len(batches_of(c, a)) for c in configs) * a.repeats,
               desc="decode served")
    for rep in range(a.repeats):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            bar.set_postfix(rep=rep, config=cfg.name, phase="start")
            with serving(cfg, a, rows, warmup) as http:
                for bs in batches_of(cfg, a):
                    bar.set_postfix(rep=rep, config=cfg.name, bs=bs)
                    runs.append(measure(http, cfg, rep, prompts[(rep, bs)], a))
                    bar.update()
    bar.close()
    measured = summarize(runs)
    print_cells(measured["results"])
    for key in ("native_over_vllm_off", "vllm_backend_over_vllm_serve"):
        for bs, c in measured.get(key, {}).items():
            print(f"{key} bs={bs}: x{c['ratio']} {c['range']}, same tokens {c['same_tokens']}")
    return report(a, {"mode": "served", **measured, "rows": rows,
                      "configs": [c.name for c in configs],
                      "runs": [r.record() for r in runs]}, plot)


def check_served(a: argparse.Namespace) -> None:
    """Checks and normalises the served options (before minutes of servers, not after)."""
    for b in a.backends:
        if b not in BACKENDS:
            raise SystemExit(f"--backends: unknown {b!r} (from {','.join(BACKENDS)})")
    if not a.backends:
        raise SystemExit("--backends: none given")
    from tlt_serve.backends import missing

    if "vllm" in a.backends and (why := missing("vllm")):
        raise SystemExit(why)
    if a.vllm_serve and "vllm" not in a.backends:
        raise SystemExit("--vllm-serve: compares with our vLLM backend; add vllm to --backends")
    a.methods = list(dict.fromkeys(a.methods or ["off", "ngram"] + ["drafter"] * bool(a.drafter)))
    for m in a.methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: unknown {m!r} (from {','.join(METHODS)})")
    if "off" not in a.methods:
        raise SystemExit("--methods: needs off (every speedup is against the same backend's off)")
    if "drafter" in a.methods and not a.drafter:
        raise SystemExit("--methods drafter: needs --drafter (a tlt-train warmup checkpoint)")
    a.vllm_serve_batches = a.vllm_serve_batches or sorted({min(a.batches), max(a.batches)})
    if not a.vllm_serve:
        a.vllm_serve_batches = []
    elif not set(a.vllm_serve_batches) <= set(a.batches):
        raise SystemExit("--vllm-serve-batches: each must be one of --batches (compared there)")


def print_cells(results: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> None:
    """One line per backend x method x batch."""
    for backend, methods in results.items():
        for method, cells in methods.items():
            for bs, c in cells.items():
                print(f"{backend:>9} {method:>7} bs={bs:>3}: {c['tokens_per_s']:8.1f} tok/s  "
                      f"speedup x{c['speedup']} {c['speedup_range']}  accept "
                      f"{c['accept_length']}  verify/seq {c['verify_ct_per_seq']}  "
                      f"same tokens as off {c['same_tokens_as_off']}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Tokens/s per batch size for each configuration, speedup vs the same backend's off,
    and (served) the cross-backend ratios; the title names ``machine``."""
    plt = pyplot()
    results, args = result["results"], result["args"]
    if result["mode"] == "offline":
        bars = list(results.items())
    else:
        bars = [(f"{b}/{m}", cells) for b, ms in results.items() for m, cells in ms.items()]
    serve = result.get("vllm_backend_over_vllm_serve", {})
    if serve:
        bars.append((SERVE, {b: {"tokens_per_s": v["vllm_serve_tokens_per_s"]}
                             for b, v in serve.items()}))
    batches = sorted({b for _, cells in bars for b in cells}, key=int)
    cross = [(k, result[k]) for k in ("native_over_vllm_off", "vllm_backend_over_vllm_serve")
             if result.get(k)]
    drafting = [(name, cells) for name, cells in bars
                if name != SERVE and not name.endswith("off")]
    fig, axes = plt.subplots(1, 1 + bool(drafting) + bool(cross),
                             figsize=(5.5 * (1 + bool(drafting)) + 5 * bool(cross), 4.2),
                             squeeze=False)
    axes = list(axes[0])
    grouped_bars(axes[0], batches, {name: {b: c["tokens_per_s"] for b, c in cells.items()}
                                    for name, cells in bars})
    axes[0].set(xlabel="batch size", ylabel="output tokens / s")
    if drafting:
        for name, cells in drafting:
            _errorbars(axes[1], cells, "speedup", "speedup_range", name)
        axes[1].set(ylabel="speedup vs off (median of paired repeats, range)")
    for key, cells in cross:
        _errorbars(axes[-1], cells, "ratio", "range", {
            "native_over_vllm_off": "native / vLLM backend (off)",
            "vllm_backend_over_vllm_serve": "vLLM backend (off) / vllm serve"}[key])
    if cross:
        axes[-1].set(ylabel="tokens/s ratio (median of paired repeats)")
    for ax in axes[1:]:
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="batch size")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['mode']}: {args['model']} {args['dtype']}, {args['new_tokens']} new "
                 f"tokens, depth {args['depth']}, T={args['temperature']} ({result['machine']})",
                 fontsize=9)
    save(fig, path)


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


# ---- the front end ------------------------------------------------------------------------


def frontend(a: argparse.Namespace) -> Path:
    """Does the HTTP front end starve the engine? The same closed-loop workload twice:
    the offline engine (``LLM.generate``) on all requests at once with ``max_num_seqs`` =
    concurrency, then the real server with ``--concurrency`` streaming clients, each sending
    its next request when the previous one ends. Greedy, output lengths spread over
    ``--min-new`` .. ``--max-new`` (EOS ignored) so continuous batching matters."""
    from tlt_serve import LLM, SamplingParams
    from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig

    reqs = varied_requests(tokenizer(a.model), a.requests, a.min_new, a.max_new)
    llm = LLM(config=EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len),
        cache=CacheConfig(max_num_seqs=a.concurrency)))
    llm.generate([reqs[0][0]], SamplingParams(max_new_tokens=4))  # warm-up
    t0 = time.perf_counter()
    res = llm.generate([p for p, _ in reqs], [SamplingParams(**p) for _, p in reqs],
                       use_tqdm=True)
    dt = time.perf_counter() - t0
    tokens = sum(len(r.samples[0].token_ids) for r in res)
    off = {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt}
    del llm
    flags = ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(a.concurrency),
             "--max-model-len", str(a.max_model_len)]
    with running_server(flags) as url:
        stats = asyncio.run(closed_loop(Endpoint(url), reqs, a.concurrency, "served"))
    srv = {k: stats[k] for k in ("seconds", "tokens", "tok_s", "errors")}
    ratio = srv["tok_s"] / off["tok_s"]
    print(f"offline {off['tok_s']:.1f} tok/s, served {srv['tok_s']:.1f} tok/s: x{ratio:.3f}")
    return report(a, {"offline": off, "served": srv, "ratio": ratio})


# ---- command line -------------------------------------------------------------------------


def _speed_arguments(p: argparse.ArgumentParser, min_draft_confidence: float,
                     why: str) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (tlt-train warmup)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--methods", type=names, default=None,
                   help="comma-separated; off always (default: every one these arguments "
                   "allow; served: off,ngram and drafter with --drafter)")
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=SpecConfig.num_draft_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--min-draft-confidence", type=float, default=min_draft_confidence,
                   metavar="P", help=f"the drafter's chain cut ({why})")


def _offline_arguments(p: argparse.ArgumentParser) -> None:
    _speed_arguments(p, SpecConfig.min_draft_confidence, "default: the server's")
    p.add_argument("--max-batch", type=int, default=SpecConfig.max_batch,
                   help="auto speculates while at most this many sequences run")
    p.add_argument("--suffix-depth", type=int, default=8,
                   help="most suffix drafts per step (they end earlier where unsure)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")


def _served_arguments(p: argparse.ArgumentParser) -> None:
    _speed_arguments(p, 0.0, "default 0: K drafts every step, as vLLM's EAGLE drafts: like "
                     "for like")
    p.add_argument("--backends", type=names, default=["native"],
                   help=f"comma-separated, from {','.join(BACKENDS)}")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--spec-max-batch", type=int, default=None, metavar="N",
                   help="speculate while at most N sequences run (default: the largest batch, "
                   "i.e. always); e.g. 8 measures what tail-only speculation costs at larger "
                   "batches")
    p.add_argument("--vllm-serve", action="store_true",
                   help="also measure plain `vllm serve` (needs vllm in --backends)")
    p.add_argument("--vllm-serve-batches", type=ints, default=None,
                   help="its batch sizes (default: the smallest and largest of --batches)")
    p.add_argument("--vllm-serve-args", default="",
                   help="extra `vllm serve` flags, one string (default: vLLM's own defaults, "
                   "torch.compile on a CPU; our vLLM backend runs eager with 32-token blocks: "
                   "'--enforce-eager --block-size 32' is like for like)")


def _frontend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=1024)


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "decode", {
        "offline": (_offline_arguments, offline),
        "served": (_served_arguments, served),
        "frontend": (_frontend_arguments, frontend),
    }, argv)


if __name__ == "__main__":
    main()
