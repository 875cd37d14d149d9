"""What a step of the native engine costs on a device, by model shape, batch size and draft
rows: random-weight Llama / Qwen models at real shapes, bf16, the engine's own model code.

  steps   a plain decode step and a verify step (1 + k rows per sequence) by batch size, the
          drafter's forward, one drafter training micro-step; eager, and replayed from CUDA
          graphs on a GPU, captured from the layers as written and with them compiled (the
          engine's default; attending through torch's attention or the own Triton kernel),
          and the kernels of a plain step
  beside  the engine's step time while the drafter trainer trains on the same device (a
          process of its own) against idle, and how fast the trainer yields

Its result is the cost profile ``python -m benchmarks.fleet sim --profile`` reads.

    python -m benchmarks.profile steps --device cuda
    python -m benchmarks.profile steps --device cpu --shapes tiny --batches 1,4 --k 1,4
    python -m benchmarks.profile beside --device cuda --shape 1.7b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common.results import ints, names, pyplot, report, save, tool
from tlt_serve.models.arch import ArchConfig, RopeConfig
from tlt_serve.models.compiled import CompiledLayers


def _arch(model_type: str, vocab: int, hidden: int, inter: int, layers: int, heads: int,
          kv_heads: int, head_dim: int, tied: bool, theta: float) -> ArchConfig:
    return ArchConfig(model_type, vocab, hidden, inter, layers, heads, kv_heads, head_dim, 1e-6,
                      RopeConfig(theta), 32768, tied, model_type == "qwen2", model_type == "qwen3")


# The shapes of public checkpoints (their config.json); weights random
SHAPES = {
    "tiny": _arch("llama", 4096, 256, 768, 4, 8, 2, 32, False, 10000.0),  # a CPU dry run
    "0.5b": _arch("qwen2", 151936, 896, 4864, 24, 14, 2, 64, True, 1e6),  # Qwen2.5-0.5B
    "1.7b": _arch("qwen3", 151936, 2048, 6144, 28, 16, 8, 128, True, 1e6),  # Qwen3-1.7B
    "8b": _arch("llama", 128256, 4096, 14336, 32, 32, 8, 128, False, 5e5),  # Llama-3.1-8B
}


@dataclass(frozen=True)
class Timer:
    """Median milliseconds of ``fn`` over ``repeats`` rounds of ``iters`` calls."""

    device: torch.device
    iters: int
    repeats: int

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(2):
            fn()  # warm-up: allocator, kernels' autotuning
        rounds = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(self.iters):
                    fn()
                end.record()
                end.synchronize()
                rounds.append(start.elapsed_time(end) / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    fn()
                rounds.append(1000 * (time.perf_counter() - t0) / self.iters)
        return statistics.median(rounds)


def random_model(cfg: ArchConfig, max_len: int, device: torch.device, seed: int) -> Any:
    """A bf16 ``LlamaModel`` of shape ``cfg`` with N(0, 0.02) weights and unit norms."""
    from tlt_serve.models.llama import LlamaModel, RMSNorm
    from tlt_serve.models.rope import cos_sin_table

    with torch.device("meta"):
        model = LlamaModel(cfg, max_len)
    model = model.to_empty(device=device).to(torch.bfloat16)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_table = cos_sin_table(cfg.rope, cfg.head_dim, max_len).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
    return model.eval().requires_grad_(False)


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads of the weights: every parameter but the embedding table
    (rows looked up), which a tied head reads whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_word_embeddings:
        e = model.embed_tokens.weight
        total -= e.numel() * e.element_size()
    return total


class Step:
    """One engine step over ``batch`` sequences of about ``context`` cached tokens, each
    given 1 + ``k`` query tokens (k = 0: plain decode; the engine's verify otherwise), as
    the engine's runner builds it; callable eagerly or as a captured CUDA graph."""

    def __init__(self, model: Any, kv: Any, batch: int, k: int, context: int,
                 layer_fn: Any = None) -> None:
        from tlt_serve.engine.runner import extend_batch

        device = model.embed_tokens.weight.device
        # lengths differ per sequence, as in serving (a mask, not a uniform-length batch)
        starts = [context - (b * 37) % min(128, context) for b in range(batch)]
        tokens = [[(b * 131 + j) % model.cfg.vocab_size for j in range(k + 1)]
                  for b in range(batch)]
        self.model, self.kv, self.k, self.layer_fn = model, kv, k, layer_fn
        self.fb, self.ids = extend_batch(kv, 0, starts, tokens, str(device))
        self.graph: Any = None

    def eager(self) -> torch.Tensor:
        out = self.model(self.ids, self.fb, self.kv.layers, layer_fn=self.layer_fn)
        hidden = out.hidden  # [B, 1 + k, H]
        if self.k == 0:
            return self.model.logits(hidden[:, -1])  # [B, V]
        return self.model.logits(hidden.reshape(-1, hidden.shape[-1]))  # [B (1 + k), V]

    def capture(self) -> None:
        """Capture ``eager`` into a CUDA graph (warmed up on a side stream first)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        from tlt_serve.engine.step_graphs import collector_paused

        self.graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(self.graph):
            self.out = self.eager()

    def replay(self) -> None:
        self.graph.replay()


def training_drafter(target: Any, vocab: int, device: torch.device) -> Any:
    """A drafter as the trainer holds it: fp32, on the target's fp32 head stand-in."""
    from tlt_serve.speculative.drafter import DrafterSpec, new_drafter
    from trainer.target import head_target

    spec = DrafterSpec(draft_vocab_size=min(vocab, target.cfg.vocab_size))
    drafter = new_drafter(head_target(target, 4096), spec)
    drafter.draft_vocab.copy_(torch.randperm(target.cfg.vocab_size)[: spec.draft_vocab_size])
    drafter.refresh_head()
    return drafter


def drafter_parts(target: Any, vocab: int, device: torch.device) -> tuple[Any, Any]:
    """A serving drafter (bf16, as the engine holds it) and a training one (fp32 on the
    target's fp32 head stand-in, as the trainer holds it), draft vocabulary ``vocab``."""
    from tlt_serve.speculative.drafter import DrafterSpec, new_drafter
    from trainer.target import head_target

    spec = DrafterSpec(draft_vocab_size=min(vocab, target.cfg.vocab_size))
    picked = torch.randperm(target.cfg.vocab_size, device=device)[: spec.draft_vocab_size]
    serving = new_drafter(target, spec).to(torch.bfloat16).eval().requires_grad_(False)
    stub = head_target(target, 4096)
    training = new_drafter(stub, spec)
    for d in (serving, training):
        d.draft_vocab.copy_(picked)
        d.refresh_head()
    return serving, training


def drafter_forward_ms(drafter: Any, batch: int, context: int, timer: Timer) -> float:
    """One drafting step: the drafter's layer over one token per sequence, its head."""
    from dataclasses import replace

    from tlt_serve.engine.kv_cache import KVCache
    from tlt_serve.engine.runner import extend_batch

    device = drafter.fc.weight.device
    cfg = replace(drafter.cfg, num_layers=1)
    kv = KVCache(cfg, batch, context + 16, torch.bfloat16, str(device))
    starts = [context - (b * 37) % min(128, context) for b in range(batch)]
    fb, ids = extend_batch(kv, 0, starts, [[1]] * batch, str(device))
    features = torch.zeros(batch, 1, cfg.hidden_size, dtype=torch.bfloat16, device=device)

    def step() -> torch.Tensor:
        out = drafter(ids, features, fb, kv.layers[0], fused=True)  # [B, 1, H]
        return drafter.draft_logits(out[:, -1]).argmax(dim=-1)

    with torch.inference_mode():
        return timer(step)


def training_step(drafter: Any, rows: int, row_len: int) -> Callable[[], None]:
    """One training micro-step of the online trainer (forward, EAGLE loss, backward) and an
    optimizer step, over ``rows`` x ``row_len`` random pairs."""
    from trainer.packing import PackedBatch
    from trainer.train import TrainConfig, make_optimizer, step_loss

    device = drafter.fc.weight.device
    H = drafter.cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(0)
    batch = PackedBatch(
        tokens=torch.randint(0, 1000, (rows, row_len), device=device, generator=g),
        features=torch.randn(rows, row_len, H, device=device, generator=g),
        targets=torch.randn(rows, row_len, H, device=device, generator=g),
        seg=torch.arange(rows, device=device).unsqueeze(1).expand(rows, row_len).contiguous(),
        positions=torch.arange(row_len, device=device).expand(rows, row_len).contiguous(),
        loss_mask=torch.ones(rows, row_len, dtype=torch.bool, device=device),
        eval_mask=torch.ones(rows, row_len, dtype=torch.bool, device=device),
    )
    cfg = TrainConfig()
    opt = make_optimizer(drafter, cfg, 1e-4)
    noise = torch.zeros_like(batch.features)
    drafter.train()

    def step() -> None:
        loss, _, _ = step_loss(drafter, batch, cfg, noise)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def training_step_ms(drafter: Any, rows: int, row_len: int, timer: Timer) -> float:
    try:
        return timer(training_step(drafter, rows, row_len))
    finally:
        drafter.eval()


def steps(a: argparse.Namespace) -> Path:
    """Step costs by shape: for each model shape (random bf16 weights), batch size and draft
    depth k (0: a plain decode step; k: a verify step of 1 + k tokens per sequence, all
    positions' logits, as the engine verifies), the milliseconds of one step over sequences
    of about ``--context`` cached tokens, eager and (on CUDA, ``--graphs``) replayed from a
    CUDA graph; the drafter's forward (one token per sequence, draft vocabulary
    ``--draft-vocab``) and one training micro-step of the online trainer (``--train-rows`` x
    ``--train-row-len`` pairs, backward and AdamW step). With ``--bandwidth-gbs`` each plain
    step is set against the floor of reading the weights and the cached keys and values
    once. Median of ``--repeats`` rounds of ``--iters`` steps."""
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    timer = Timer(device, a.iters, a.repeats)
    graphs = device.type == "cuda" and a.graphs
    shapes: dict[str, Any] = {}
    t0 = time.monotonic()
    skipped: list[str] = []
    for shape in a.shapes:
        if a.budget_s and time.monotonic() - t0 > a.budget_s:
            skipped.append(shape)
            continue
        cfg = SHAPES[shape]
        max_len = a.context + max(a.k) + 2
        model = random_model(cfg, max_len, device, a.seed)
        from tlt_serve.engine.kv_cache import KVCache

        kv = KVCache(cfg, max(a.batches), max_len, torch.bfloat16, str(device))
        per_token_kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        wbytes = weight_bytes(model)
        rows: list[dict[str, Any]] = []
        # the decoder layers compiled (the engine's default on a GPU), attending through
        # torch's attention and through the own Triton kernel, captured beside
        compiled = {"compiled": CompiledLayers(),
                    "compiled_triton": CompiledLayers(attention="triton")
                    } if graphs and shape in a.compiled else {}
        todo = [(b, k) for b in a.batches for k in [0, *a.k]]
        for b, k in tqdm(todo, desc=f"steps {shape}"):
            if a.budget_s and time.monotonic() - t0 > a.budget_s:
                skipped.append(f"{shape} batch {b} k {k}")
                continue
            step = Step(model, kv, b, k, a.context)
            with torch.inference_mode():
                row: dict[str, Any] = {"batch": b, "k": k, "eager_ms": round(timer(step.eager), 4)}
                arms = [("graph", step)] if graphs else []
                for arm, fn in compiled.items():
                    arms.append((arm, Step(model, kv, b, k, a.context, fn)))
                for arm, s in arms:
                    try:
                        s.capture()
                        row[f"{arm}_ms"] = round(timer(s.replay), 4)
                    except Exception as err:  # noqa: BLE001 - measured eagerly still; kept
                        row[f"{arm}_error"] = str(err).splitlines()[0][:300]
                        print(f"{shape} batch {b} k {k}: no {arm} graph: {row[f'{arm}_error']}")
                    s.graph = None
            if k == 0 and a.bandwidth_gbs:
                floor = (wbytes + b * a.context * per_token_kv) / (a.bandwidth_gbs * 1e6)
                row["floor_ms"] = round(floor, 4)
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        plain = {r["batch"]: r for r in rows if r["k"] == 0}
        for r in rows:
            if "floor_ms" in r:
                for mode in ("graph_ms", "compiled_ms", "compiled_triton_ms"):
                    if mode in r:
                        r[mode.replace("_ms", "_vs_floor")] = round(r[mode] / r["floor_ms"], 3)
            for mode in ("eager_ms", "graph_ms", "compiled_ms", "compiled_triton_ms"):
                if mode in r and r["k"] and r["batch"] in plain:
                    r[mode.replace("_ms", "_vs_plain")] = round(
                        r[mode] / plain[r["batch"]][mode], 4)
        serving, training = drafter_parts(model, a.draft_vocab, device)
        drafter = {f"forward_ms_batch{b}": round(drafter_forward_ms(serving, b, a.context, timer),
                                                 4) for b in a.batches if b <= 64}
        drafter["train_micro_step_ms"] = round(
            training_step_ms(training, a.train_rows, a.train_row_len, timer), 3)
        drafter["train_pairs"] = a.train_rows * a.train_row_len
        shapes[shape] = {"weight_bytes": wbytes, "kv_bytes_per_token": per_token_kv,
                         "rows": rows, "drafter": drafter}
        if device.type == "cuda" and a.kernels:
            listed: dict[str, Any] = {}
            arms_fn: list[tuple[str, CompiledLayers | None]] = [("layers", None),
                                                                *compiled.items()]
            for arm, layer_fn in arms_fn:
                try:
                    listed[arm] = kernels(Step(model, kv, 1, 0, a.context, layer_fn), arm)
                except Exception as err:  # noqa: BLE001 - a diagnostic; the rest stands
                    listed[arm] = {"error": str(err).splitlines()[0][:300]}
                    print(f"  kernels ({arm}): {listed[arm]['error']}")
            shapes[shape]["kernels"] = listed
        _print(shape, rows, drafter)
        del model, kv, serving, training
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if skipped:
        print(f"not measured within --budget-s {a.budget_s}: {', '.join(skipped)}")
    return report(a, {"device": gpu or "cpu", "torch": torch.__version__, "shapes": shapes,
                      "skipped": skipped}, plot_steps)


def _print(shape: str, rows: list[dict[str, Any]], drafter: dict[str, Any]) -> None:
    print(f"\n{shape}: {'batch':>5} {'k':>2} {'eager ms':>9} {'graph ms':>9} {'compiled':>9} "
          f"{'+triton':>9} {'x plain':>8} {'floor ms':>9}")
    nan = float("nan")
    for r in rows:
        ratio = r.get("compiled_vs_plain", r.get("graph_vs_plain", r.get("eager_vs_plain")))
        print(f"{'':>{len(shape) + 1}} {r['batch']:>5} {r['k']:>2} {r['eager_ms']:>9.3f} "
              f"{r.get('graph_ms', nan):>9.3f} {r.get('compiled_ms', nan):>9.3f} "
              f"{r.get('compiled_triton_ms', nan):>9.3f} "
              f"{ratio if ratio is not None else nan:>8.3f} {r.get('floor_ms', nan):>9.3f}")
    print(f"  drafter: {drafter}")


def kernels(step: Step, arm: str, runs: int = 3) -> dict[str, Any]:
    """The CUDA kernels of one eager step (the ones its graph replays): how many, the sum of
    their times, and the ten that take longest in all, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(2):
            step.eager()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                step.eager()
            torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.device_time / 1000)  # ms
    count = sum(len(v) for v in by_name.values()) / runs
    total = sum(sum(v) for v in by_name.values()) / runs
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
    listed = [{"name": n[:90], "per_step": round(len(v) / runs, 1),
               "ms_per_step": round(sum(v) / runs, 4)} for n, v in top]
    print(f"  kernels ({arm}): {count:.1f} per step, "
          f"{total:.4f} ms of kernel time")
    for t in listed:
        print(f"    {t['ms_per_step']:>8.4f} ms {t['per_step']:>6} x {t['name']}")
    return {"kernels_per_step": round(count, 1), "kernel_ms_per_step": round(total, 4),
            "top": listed}


def plot_steps(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    shapes = result["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (shape, prof) in zip(axes[0], shapes.items(), strict=True):
        modes = [m for m in ("compiled_ms", "graph_ms") if any(m in r for r in prof["rows"])]
        mode = modes[0] if modes else "eager_ms"
        for k in sorted({r["k"] for r in prof["rows"]}):
            pts = [(r["batch"], r[mode]) for r in prof["rows"] if r["k"] == k]
            ax.plot(*zip(*pts, strict=True), marker="o", label="plain" if k == 0 else f"k={k}")
        floor = [(r["batch"], r["floor_ms"]) for r in prof["rows"] if "floor_ms" in r]
        if floor:
            ax.plot(*zip(*floor, strict=True), "k--", label="memory floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel(f"ms per step ({mode.split('_')[0]})")
        ax.set_title(shape, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"step cost, {result['device']} ({result['date']}, {result['commit']})",
                 fontsize=9)
    save(fig, png)


def _train_forever(shape: str, device: str, vocab: int, rows: int, row_len: int, go: Any,
                   idle: Any, steps_done: Any, stop: Any) -> None:
    """The trainer's process: micro-steps while ``go`` is set; sets ``idle`` once it stands
    (at a micro-step boundary)."""
    from dataclasses import replace

    dev = torch.device(device)
    target = random_model(replace(SHAPES[shape], num_layers=0), 4096, dev, 1)
    step = training_step(training_drafter(target, vocab, dev), rows, row_len)
    step()  # warm-up before the measurements
    idle.set()
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        idle.clear()
        while go.is_set():
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            steps_done.value += 1
        idle.set()


def beside(a: argparse.Namespace) -> Path:
    """The engine beside its trainer on one device: a plain decode step of ``--shape`` at
    ``--batch`` sequences (replayed from a CUDA graph on a GPU) timed in rounds while a
    second process, the trainer, is idle, then training the drafter of that shape
    (micro-steps of ``--train-rows`` x ``--train-row-len`` pairs and AdamW steps), then
    idle again; and the trainer's yield: from the engine asking it to stop to the trainer
    standing at its next micro-step boundary (median of the rounds)."""
    import multiprocessing as mp

    from tlt_serve.engine.kv_cache import KVCache

    device = torch.device(a.device)
    timer = Timer(device, a.iters, 1)
    cfg = SHAPES[a.shape]
    model = random_model(cfg, a.context + 2, device, a.seed)
    kv = KVCache(cfg, a.batch, a.context + 2, torch.bfloat16, str(device))
    step = Step(model, kv, a.batch, 0, a.context)
    ctx = mp.get_context("spawn")
    go, idle, stop, done = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    trainer = ctx.Process(target=_train_forever, args=(
        a.shape, a.device, a.draft_vocab, a.train_rows, a.train_row_len, go, idle, done, stop))
    trainer.start()
    phases: dict[str, list[float]] = {"idle": [], "training": []}
    yields: list[float] = []
    steps_per_s: list[float] = []
    try:
        if not idle.wait(600):
            raise SystemExit("the trainer process did not start in 600 s")
        with torch.inference_mode():
            run: Callable[[], Any] = step.eager
            if device.type == "cuda" and a.graphs:
                step.capture()
                run = step.replay
            for _ in tqdm(range(a.rounds), desc=f"beside {a.shape}"):
                phases["idle"].append(timer(run))
                go.set()
                while idle.is_set():
                    time.sleep(0.001)
                before, t0 = done.value, time.perf_counter()
                phases["training"].append(timer(run))
                steps_per_s.append((done.value - before) / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                go.clear()
                idle.wait(600)
                yields.append(1000 * (time.perf_counter() - t0))
            phases["idle"].append(timer(run))
    finally:
        stop.set()
        go.clear()
        trainer.join(60)
        if trainer.is_alive():
            trainer.kill()
    idle_ms = statistics.median(phases["idle"])
    train_ms = statistics.median(phases["training"])
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "step_ms_idle": round(idle_ms, 4), "step_ms_training": round(train_ms, 4),
        "slowdown": round(train_ms / idle_ms, 4),
        "trainer_micro_steps_per_s": round(statistics.median(steps_per_s), 3),
        "trainer_yield_ms": round(statistics.median(yields), 3),
        "rounds": phases, "yields_ms": yields,
    }
    print(f"{a.shape} batch {a.batch}: step {idle_ms:.3f} ms idle, {train_ms:.3f} ms beside "
          f"the trainer (x{train_ms / idle_ms:.3f}); trainer "
          f"{result['trainer_micro_steps_per_s']} micro-steps/s, yields in "
          f"{result['trainer_yield_ms']} ms")
    return report(a, result, plot_beside)


def plot_beside(result: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in result["rounds"].items():
        ax.plot(range(len(values)), values, marker="o", label=f"trainer {name}")
    ax.set_xlabel("round")
    ax.set_ylabel("ms per engine step")
    ax.set_title(f"engine step beside its trainer: x{result['slowdown']}; trainer yields in "
                 f"{result['trainer_yield_ms']} ms", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"{result['device']} ({result['date']}, {result['commit']})", fontsize=9)
    save(fig, png)


def _beside_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="1.7b", choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--draft-vocab", type=int, default=32768)
    p.add_argument("--train-rows", type=int, default=8)
    p.add_argument("--train-row-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=50, help="engine steps per timed round")
    p.add_argument("--seed", type=int, default=0)


def _steps_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", type=names, default=["0.5b", "1.7b", "8b"],
                   help=f"of {', '.join(SHAPES)}")
    p.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--k", type=ints, default=list(range(1, 9)), help="draft depths verified")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="also replay each step from a CUDA graph (CUDA only)")
    p.add_argument("--compiled", type=names, default=list(SHAPES),
                   help="shapes whose steps are also captured with the decoder layers compiled "
                   "(the engine's default on a GPU)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, list the kernels of a plain step at batch 1 (torch profiler)")
    p.add_argument("--draft-vocab", type=int, default=32768)
    p.add_argument("--train-rows", type=int, default=8)
    p.add_argument("--train-row-len", type=int, default=512)
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth for the floor (an H200: about 4300)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=None,
                   help="measure no new step after this many seconds (what is left is listed)")
    p.add_argument("--seed", type=int, default=0)


def main(argv: Sequence[str] | None = None) -> Any:
    return tool(__doc__, "profile", {"steps": (_steps_arguments, steps),
                                      "beside": (_beside_arguments, beside)}, argv)


if __name__ == "__main__":
    main()
