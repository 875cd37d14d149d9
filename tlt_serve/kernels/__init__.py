"""Optional CPU kernels, compiled on first use with the machine's C++ compiler.

``cpu_kernels()`` returns the kernels of ``bf16_gemv.cpp`` (AVX2; the product of bf16 rows
and the attention's scores take AVX512-BF16 dot products where the CPU has them, and the
product AMX tiles where it has those, ``amx_product.cpp``): the bf16
matrix × rows product, the RMSNorm, the attention of query tokens over their rows' caches
(decode, verify, draft trees; prefills where the scores take dot products), all of them as one
whole decoder layer and as every layer of a model in one call (``decoder_layer.cpp``), and the
log-softmax parts and rank of scored tokens (prompt logprobs, any dtype).
``sampling_kernels()`` returns those of ``sampling.cpp``: a token per row of fp32 logits and
its logprob, in two passes over the row. Either is None when
they cannot be had (no AVX2/FMA, no compiler, build failure, or ``TLT_SERVE_NO_KERNELS=1``);
callers then use torch's own kernels, so nothing depends on them for correctness.

The build (~40 s) is cached under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) in a directory named by the hash of the sources, the flags
and the torch version, so checkouts and environments on one machine each keep their own
build instead of rebuilding each other's. Builders of one directory take turns on an
``flock`` the kernel drops when its holder dies: a start stopped mid-build (Ctrl-C,
SIGKILL) leaves torch's own ``lock`` file behind, and the next builder, holding the flock,
knows it is stale and removes it (torch would wait on it forever). A builder that waits on
a live one more than ``BUILD_WAIT_S`` gives up with a message naming the lock file, and the
server runs on torch's kernels.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tlt_serve.kernels")
# (weight [N, K] bf16, x [M, K] fp32 or bf16, out_bf16) → [M, N] fp32 (bf16 if out_bf16)
MatVec = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
NormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (q [B, Q, kvH, G, D], k_cache, v_cache [S, kvH, L, D], row_lo, lens [B, Q], tree bits
#   [B * Q] or empty, scale, block_queries) → [B, Q, kvH, G, D]; query (b, j) sees key columns
#   [0, lens[b, j]), or a tree node's prefix + ancestors (``ForwardBatch.tree_bits``); a row
#   of at least block_queries real query tokens (a prefill) goes by blocks (BLOCK_QUERIES)
RowAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float, int],
    torch.Tensor,
]
# A whole decoder layer for causal rows (decoder_layer.cpp): (x [R, H], input norm weight or
# empty, qkv, o, post norm, gate_up, down weights, eps, k_cache, v_cache, rope [B*Q, 2, D],
# slots [R], lens [B*Q], tree bits [B*Q] or empty, row_lo, Q, heads, scale, own_rows [4],
# block_queries) → x [R, H]
LayerKernel = Callable[..., torch.Tensor]
# Every layer in one call (decoder_layer.cpp): (x [R, H], 8 tensors per layer (input norm
# weight, qkv, o, post norm, gate_up, down, k_cache, v_cache), eps, rope, slots, lens, tree
# bits, row_lo, Q, heads, scale, 4 row limits per layer, block_queries, aux layer indices) →
# [x [R, H] after the last layer, then after each aux layer]
StackKernel = Callable[..., list[torch.Tensor]]
# (cache viewed [N, D], index [R] long, rows [R, D] of its dtype) → None: cache[index[r]] =
# rows[r], a row copy each (the K/V write of a step the whole-layer kernel does not take)
RowWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# (logits [C, V] fp32 or bf16 (widened in cache), targets [C] long) → each row's maximum m [C]
#   and log(sum(exp(x - m))) [C] (fp32: a logprob is (x - m) - that, as torch's log-softmax)
#   and its target's rank [C] long (1 + how many logits of the row are larger), in two passes
#   over the row
TokenScores = Callable[[torch.Tensor, torch.Tensor],
                       tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

# Sampling over fp32 logits [N, V] (sampling.cpp): (logits, temps [N] fp32, u [N] fp64,
# greedy [N] bool) → (tokens [N] long, logprobs [N] fp32); and (logits, temps, tokens [N]) →
# the logprobs [N] the first reports for those tokens.
SampleRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor]]
TokenLogprobs = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SamplingKernels:
    """The own sampling kernels: greedy rows take the first maximum, the others the inverse
    CDF of exp(x / T - max) at their uniform; a logprob is log_softmax's (x / T - max) -
    log(sum). Each row is computed alone, so the sampler's and the verifier's agree bit for
    bit; they differ from torch's ops by float rounding only."""

    sample: SampleRows
    logprobs: TokenLogprobs
    scores: TokenScores  # prompt logprobs: log-softmax parts (as ``sample`` at T = 1), ranks


# Most rows the own product multiplies; more go to torch (see ``models.llama.Linear``). Where
# torch has no bf16 GEMM (AVX2 only) the own kernel beats it up to 128 rows; where it has one
# (AVX512-BF16 / AMX, oneDNN) torch's is flat up to ~16 rows and wins from ~8 (measured on
# the default model's projections: 8 rows 16-20 vs 18 ms, 16 rows 25-27 vs 33, 64 rows 62 vs
# 124 ms on an AVX512-BF16 EPYC, 2 threads).
# With AVX512-BF16 the own product of bf16 rows (dot-product instructions) beats torch's up to
# ~24-32 rows (``benchmarks.kernels rows`` on a Zen 4 EPYC, 2 threads: 8 rows 11-12 vs 16-20
# ms, 16 rows 19-20 vs 22-26, 32 rows 33-35 vs 31-39); in one engine, plain decoding at batch
# 24 / 32 ran +12% / +8% faster with a limit of 32 than of 16. Up to the limit a step also runs
# the whole-layer kernel instead of ~35 ops a layer around torch's products: on a Zen 5 EPYC
# (2 threads) plain decoding at 48 / 64 sequences ran x1.18 / x1.10 as fast with a limit of 64
# as of 32, and a limit of 128 stayed within the host's spread of 64 (x0.97-1.09) at 48-128
# (``benchmarks.kernels ab --configs rows32,rows128``, 3 rounds). Where the CPU has AMX tiles
# torch's product runs on them and the own one does not: on a 2-vCPU Xeon with AMX the
# default model's projections of a step took 14.3 vs 14.7 ms (own vs torch) at 8 rows, 24.9
# vs 15.0 at 16, 94 vs 24 at 64 (``benchmarks.kernels rows``), and in one engine (the
# whole-layer kernel taking every step, its products torch's above the limit) a limit of 8
# decoded x1.11 / x1.52 as fast as one of 32 at 16 / 32 sequences, the same elsewhere
# (``benchmarks.kernels ab --configs rows8,rows16``): MATVEC_ROWS_AMX, where the own product
# cannot use the tiles. Where it can (amx_product.cpp), it beats torch's GEMM up to ~300 rows:
# the default model's projections of a step took 9.6 / 9.8 / 15.3 / 25.1 / 40.3 ms at 1 / 16
# / 64 / 128 / 256 rows against torch's 18.5 / 18.9 / 25.2 / 30.5 / 45.7, and 59 vs 50 at 384
# (same Xeon, ad hoc). Where a product's packed rows outgrow the cache torch's wins sooner (a
# 1.5B model's 1536 x 8960: 1.14 vs 1.67 ms at 64 rows, 3.31 vs 2.27 at 128): products of
# LARGE_PRODUCT weights or more take it up to MATVEC_ROWS_LARGE_OWN_AMX rows.
# Products of many weights run at torch's GEMM rate sooner: on the Zen 5 EPYC (2 threads)
# the own product of a 1.5B model's projections (Qwen2.5-1.5B's shapes, 3-28M weights each,
# and its 233M-weight head) took x0.64 / 0.88 / 1.10 / 1.65 torch's time at 8 / 16 / 32 / 64
# rows (``benchmarks.kernels rows --hidden 1536 --intermediate 8960 --kv-dim 256 --vocab
# 151936 --layers 28``), the default model's 28M-weight head x0.91 / 1.19 at 48 / 64 rows:
# a layer's products of LARGE_PRODUCT weights or more take the own kernel up to
# MATVEC_ROWS_LARGE rows there (a whole-layer kernel: up to its products' smallest limit; a
# head keeps MATVEC_ROWS_*: models.llama.set_cpu_kernels).
MATVEC_ROWS = 128
MATVEC_ROWS_NATIVE_BF16 = 8
MATVEC_ROWS_AVX512_BF16 = 64
MATVEC_ROWS_AMX = 8
MATVEC_ROWS_OWN_AMX = 256
MATVEC_ROWS_LARGE_OWN_AMX = 64
LARGE_PRODUCT = 1 << 22  # weights
MATVEC_ROWS_LARGE = 32
# Most rows the whole-layer kernel takes where torch has a bf16 GEMM (AMX tiles or
# AVX512-BF16): above the own product's limit its products are torch's, the ~35 ops around
# them still one call. On the AMX Xeon: decoding x1.10 / x1.06 as fast at 64 / 128 sequences
# as with the layer kernel up to 32 rows (``--configs layer32``). Prefills: once its rotation
# and residual adds were split over the threads, whole prompts (up to 4096 tokens a step) took
# x0.93-1.00 the time of a 256-row limit (``benchmarks.kernels prefill --configs layer4096``:
# 64 x 128, 1 x 2048 and 16 x 512 tokens, five rounds). On an AVX512-BF16 EPYC without tiles,
# against its products' 64 rows: prefills x0.97-1.00 the time (five rounds, 64 x 512 tokens
# x0.97), decoding at 128 sequences x1.00.
LAYER_ROWS_BF16_GEMM = 4096
# Most query tokens per row the own attention takes; longer rows (prefill) go to torch's SDPA,
# which tiles them. The own attention computes each (query, KV head) alone over exactly the
# keys it sees, its rows' keys and values staying in cache for the next query. With the
# AVX512-BF16 scores it beat SDPA's causal attention at every prefill length measured ad hoc
# (default model's heads, 2 threads, AVX512-BF16 EPYC, ms a layer: 16 rows x 128 tokens 1.6 vs
# 4.7, 16 x 512 25 vs 63, 4 x 512 after 512 cached 15.6 vs 31.3, 1 x 2048 30 vs 36, 1 x 4096
# 126 vs 130, before the threads' work was balanced), so there it takes prefills too, and a
# prompt's tokens get the bits a decode step would give them (but for prompts of
# BLOCK_QUERIES tokens or more, which attend by blocks: see there).
# Without them the keys are widened to fp32: on AVX2 alone that path is about as fast as SDPA
# at 4 x 512 tokens after 512 cached (32.4 vs 31.3 ms) and half its speed at 1 x 2048 (67 vs
# 36), and hosts with AVX512 but no AVX512-BF16 were not measured: decode and verify rows only.
ATTENTION_QUERIES = 16
ATTENTION_QUERIES_AVX512_BF16 = 4096
DOT_HEAD_DIMS = (64, 128, 256)  # head sizes whose scores take the dot products (others: 16)
# Where the CPU has AMX tiles or AVX512-BF16, a row of at least this many query tokens (a
# prefill, never a verify step: at most 1 + MAX_DRAFT_TOKENS tokens) attends 16 tokens at a
# time (tile products, or dot products without tiles), the weights rounded to bf16 for the
# weighted sum as torch's and vLLM's CPU attention round them (``prefill_attention.cpp``): its
# tokens get outputs within bf16 rounding of their decode step's. 4 prompts of 512 tokens, the
# default model's heads, 2-vCPU AMX Xeon: 1.7-1.9 ms a layer against 7.5-8.6 token by token
# (torch's SDPA: 3.7-4.1). Decode, verify and tree rows keep the token-by-token path, which
# gives a token the same bits in any of them; so does every row under ``batch_invariant``. On
# an AVX512-BF16 EPYC without tiles (dot products), prompts attended token by token took
# x1.04-1.48 the time of whole prefills by blocks (``benchmarks.kernels prefill --configs
# tokens``, five rounds; docs/PERFORMANCE.md).
BLOCK_QUERIES = 64
EVERY_ROW = 1 << 30  # a limit of rows or queries no step reaches (batch-invariant kernels)
SOURCES = (
    "bf16_gemv.cpp", "decoder_layer.cpp", "amx_product.cpp", "prefill_attention.cpp",
    "sampling.cpp", "bf16_kernels.h",
)
BUILD_WAIT_S = 600.0  # longest wait on another process's build of the same kernels


@dataclass(frozen=True)
class CpuKernels:
    """The own bf16 kernels a model uses for serving (never under autograd); a None field
    leaves torch's kernel in place (e.g. ``replace(kernels, norm=None)`` for an A/B)."""

    matvec: MatVec | None  # bf16 weight [N, K] × rows [M, K] → [M, N], fp32 accumulation
    norm: NormKernel | None  # RMSNorm of bf16 rows, HF's rounding order
    attention: RowAttention | None  # query tokens over their rows' cached keys
    matvec_rows: int = MATVEC_ROWS  # products of more rows use torch's
    large_rows: int = MATVEC_ROWS  # the same for a layer's products of LARGE_PRODUCT weights+
    # Most rows the whole-layer kernel takes (at least its products' limits): its products of
    # more rows than their limits run torch's GEMM inside it (hosts with bf16 GEMM units).
    layer_rows: int = MATVEC_ROWS
    # rows of more query tokens use torch's SDPA: heads of DOT_HEAD_DIMS, and the others
    attention_queries: int = ATTENTION_QUERIES
    other_head_queries: int = ATTENTION_QUERIES
    # rows of at least this many query tokens attend by blocks (AMX tiles or AVX512-BF16)
    block_queries: int = EVERY_ROW
    # A whole decoder layer in one call, built on this module's product, norm and attention:
    # a copy that replaces any of them (an A/B) must drop it too.
    layer: LayerKernel | None = None
    # Every layer of a model in one call (the layer kernel's bits): a copy that drops
    # ``layer`` must drop it too.
    stack: StackKernel | None = None
    # The cache write of the steps that run op by op (torch's index_copy_ otherwise)
    write: RowWrite | None = None

    def rows_for(self, weight: torch.Tensor) -> int:
        """Most rows the own product takes for ``weight`` [N, K]; more go to torch's."""
        return self.large_rows if weight.numel() >= LARGE_PRODUCT else self.matvec_rows


def _module() -> Any:
    return _built()[0]


def build_error() -> str | None:
    """Why the kernels' build failed in this process (the compiler's output), or None."""
    return _built()[1]


@cache  # one build per process; the compiled module is process-wide by nature
def _built() -> tuple[Any, str | None]:
    """(the compiled module or None, why its build failed)."""
    if os.environ.get("TLT_SERVE_NO_KERNELS") == "1":
        return None, None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, None
    try:
        log.info("building the bf16 CPU kernels (first use on this machine)")
        return _build(openmp=True), None
    except Exception as err:
        log.warning("bf16 kernels without OpenMP (single-threaded): %s", err)
        try:
            return _build(openmp=False), None
        except Exception as err2:  # any build problem: fall back to torch's kernels, loudly
            log.warning("bf16 kernels unavailable, using torch's: %s", err2)
            return None, f"{err}\n{err2}"


def cpu_kernels() -> CpuKernels | None:
    """The own kernels (see ``CpuKernels`` and ``bf16_gemv.cpp``), or None: use torch's."""
    module = _module()
    if module is None:
        return None
    queries = ATTENTION_QUERIES
    if own_avx512_bf16():  # (own AMX tiles imply it)
        if own_amx():
            rows, large = MATVEC_ROWS_OWN_AMX, MATVEC_ROWS_LARGE_OWN_AMX
        else:
            rows = MATVEC_ROWS_AMX if amx_tiles() else MATVEC_ROWS_AVX512_BF16
            large = min(rows, MATVEC_ROWS_LARGE)
        layer = LAYER_ROWS_BF16_GEMM if native_bf16_gemm() else rows
        queries = ATTENTION_QUERIES_AVX512_BF16
    else:
        rows = large = layer = MATVEC_ROWS_NATIVE_BF16 if native_bf16_gemm() else MATVEC_ROWS
    return CpuKernels(
        module.gemv_bf16, module.rms_norm_bf16, module.attention_bf16, rows, large, layer,
        attention_queries=queries, block_queries=BLOCK_QUERIES, layer=module.decoder_layer_bf16,
        stack=module.decoder_stack_bf16, write=module.write_rows,
    )


def build_of(here: Path) -> Any:
    """The kernels compiled from the ``SOURCES`` in ``here`` (another revision's, for a
    side-by-side benchmark; ``kernels_of`` puts them in a model's ``CpuKernels``)."""
    return _build(openmp=True, here=here)


def kernels_of(module: Any, kernels: CpuKernels) -> CpuKernels:
    """``kernels`` (the row limits, the paths) with ``module``'s compiled functions in place
    of this build's; one ``module`` lacks: None (torch's, or op by op)."""
    return replace(kernels, matvec=module.gemv_bf16, norm=module.rms_norm_bf16,
                   attention=module.attention_bf16,
                   layer=getattr(module, "decoder_layer_bf16", None),
                   stack=getattr(module, "decoder_stack_bf16", None),
                   write=getattr(module, "write_rows", None))


def sampling_kernels() -> SamplingKernels | None:
    """The own sampling kernels (see ``SamplingKernels``), or None: use torch's ops."""
    module = _module()
    if module is None:
        return None
    return SamplingKernels(module.sample_rows, module.token_logprobs, module.log_softmax_rank)


def batch_invariant(kernels: CpuKernels) -> CpuKernels:
    """``kernels`` taking every row of every step (products, the whole layer, the attention
    of any head size and prompt length): each computes a token the same way whatever else its
    step holds (a row's sums run in one order, its attention over exactly its keys), so a
    token's logits depend on the tokens before it only (and its logprob, sampled or scored,
    on its logits only: ``SamplingKernels``). No row attends by blocks."""
    return replace(kernels, matvec_rows=EVERY_ROW, large_rows=EVERY_ROW, layer_rows=EVERY_ROW,
                   attention_queries=EVERY_ROW, other_head_queries=EVERY_ROW,
                   block_queries=EVERY_ROW)


def matvec_avx2() -> MatVec | None:
    """The own product on its AVX2 path whatever the CPU (bf16 rows widened to fp32): what
    ``matvec`` was before its AVX512-BF16 path, kept for side-by-side comparisons."""
    module = _module()
    return None if module is None else module.gemv_bf16_avx2


def attention_avx2() -> RowAttention | None:
    """The own attention on its AVX2 path whatever the CPU: the same bits as
    ``attention_widened`` (kept for comparisons and the test that they agree)."""
    module = _module()
    return None if module is None else module.attention_bf16_avx2


def attention_avx2_heads() -> RowAttention | None:
    """``attention_avx2`` one query head at a time (each key and value row widened per head,
    not once per group of heads): the same bits, kept for the test that they agree."""
    module = _module()
    return None if module is None else module.attention_bf16_avx2_heads


def attention_widened() -> RowAttention | None:
    """The own attention with keys widened to fp32 whatever the CPU: each key and value row
    widened once for all heads of a group where the CPU has AVX512, else the AVX2 path. Where
    the CPU has AVX512-BF16, ``attention`` scores by bf16 dot products instead (the same
    products, summed in another order)."""
    module = _module()
    return None if module is None else module.attention_bf16_widened


def attention_dot() -> RowAttention | None:
    """The own attention without AMX tiles: its scores by AVX512-BF16 dot products where the
    CPU has them (else as ``attention_widened``). Where the CPU has tiles, ``attention`` scores
    keys on them for head sizes 64 and 128 (the same products, summed in another order); this
    is kept for comparisons."""
    module = _module()
    return None if module is None else module.attention_bf16_dot


def own_avx512() -> bool:
    """Whether the own attention takes its AVX512 path here."""
    module = _module()
    return module is not None and bool(module.avx512())


def own_avx512_bf16() -> bool:
    """Whether the own product multiplies bf16 rows, and the own attention scores keys, with
    AVX512-BF16 dot products here."""
    module = _module()
    return module is not None and bool(module.avx512_bf16())


def own_amx() -> bool:
    """Whether the own product multiplies bf16 rows on AMX tiles here (the CPU has them and
    the OS lets this process use them)."""
    module = _module()
    return module is not None and bool(module.amx())


def matvec_dot() -> MatVec | None:
    """The own product without AMX tiles (AVX512-BF16 dot products where the CPU has them):
    what ``matvec`` is where the CPU has no tiles, kept for side-by-side comparisons."""
    module = _module()
    return None if module is None else module.gemv_bf16_dot


def silu_mul() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The layer kernel's MLP activation: a gate/up product [R, 2I] bf16 → silu(gate) * up
    [R, I], the bits of torch's two ops (silu from a table of torch's own silu over every bf16
    value where I is a multiple of 64, else torch's ops)."""
    module = _module()
    return None if module is None else module.silu_mul_bf16


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (torch's bf16 products run on them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def native_bf16_gemm() -> bool:
    """Whether this CPU has bf16 GEMM units torch uses (AVX512-BF16 / AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _build(openmp: bool, here: Path | None = None) -> Any:
    """Compile (or load the cached build of) the kernels (of the ``SOURCES`` in ``here``,
    by default this package's: another revision's, for a side-by-side benchmark).

    ``at::parallel_for`` in an extension splits work over torch's threads only when the
    extension itself is compiled with OpenMP: without ``-fopenmp`` its pragma is ignored and
    the product runs on one core (measured here: the 49152 x 576 head at one row took 5.4 ms
    on 1 or 2 threads alike, 2.8 ms with OpenMP on 2). Linking ``-fopenmp`` resolves to the
    libgomp torch already loaded (same soname), so there is one OpenMP runtime and one pool.
    """
    from torch.utils.cpp_extension import get_default_build_root, load

    omp = ["-fopenmp"] if openmp else []
    cflags = ["-O3", "-mavx2", "-mfma", *omp]
    here = here or Path(__file__).parent
    name = f"tlt_serve_bf16_{build_key(here, cflags)}" + ("_omp" if openmp else "")
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's
    build_dir = Path(root) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with _builder_lock(build_dir / "tlt-build.flock"):
        stale = build_dir / "lock"  # torch's; no live builder holds it while we hold ours
        if stale.exists():
            log.warning("removing %s, left by a build that was stopped", stale)
            stale.unlink(missing_ok=True)
        return load(
            name=name,
            sources=[str(here / f) for f in SOURCES if f.endswith(".cpp")],
            extra_cflags=cflags,
            extra_ldflags=omp,
            build_directory=str(build_dir),
            verbose=False,
        )


def build_key(here: Path, cflags: list[str]) -> str:
    """Hash of what the build depends on: sources and header, flags, torch's version."""
    digest = hashlib.sha256(torch.__version__.encode())
    for f in SOURCES:
        digest.update(f.encode() + b"\0" + (here / f).read_bytes())
    digest.update(" ".join(cflags).encode())
    return digest.hexdigest()[:16]


class _builder_lock:
    """An exclusive ``flock`` on ``path``, waited for up to ``BUILD_WAIT_S``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, said = time.monotonic() + BUILD_WAIT_S, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(
                        f"another process has been building the kernels for over "
                        f"{BUILD_WAIT_S:.0f} s (it holds {self.path}); stop it or delete "
                        f"{self.path.parent}"
                    ) from None
                if not said:
                    log.info("waiting for another process's kernel build (%s)", self.path)
                    said = True
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing drops the flock
