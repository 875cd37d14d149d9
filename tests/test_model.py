"""The own Llama-family implementation against HF transformers, and the weight loader."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.harness import own_kernels
from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.kernels import (
    BLOCK_QUERIES,
    EVERY_ROW,
    LARGE_PRODUCT,
    CpuKernels,
    attention_avx2,
    attention_avx2_heads,
    attention_dot,
    attention_widened,
    matvec_avx2,
    matvec_dot,
    own_amx,
    own_avx512,
    own_avx512_bf16,
    silu_mul,
)
from tlt_serve.models.batch import ForwardBatch, flat_write_index
from tlt_serve.models.llama import (
    MATVEC_ROWS,
    DecoderLayer,
    Linear,
    LlamaModel,
    set_cpu_kernels,
)
from tlt_serve.models.loader import WeightError, build_model, iter_safetensors, load_weights


def fb(kv: KVCache, pos: torch.Tensor, mask: torch.Tensor) -> ForwardBatch:
    """Batch over rows 0..B-1 writing each token at its position."""
    index = flat_write_index(0, pos, kv.storage.shape[3], kv.storage.shape[4])
    return ForwardBatch(0, pos, index, mask, int(mask.shape[-1]))


def _causal(batch: int, q: int) -> torch.Tensor:
    cols = torch.arange(q)
    return (cols[None, :] <= cols[:, None]).expand(batch, 1, q, q)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_logits_match_hf_prefill_and_decode(tiny_model_factory, model_type: str) -> None:
    path = tiny_model_factory(model_type)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ours = build_model(path, torch.float32, 256)
    ids = torch.randint(0, ours.cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    kv = KVCache(ours.cfg, rows=4, max_len=32, dtype=torch.float32)
    pos = torch.arange(9).expand(3, 9)
    out = ours(ids, fb(kv, pos, _causal(3, 9)), kv.layers)
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(ours.logits(out.hidden), ref, atol=1e-4, rtol=1e-4)

    nxt = torch.tensor([[5], [6], [7]])
    step = torch.full((3, 1), 9)
    out = ours(nxt, fb(kv, step, torch.ones(3, 1, 1, 10, dtype=torch.bool)), kv.layers)
    with torch.no_grad():
        ref = hf(torch.cat([ids, nxt], dim=1)).logits[:, -1]
    torch.testing.assert_close(ours.logits(out.hidden[:, 0]), ref, atol=1e-4, rtol=1e-4)


def test_aux_hidden_layers_are_residual_stream(tiny_model_dir) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ours = build_model(tiny_model_dir, torch.float32, 64)
    ids = torch.tensor([[3, 4, 5, 6]])
    kv = KVCache(ours.cfg, rows=1, max_len=8, dtype=torch.float32)
    pos = torch.arange(4).unsqueeze(0)
    out = ours(ids, fb(kv, pos, _causal(1, 4)), kv.layers, aux_layers=(0,))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.aux[0], ref[1], atol=1e-5, rtol=1e-5)  # after layer 0


def test_bf16_model_runs_close_to_fp32(tiny_model_dir) -> None:
    fp32 = build_model(tiny_model_dir, torch.float32, 64)
    bf16 = build_model(tiny_model_dir, torch.bfloat16, 64)
    assert bf16.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert bf16.rope_table.dtype == torch.float32  # positions must not be rounded
    ids = torch.tensor([[3, 4, 5, 6]])
    pos = torch.arange(4).unsqueeze(0)
    logits = []
    for m, dt in ((fp32, torch.float32), (bf16, torch.bfloat16)):
        kv = KVCache(m.cfg, rows=1, max_len=8, dtype=dt)
        out = m(ids, fb(kv, pos, _causal(1, 4)), kv.layers)
        logits.append(m.logits(out.hidden))
    assert (logits[0] - logits[1]).abs().max() < 0.5


def test_loader_rejects_bad_tensors_atomically(tiny_model_dir) -> None:
    model = build_model(tiny_model_dir, torch.float32, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = dict(iter_safetensors(tiny_model_dir))
    name = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "unknown weight name": [("model.layers.0.bogus.weight", good[name])],
        "has shape": [(name, good[name][:-1])],
        "dtype": [(name, good[name].to(torch.int32))],
        "NaN": [(name, torch.full_like(good[name], float("nan")))],
        "layers.99": [
            ("model.layers.99.mlp.up_proj.weight", good["model.layers.0.mlp.up_proj.weight"])
        ],
    }
    for expected, tensors in cases.items():
        # A valid tensor first: it must not be applied when a later one is bad.
        update = [("model.norm.weight", good["model.norm.weight"] + 1.0), *tensors]
        with pytest.raises(
            WeightError, match=expected.split()[0] if expected != "layers.99" else "unknown"
        ):
            load_weights(model, update)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_loader_fills_fused_slices(tiny_model_dir) -> None:
    model = build_model(tiny_model_dir, torch.float32, 64)
    tensors = dict(iter_safetensors(tiny_model_dir))
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    v = tensors["model.layers.1.self_attn.v_proj.weight"]
    fused = model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(fused[: q.shape[0]], q)
    assert torch.equal(fused[-v.shape[0] :], v)
    n = load_weights(model, [("model.layers.1.self_attn.v_proj.weight", v * 2)])
    assert n == 1 and torch.equal(fused[-v.shape[0] :], v * 2)
    assert torch.equal(fused[: q.shape[0]], q)


def test_fp32_batch_copies_track_weight_updates(tiny_model_dir, tiny_model_factory) -> None:
    """bf16 on CPUs without bf16 GEMM multiplies batches in fp32 against copies of the same
    weights; a weight update must refresh those copies or batches would use stale weights."""
    model = build_model(tiny_model_dir, torch.bfloat16, 64)
    model.set_fp32_batch_matmul(True)
    proj = model.layers[0].mlp.down_proj
    assert proj.weight_f32 is not None and torch.equal(proj.weight_f32, proj.weight.float())
    load_weights(model, iter_safetensors(tiny_model_factory("llama", seed=1)))
    assert torch.equal(proj.weight_f32, proj.weight.float())
    assert torch.equal(model.lm_head.weight_f32, model.embed_tokens.weight.float())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    batched = proj(torch.randn(3, 128, dtype=torch.bfloat16))
    assert batched.dtype == torch.bfloat16
    single = model.logits(x[:1])  # M == 1: the bf16 kernel
    torch.testing.assert_close(single, model.logits(x)[:1], atol=0.1, rtol=0.02)


def test_bf16_matvec_kernel_matches_fp32_product() -> None:
    matvec = own_kernels().matvec
    g = torch.Generator().manual_seed(0)
    for n, k in [(1, 8), (7, 13), (3072, 576), (576, 1536)]:  # odd sizes hit the scalar tail
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(k, generator=g)
        ref = w.float() @ x
        torch.testing.assert_close(matvec(w, x), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="columns"):
        matvec(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(7))


@pytest.mark.parametrize("rows", [*range(1, 9), 9, 17, 64, 130])
def test_bf16_kernel_rows_match_and_do_not_depend_on_threads(rows: int) -> None:
    """Each 8-row chunk size (1..8) alone and after full chunks, K with and without the 8-,
    16- and 32-wide remainders, N across tiles, fp32 rows (AVX2 path) and bf16 rows (the
    AVX512-BF16 path where the CPU has it); each output is summed by one thread, so the split
    over threads changes no bit."""
    matvec = own_kernels().matvec
    g = torch.Generator().manual_seed(rows)
    threads = torch.get_num_threads()
    try:
        # (130, 2085): rows longer than the blocked path's limit, in blocks and a remainder
        for n, k in [(5, 13), (130, 24), (1000, 40), (200, 576), (70, 100), (130, 2085)]:
            w = torch.randn(n, k, generator=g).bfloat16()
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, k, generator=g).to(dtype)
                torch.set_num_threads(2)
                y2 = matvec(w, x)  # [rows, n]
                torch.set_num_threads(1)
                y1 = matvec(w, x)
                ref = x.float() @ w.float().T
                torch.testing.assert_close(y2, ref, atol=1e-4 * k**0.5, rtol=1e-5)
                assert torch.equal(y1, y2)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
def test_bf16_kernel_output_does_not_depend_on_the_weight_rows_beside_it(rows: int) -> None:
    """A thread reads several runs of weight rows at once (a step at a few rows waits on
    memory, and more streams read faster): an output is summed the same wherever its weight
    row sits in its tile, so a slice of the weight gives the same bits as the whole. fp32 rows
    take the AVX2 path, bf16 rows the AVX512-BF16 one where the CPU has it."""
    matvec = own_kernels().matvec
    g = torch.Generator().manual_seed(rows)
    for n, k in [(64, 576), (203, 72), (130, 1536), (67, 13), (70, 4096 + 32 + 5)]:
        w = torch.randn(n, k, generator=g).bfloat16()
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k, generator=g).to(dtype)
            whole = matvec(w, x)  # [rows, n]
            for lo, hi in [(1, n), (5, n - 3), (n // 2, n), (0, 17)]:
                part = matvec(w[lo:hi].contiguous(), x)
                assert torch.equal(part, whole[:, lo:hi]), (n, k, dtype, lo, hi)


def test_cache_write_kernel_moves_the_bytes_index_copy_moves() -> None:
    """The own K/V write (``CpuKernels.write``): the cache index_copy_ leaves, for bf16 and
    fp32 rows, rows from a transposed (strided) step and a single row; an index out of range
    (either end), rows of another dtype or width, or an index of another length are refused
    before anything is written."""
    write = own_kernels().write
    assert write is not None
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.randn(9, 3, 33, 64, generator=g).to(dtype)  # [S, kvH, L + 1, D]
        flat = cache.view(-1, 64)
        for rows in (1, 7, 300):
            index = torch.randperm(flat.shape[0], generator=g)[:rows]
            step = torch.randn(rows, 1, 64, generator=g).to(dtype)
            strided = step.expand(rows, 2, 64)[:, 1]  # [rows, 64], a row stride of 128
            want = flat.clone().index_copy_(0, index, strided)
            write(flat, index, strided)
            assert torch.equal(flat, want), (dtype, rows)
    before = flat.clone()
    row = torch.zeros(1, 64)
    for index, rows, why in [
        (torch.tensor([flat.shape[0]]), row, "out of range"),
        (torch.tensor([-1]), row, "out of range"),
        (torch.tensor([0, flat.shape[0]]), torch.zeros(2, 64), "out of range"),
        (torch.tensor([0]), row.bfloat16(), "dtype"),
        (torch.tensor([0]), torch.zeros(1, 32), "dtype and last size"),
        (torch.tensor([0, 1]), row, "index must be"),
    ]:
        with pytest.raises(RuntimeError, match=why):
            write(flat, index, rows)
    assert torch.equal(flat, before)


def test_bf16_matvec_kernel_takes_and_returns_bf16_exactly() -> None:
    """bf16 rows in: the same values as fp32 rows up to summation order (bit for bit where
    both take the AVX2 path); a bf16 result out: the same bits as rounding the fp32 result."""
    matvec = own_kernels().matvec
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=g).bfloat16()
    for rows in (1, 5, 16):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        ref = matvec(w, x, False)  # [rows, 300] fp32
        widened = matvec(w, x.float(), False)
        if own_avx512_bf16():
            torch.testing.assert_close(ref, widened, atol=1e-4 * 576**0.5, rtol=1e-5)
        else:
            assert torch.equal(ref, widened)
        out = matvec(w, x, True)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())


def test_avx2_product_of_a_row_does_not_depend_on_the_other_rows() -> None:
    """On the AVX2 path too every output is summed one way whatever the row count: 1 row (four
    runs of weight rows), 2-7 (one pass), 8 and more (blocks of 4 rows x 3 weight rows, the
    1-3 rows left one pass) give a row the bits it gets alone, at every position among the
    others, for K with and without a tail of columns after the 8-wide blocks, and N past one
    tile of 64 weight rows or not a multiple of the 3 or 4 a kernel takes at once."""
    own_kernels()
    avx2 = matvec_avx2()
    assert avx2 is not None
    g = torch.Generator().manual_seed(2)
    for n, k in [(200, 576), (67, 1536), (33, 40), (130, 13), (7, 4133)]:
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(21, k, generator=g)
        alone = torch.cat([avx2(w, x[i : i + 1]) for i in range(21)])  # [21, n]
        for lo, hi in [(0, 2), (1, 4), (0, 4), (3, 8), (0, 7), (5, 13), (2, 11), (0, 21)]:
            assert torch.equal(avx2(w, x[lo:hi]), alone[lo:hi]), (n, k, lo, hi)
        assert torch.equal(avx2(w, x[4]), alone[4])  # a 1-D row


def test_avx512_bf16_product_of_a_row_does_not_depend_on_the_other_rows() -> None:
    """On the AVX512-BF16 path every row is summed the same way whatever the row count: a
    sequence's bf16 products in a verify step or a batch equal its products alone. Rows of
    more than 2048 columns are walked in column blocks from three rows of X on, and whole
    below: the same sums (K = 4133: blocks, the 32-wide remainder and a tail; N = 70: a
    second, partial tile; K = 2597: a partial last block)."""
    own_kernels()
    if not own_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16: the own product takes its AVX2 path")
    matvec, avx2 = own_kernels().matvec, matvec_avx2()
    assert avx2 is not None
    g = torch.Generator().manual_seed(1)
    for n, k in [(200, 576), (64, 1536), (33, 40), (70, 4096 + 32 + 5), (40, 2560 + 37)]:
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(19, k, generator=g).bfloat16()
        alone = torch.cat([matvec(w, x[i : i + 1]) for i in range(19)])  # [19, n]
        for rows in (2, 5, 8, 13, 19):
            assert torch.equal(matvec(w, x[:rows]), alone[:rows])
        # the AVX2 path (bf16 rows widened) is the other summation order of the same products
        torch.testing.assert_close(avx2(w, x), alone, atol=1e-4 * k**0.5, rtol=1e-5)
        assert torch.equal(avx2(w, x), matvec(w, x.float()))


def test_amx_product_of_a_row_does_not_depend_on_the_other_rows() -> None:
    """On AMX tiles a row's products are summed the same way whatever the batch: rows alone,
    rows in the input tiles' padding (1, 17, 31 rows), past one work item's 128 rows and
    beside any others give the same bits; bf16 out is the fp32 result rounded once; the
    values are the dot-product path's up to summation order. Weights with K not a multiple
    of 32 or N not of 16 take the dot products."""
    own_kernels()
    if not own_amx():
        pytest.skip("no AMX tiles for this process: the own product takes the dot products")
    matvec, dot = own_kernels().matvec, matvec_dot()
    assert dot is not None
    g = torch.Generator().manual_seed(3)
    for n, k in [(48, 64), (960, 576), (576, 1536), (16, 32), (200, 576), (64, 40)]:
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(300, k, generator=g).bfloat16()
        full = matvec(w, x)  # [300, n] fp32
        if k % 32 or n % 16:  # no tiles: the dot products themselves
            assert torch.equal(full, dot(w, x)), (n, k)
        torch.testing.assert_close(full, dot(w, x), atol=2e-5 * k**0.5, rtol=1e-5)
        assert torch.equal(matvec(w, x, True), full.bfloat16())
        for lo, hi in [(0, 1), (5, 22), (3, 34), (100, 229), (299, 300)]:
            assert torch.equal(matvec(w, x[lo:hi]), full[lo:hi]), (n, k, lo, hi)
        assert torch.equal(matvec(w, x[7]), full[7])  # one row as a vector


def test_own_product_takes_at_most_matvec_rows_rows_and_torch_the_rest() -> None:
    """Where torch has bf16 GEMM units its product wins above a few rows (CpuKernels)."""
    kernels = own_kernels()
    taken: list[int] = []

    def counting(w: torch.Tensor, x: torch.Tensor, out_bf16: bool) -> torch.Tensor:
        taken.append(x.shape[0])
        return kernels.matvec(w, x, out_bf16)

    lin = Linear(64, 48).to(torch.bfloat16)
    set_cpu_kernels(lin, replace(kernels, matvec=counting, matvec_rows=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in (1, 4, 5, 9):
            x = torch.randn(rows, 64, generator=g).bfloat16()
            ref = torch.nn.functional.linear(x.float(), lin.weight.float())
            torch.testing.assert_close(lin(x).float(), ref, rtol=2e-2, atol=2e-2)
    assert taken == [1, 4]
    set_cpu_kernels(lin, None)  # no kernel: the default limit again
    assert lin.matvec is None and lin.matvec_rows == MATVEC_ROWS


def test_products_of_many_weights_take_their_own_row_limit(tiny_model_dir) -> None:
    """A layer's product of LARGE_PRODUCT weights or more gets ``large_rows``, the others and
    the head ``matvec_rows``; a layer's whole-layer kernel takes ``layer_rows``, and at least
    its products' smallest limit, each product its own limit inside it."""
    kernels = replace(own_kernels(), matvec_rows=48, large_rows=16, layer_rows=8)
    big, small = Linear(64, LARGE_PRODUCT // 64), Linear(64, 48)
    assert big.weight.numel() == LARGE_PRODUCT
    set_cpu_kernels(big, kernels)
    set_cpu_kernels(small, kernels)
    assert (big.matvec_rows, small.matvec_rows) == (16, 48)
    model = build_model(tiny_model_dir, torch.bfloat16, 64, cpu_kernels=True)
    set_cpu_kernels(model, kernels)
    layer = next(m for m in model.modules() if isinstance(m, DecoderLayer))
    assert layer.kernel_rows == 48  # the tiny model's products are small
    model.lm_head.weight = torch.nn.Parameter(  # a large head keeps matvec_rows
        torch.zeros(LARGE_PRODUCT // 64, 64, dtype=torch.bfloat16), requires_grad=False)
    set_cpu_kernels(model, kernels)
    assert model.lm_head.matvec_rows == 48
    layer.mlp.down_proj.weight = torch.nn.Parameter(
        torch.zeros(64, LARGE_PRODUCT // 64, dtype=torch.bfloat16), requires_grad=False)
    set_cpu_kernels(model, kernels)
    assert layer.kernel_rows == 16 and layer.mlp.down_proj.matvec_rows == 16
    assert layer.product_rows == [48, 48, 48, 16]  # qkv, o, gate_up, down
    set_cpu_kernels(model, replace(kernels, layer_rows=200))
    assert layer.kernel_rows == 200 and layer.product_rows == [48, 48, 48, 16]


def test_bf16_rms_norm_kernel_is_hf_order() -> None:
    """HF's RMSNorm: normalise in fp32, round to bf16, times the weight, round; bit for bit
    at the row counts of decode and verify steps, within one bf16 ulp for long rows."""
    norm = own_kernels().norm
    g = torch.Generator().manual_seed(0)
    w = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    for rows in (1, 5, 21):
        x = (3 * torch.randn(rows, 576, generator=g)).bfloat16()
        xf = x.float()
        hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        y = norm(x, w, 1e-5)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        torch.testing.assert_close(y, hf, atol=0, rtol=2**-7)
        if rows <= 5:
            assert torch.equal(y, hf)
    with pytest.raises(RuntimeError, match="features"):
        norm(torch.zeros(2, 8, dtype=torch.bfloat16), w, 1e-5)


def test_silu_mul_kernel_gives_torchs_bits_for_every_bf16_value() -> None:
    """The layer kernel's silu(gate) * up against torch's two ops, bit for bit: every bf16
    value as a gate (NaNs, infinities and subnormals included) at a width the table takes, and
    random rows at widths it takes and at one it leaves to torch."""
    own_kernels()
    act = silu_mul()
    assert act is not None
    g = torch.Generator().manual_seed(0)

    def torchs(gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.split(gu.shape[1] // 2, dim=1)
        return F.silu(gate) * up

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gate = every.view(torch.bfloat16).view(64, 1024)
    gu = torch.cat([gate, torch.randn(64, 1024, generator=g).bfloat16()], dim=1)
    assert torch.equal(act(gu).view(torch.int16), torchs(gu).view(torch.int16))
    for rows, inter in ((1, 1536), (8, 1536), (3, 4864), (33, 96)):
        gu = (3 * torch.randn(rows, 2 * inter, generator=g)).bfloat16()
        out = act(gu)
        assert out.shape == (rows, inter)
        assert torch.equal(out.view(torch.int16), torchs(gu).view(torch.int16)), (rows, inter)
    with pytest.raises(RuntimeError, match="gu must be"):
        act(torch.zeros(2, 7, dtype=torch.bfloat16))


@pytest.mark.parametrize("G", [1, 3])
def test_attention_kernel_matches_sdpa(G: int) -> None:
    """Query tokens of rows of different lengths (query (b, j) sees columns [0, lens[b, j]);
    0: a padding query, zeros), GQA groups of G, a batch that starts past row 0 of the cache;
    against fp32 SDPA. A query's output does not depend on the batch it is computed in."""
    kernels = own_kernels()
    g = torch.Generator().manual_seed(G)
    S, kvH, L, D, row_lo, B, Q = 6, 2, 300, 64, 1, 4, 3
    k_cache = torch.randn(S, kvH, L, D, generator=g).bfloat16()
    v_cache = torch.randn(S, kvH, L, D, generator=g).bfloat16()
    q = torch.randn(B, Q, kvH, G, D, generator=g).bfloat16()
    lens = torch.tensor([[1, 0, 0], [5, 6, 7], [298, 299, 300], [129, 130, 0]])
    none = torch.empty(0, dtype=torch.long)  # no tree bits
    out = kernels.attention(q, k_cache, v_cache, row_lo, lens, none, D**-0.5)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    for b in range(B):
        for j in range(Q):
            n = int(lens[b, j])
            if n == 0:
                assert not out[b, j].any()
                continue
            keys = k_cache[row_lo + b, :, :n].float()  # [kvH, n, D]
            values = v_cache[row_lo + b, :, :n].float()
            ref = torch.nn.functional.scaled_dot_product_attention(q[b, j].float(), keys, values)
            torch.testing.assert_close(out[b, j].float(), ref, atol=1e-2, rtol=1e-2)
            # The same query alone (a decode step) gets exactly the same output.
            alone = kernels.attention(
                q[b : b + 1, j : j + 1], k_cache, v_cache, row_lo + b, lens[b : b + 1, j : j + 1],
                none, D**-0.5,
            )
            assert torch.equal(alone[0, 0], out[b, j])
    with pytest.raises(RuntimeError, match="lens out of range"):
        kernels.attention(q, k_cache, v_cache, row_lo, lens.clamp(max=L) + 1, none, 1.0)
    with pytest.raises(RuntimeError, match="one entry per query"):
        kernels.attention(q, k_cache, v_cache, row_lo, lens[:, 0], none, 1.0)
    with pytest.raises(RuntimeError, match="rows out of range"):
        kernels.attention(q, k_cache, v_cache, 3, lens, none, 1.0)


def test_attention_kernel_tree_nodes_get_their_decode_bits() -> None:
    """A tree node (tree bits) sees the committed prefix, then its ancestors and itself at
    scattered columns: exactly what its token sees in plain decoding with that path laid out
    contiguously. Same bits as that decode query, whatever the prefix length's alignment."""
    kernels = own_kernels()
    g = torch.Generator().manual_seed(7)
    S, kvH, G, L, D = 2, 3, 3, 80, 64
    none = torch.empty(0, dtype=torch.long)
    for start in (1, 8, 13, 40):  # prefix lengths on and off the kernel's groups of 8 keys
        k_cache = torch.randn(S, kvH, L, D, generator=g).bfloat16()
        v_cache = torch.randn(S, kvH, L, D, generator=g).bfloat16()
        # Tree: root 0; 1, 2 under the root; 3 under 1; 4 under 3; 5 under 2.
        parents = [0, 0, 1, 3, 2]
        anc = [[0]]
        for i, p in enumerate(parents, start=1):
            anc.append(anc[p] + [i])
        N = len(anc)
        q = torch.randn(1, N, kvH, G, D, generator=g).bfloat16()
        lens = torch.tensor([[start + len(a) for a in anc]])  # [1, N]
        bits = torch.tensor([sum(1 << i for i in a) for a in anc])  # [N]
        out = kernels.attention(q, k_cache, v_cache, 0, lens, bits, D**-0.5)
        for j, a in enumerate(anc):
            # Plain decoding of path a: its nodes' K/V at columns start, start + 1, .. of row 1.
            cols = torch.tensor(list(range(start)) + [start + i for i in a])
            k_cache[1], v_cache[1] = k_cache[0], v_cache[0]
            k_cache[1, :, : len(cols)] = k_cache[0][:, cols]
            v_cache[1, :, : len(cols)] = v_cache[0][:, cols]
            lone = torch.tensor([[len(cols)]])
            ref = kernels.attention(q[:, j : j + 1], k_cache, v_cache, 1, lone, none, D**-0.5)
            assert torch.equal(out[0, j], ref[0, 0]), (start, j)
    with pytest.raises(RuntimeError, match="one entry per query"):
        kernels.attention(q, k_cache, v_cache, 0, lens, bits[:3], D**-0.5)
    with pytest.raises(RuntimeError, match="more visible tree columns"):
        kernels.attention(q, k_cache, v_cache, 0, torch.ones(1, N, dtype=torch.long), bits, 1.0)


def test_attention_avx512_path_is_the_avx2_path_bit_for_bit() -> None:
    """Where the CPU has AVX512 the widening attention widens each key and value row once for
    a group of heads; every output must be the AVX2 path's bits: causal queries of every key
    count around the groups of 8 keys, tree nodes (gathered columns), head groups larger than
    one register group (G 7, 16), head sizes 64 / 128 / 256 and one the AVX512 path leaves
    (32)."""
    own_kernels()
    if not own_avx512():
        pytest.skip("this CPU has no AVX512: the attention has only its AVX2 path")
    avx2, widened = attention_avx2(), attention_widened()
    assert avx2 is not None and widened is not None
    assert_same_attention(widened, avx2, [(1, 64), (3, 64), (7, 64), (16, 64), (4, 128),
                                          (2, 256), (3, 32)], seed=11)


def assert_same_attention(attention, reference, shapes: list[tuple[int, int]], seed: int
                          ) -> None:
    """``attention`` gives ``reference``'s bits for every (G, D) of ``shapes``: causal queries
    of 0 (padding) to 39 keys, from cache row 0 and 1, and tree nodes of 4 gathered columns."""
    g = torch.Generator().manual_seed(seed)
    none = torch.empty(0, dtype=torch.long)
    for G, D in shapes:
        kvH, L = 2, 40
        k_cache = torch.randn(3, kvH, L, D, generator=g).bfloat16()
        v_cache = torch.randn(3, kvH, L, D, generator=g).bfloat16()
        q = torch.randn(2, 20, kvH, G, D, generator=g).bfloat16()
        lens = torch.arange(40).view(2, 20)  # 0 (padding) .. 39 keys
        for row_lo in (0, 1):
            out = attention(q, k_cache, v_cache, row_lo, lens, none, D**-0.5)
            assert torch.equal(out, reference(q, k_cache, v_cache, row_lo, lens, none,
                                              D**-0.5)), (G, D, row_lo)
        tree_lens = torch.full((2, 20), 30)
        bits = torch.tensor([(0b1011 << (i % 5)) | 1 for i in range(40)])  # 4 set bits each
        tree = attention(q, k_cache, v_cache, 0, tree_lens, bits, D**-0.5)
        assert torch.equal(tree, reference(q, k_cache, v_cache, 0, tree_lens, bits, D**-0.5)), (
            G, D)


def test_attention_avx2_head_groups_are_the_head_by_head_bits() -> None:
    """The AVX2 attention takes a KV head's query heads in groups of up to 3, each key and
    value row widened once per group: every output must be the bits of taking the heads one
    at a time, for group sizes 1 to 3 and their mixes (G 4, 5, 7, 16), head sizes 64 / 128 and
    ones the groups leave (32, 256)."""
    own_kernels()
    grouped, heads = attention_avx2(), attention_avx2_heads()
    assert grouped is not None and heads is not None
    assert_same_attention(grouped, heads, [(1, 64), (2, 64), (3, 64), (4, 64), (7, 64),
                                           (16, 64), (3, 128), (5, 128), (3, 32), (2, 256)],
                          seed=13)


def test_attention_dot_product_scores_track_the_widened_path() -> None:
    """Where the CPU has AVX512-BF16 the attention scores keys by bf16 dot products: the same
    exact products as the widening path, summed in another order. Outputs agree within bf16
    rounding (most bit for bit) for causal rows of every key count around the blocks of 8,
    long rows (a prefill's), tree nodes, head groups past one register group and head sizes
    64 / 128 / 256, and a query computed alone gets the bits it gets among others."""
    kernels = own_kernels()
    if not own_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16: the attention widens keys to fp32")
    widened = attention_widened()
    assert widened is not None and kernels.attention is not None
    g = torch.Generator().manual_seed(5)
    none = torch.empty(0, dtype=torch.long)
    same = total = 0
    for G, D in [(1, 64), (3, 64), (7, 64), (16, 64), (4, 128), (2, 256)]:
        kvH, L, Q = 2, 300, 30
        k_cache = torch.randn(2, kvH, L, D, generator=g).bfloat16()
        v_cache = torch.randn(2, kvH, L, D, generator=g).bfloat16()
        q = torch.randn(2, Q, kvH, G, D, generator=g).bfloat16()
        lens = torch.stack([torch.arange(1, Q + 1), torch.arange(L - Q + 1, L + 1)])
        for bits, n in ((none, lens), (torch.tensor([(0b101 << (i % 7)) | 1 for i in range(2 * Q)]),
                                      torch.full((2, Q), 40))):
            dot = kernels.attention(q, k_cache, v_cache, 0, n, bits, D**-0.5)
            ref = widened(q, k_cache, v_cache, 0, n, bits, D**-0.5)
            torch.testing.assert_close(dot.float(), ref.float(), atol=2e-2, rtol=2e-2)
            same += int((dot == ref).sum())
            total += dot.numel()
        alone = kernels.attention(q[1:, -1:], k_cache, v_cache, 1, lens[1:, -1:], none, D**-0.5)
        batched = kernels.attention(q, k_cache, v_cache, 0, lens, none, D**-0.5)
        assert torch.equal(alone[0, 0], batched[1, -1]), (G, D)
    assert same > 0.99 * total  # fp32 sums in another order: bf16 outputs rarely differ


def test_attention_scores_on_amx_tiles_track_the_dot_products() -> None:
    """Where the process has AMX tiles the attention scores keys on them for head sizes 64
    and 128 (other sizes keep the dot products, bit for bit): outputs within bf16 rounding of
    the dot-product path, for rows of every key count around the tiles' 16 and 32 keys; a
    query alone gets the bits it gets among others; a tree node whose visible keys are the
    causal ones (gathered, not read in place) gets the causal query's bits."""
    kernels = own_kernels()
    if not own_amx():
        pytest.skip("no AMX tiles for this process: the attention scores by dot products")
    dot = attention_dot()
    assert dot is not None and kernels.attention is not None
    g = torch.Generator().manual_seed(6)
    none = torch.empty(0, dtype=torch.long)
    for G, D in [(3, 64), (7, 64), (16, 64), (4, 128), (2, 256)]:
        kvH, L, Q = 2, 100, 50
        k_cache = torch.randn(2, kvH, L, D, generator=g).bfloat16()
        v_cache = torch.randn(2, kvH, L, D, generator=g).bfloat16()
        q = torch.randn(2, Q, kvH, G, D, generator=g).bfloat16()
        lens = torch.stack([torch.arange(1, Q + 1), torch.arange(L - Q + 1, L + 1)])
        tiles = kernels.attention(q, k_cache, v_cache, 0, lens, none, D**-0.5)
        ref = dot(q, k_cache, v_cache, 0, lens, none, D**-0.5)
        if D == 256:
            assert torch.equal(tiles, ref)
        torch.testing.assert_close(tiles.float(), ref.float(), atol=2e-2, rtol=2e-2)
        alone = kernels.attention(q[1:, 7:8], k_cache, v_cache, 1, lens[1:, 7:8], none, D**-0.5)
        assert torch.equal(alone[0, 0], tiles[1, 7]), (G, D)
        # the last 3 of n keys as a tree node's ancestors and itself: columns n - 3 .. n - 1
        node = torch.full((2 * Q,), 0b111)
        gathered = kernels.attention(q, k_cache, v_cache, 0, lens.clamp(min=3), node, D**-0.5)
        causal = kernels.attention(q, k_cache, v_cache, 0, lens.clamp(min=3), none, D**-0.5)
        assert torch.equal(gathered, causal), (G, D)


def test_a_verify_row_never_attends_by_blocks() -> None:
    """A chain verify step's row holds the last token and up to MAX_DRAFT_TOKENS drafts:
    fewer tokens than a row needs to attend by blocks, so its tokens keep their decode bits."""
    from tlt_serve.config import MAX_DRAFT_TOKENS

    assert 1 + MAX_DRAFT_TOKENS < BLOCK_QUERIES


def test_prefill_runs_attend_by_blocks() -> None:
    """Where the process has AMX tiles or AVX512-BF16 a row of at least ``block_queries`` real
    query tokens (a prefill) attends 16 tokens at a time (tile products, or dot products
    without tiles), its weights rounded to bf16: within bf16 rounding of fp32 attention, as
    close as the token-by-token path is, for head sizes 64 and 128, group sizes 1 / 3 / 7, a
    prompt from column 0 and one extending 200 cached keys, block ends off the 16s and 32s,
    padding tokens (zeros), and cache columns past every token's keys holding NaNs. A token's
    output depends on its own query and keys only: the last 64 tokens of a prompt computed as
    a step of their own get the bits they get in the whole prompt. Rows of fewer real tokens
    (a decode row beside it, a 63-token run) and tree rows keep the token-by-token path's
    bits."""
    kernels = own_kernels()
    if not own_avx512_bf16():
        pytest.skip("no AVX512-BF16 for this process: every row attends token by token")
    assert kernels.attention is not None and kernels.block_queries == BLOCK_QUERIES
    attention = kernels.attention
    g = torch.Generator().manual_seed(9)
    none = torch.empty(0, dtype=torch.long)
    Q = 100
    for G, D in [(3, 64), (1, 64), (7, 64), (2, 128)]:
        kvH, L = 2, 320
        k_cache = torch.randn(4, kvH, L, D, generator=g).bfloat16()
        v_cache = torch.randn(4, kvH, L, D, generator=g).bfloat16()
        q = torch.randn(4, Q, kvH, G, D, generator=g).bfloat16()
        # row 0: a 100-token prompt; row 1: 70 tokens after 200 cached, then padding; row 2:
        # a decode token, then padding; row 3: 63 tokens
        lens = torch.zeros(4, Q, dtype=torch.long)
        lens[0] = torch.arange(1, Q + 1)
        lens[1, :70] = torch.arange(201, 271)
        lens[2, 0] = 150
        lens[3, :63] = torch.arange(1, 64)
        for b in range(4):  # columns no token sees hold NaNs
            k_cache[b, :, int(lens[b].max()):] = float("nan")
            v_cache[b, :, int(lens[b].max()):] = float("nan")
        blocks = attention(q, k_cache, v_cache, 0, lens, none, D**-0.5, BLOCK_QUERIES)
        tokens = attention(q, k_cache, v_cache, 0, lens, none, D**-0.5)
        assert not blocks.isnan().any()
        for b, n in ((0, Q), (1, 70)):
            # fp32 reference, all tokens of the row at once (GQA: each KV head's G heads)
            qf = q[b, :n].float().permute(1, 2, 0, 3)  # [kvH, G, n, D]
            m = int(lens[b, n - 1])
            keys = k_cache[b, :, :m].float().unsqueeze(1)  # [kvH, 1, m, D]
            values = v_cache[b, :, :m].float().unsqueeze(1)
            visible = torch.arange(m)[None, :] < lens[b, :n, None]  # [n, m]
            ref = F.scaled_dot_product_attention(qf, keys, values, attn_mask=visible,
                                                 scale=D**-0.5).permute(2, 0, 1, 3)
            err_blocks = (blocks[b, :n].float() - ref).abs()
            err_tokens = (tokens[b, :n].float() - ref).abs()
            assert err_blocks.max() < 2e-2, (G, D, b)
            assert err_blocks.mean() < 2 * err_tokens.mean() + 1e-4, (G, D, b)
            assert not torch.equal(blocks[b, :n], tokens[b, :n])  # the blocks ran
        assert not blocks[1, 70:].any() and not blocks[2, 1:].any()  # padding tokens: zeros
        assert torch.equal(blocks[2:], tokens[2:])  # a decode row and a 63-token run
        # The last 64 tokens of the prompt as a step of their own (chunked, or after a cached
        # prefix): their outputs do not depend on what else the step held.
        tail = attention(q[:1, Q - 64:], k_cache, v_cache, 0, lens[:1, Q - 64:], none, D**-0.5,
                         BLOCK_QUERIES)
        assert torch.equal(tail[0], blocks[0, Q - 64:]), (G, D)
        # Tree rows go token by token whatever their length.
        bits = torch.ones(4 * Q, dtype=torch.long)
        tree = attention(q, k_cache, v_cache, 0, lens.clamp(min=1), bits, D**-0.5, BLOCK_QUERIES)
        assert torch.equal(tree, attention(q, k_cache, v_cache, 0, lens.clamp(min=1), bits,
                                           D**-0.5))


@torch.inference_mode()
def test_prefill_rows_take_the_own_attention_up_to_its_limit(tmp_path) -> None:
    """``CpuKernels.attention_queries`` bounds the query tokens per row the own attention
    takes for heads of ``DOT_HEAD_DIMS`` (others keep 16): on a model of head size 64 a
    prefill of a 20-token row goes to SDPA under a limit of 16 and to the kernel under one of
    32 (the dot-product scores where the CPU has AVX512-BF16), with the same logits within
    bf16 rounding; a model of head size 16 keeps SDPA for it under either limit."""
    from tests.tiny import make_tiny_model
    from tlt_serve.engine.runner import extend_batch
    from tlt_serve.models.llama import Attention

    own_kernels()
    for head_dim in (64, 16):
        path = make_tiny_model(tmp_path / str(head_dim), hidden=4 * head_dim)
        model = build_model(path, torch.bfloat16, 64, cpu_kernels=True)
        kernels = model.kernels
        assert kernels is not None and kernels.attention is not None
        layers = sum(isinstance(m, Attention) for m in model.modules())
        kernel, calls = kernels.attention, []

        def counted(*args: object, kernel=kernel, calls=calls) -> torch.Tensor:
            calls.append(1)
            return kernel(*args)  # type: ignore[arg-type]

        g = torch.Generator().manual_seed(3)
        V = model.cfg.vocab_size
        prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 20, 9)]
        logits = []
        for limit in (16, 32):
            calls.clear()
            set_cpu_kernels(model, replace(kernels, attention=counted, layer=None,
                                           attention_queries=limit))
            kv = KVCache(model.cfg, rows=3, max_len=32, dtype=torch.bfloat16)
            batch, ids = extend_batch(kv, 0, [0, 0, 0], prompts)
            logits.append(model.logits(model(ids, batch, kv.layers).hidden[:, 4]))
            takes = head_dim == 64 and limit >= 20
            assert len(calls) == (layers if takes else 0), (head_dim, limit)
        torch.testing.assert_close(logits[0], logits[1], atol=0.1, rtol=0.05)


def test_attention_kernel_is_used_only_within_its_limits(tiny_model_dir) -> None:
    """head_dim a multiple of 8 up to 256, up to 16 query heads per KV head: other shapes keep
    torch's attention (the kernel would refuse them mid-request)."""
    from tlt_serve.models.arch import ArchConfig
    from tlt_serve.models.llama import Attention

    cfg = ArchConfig.from_dir(tiny_model_dir)  # head_dim 16, 4 heads over 2 KV heads
    kernels = CpuKernels(matvec=None, norm=None, attention=lambda *args: args[0])
    shapes = [(16, 4, 2, True), (256, 4, 2, True), (12, 4, 2, False), (264, 4, 2, False)]
    shapes += [(16, 32, 2, True), (16, 34, 2, False)]
    for head_dim, heads, kv_heads, fits in shapes:
        attn = Attention(replace(cfg, head_dim=head_dim, num_heads=heads, num_kv_heads=kv_heads))
        set_cpu_kernels(attn, kernels)
        assert (attn.kernel is not None) == fits, (head_dim, heads, kv_heads)


@torch.inference_mode()
def test_attention_kernel_in_the_model_matches_sdpa(tiny_model_dir) -> None:
    """A bf16 decode batch of rows with different lengths: logits with the kernel equal those
    of torch's masked SDPA within bf16 rounding."""
    from tlt_serve.engine.runner import extend_batch
    from tlt_serve.models.llama import Attention

    own_kernels()
    model = build_model(tiny_model_dir, torch.bfloat16, 64, cpu_kernels=True)
    kernels = model.kernels
    assert kernels is not None and kernels.attention is not None
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    kv = KVCache(model.cfg, rows=3, max_len=32, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    V = model.cfg.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 9, 2)]
    batch, ids = extend_batch(kv, 0, [0, 0, 0], prompts)
    model(ids, batch, kv.layers)
    batch, ids = extend_batch(kv, 0, [5, 9, 2], [[1], [2], [3]])
    assert batch.kv_lens is not None and batch.kv_lens.tolist() == [[6], [10], [3]]
    kernel, calls = kernels.attention, []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    logits = []
    for k in (counted, None):  # op by op (no whole-layer kernel): attention's own kernel
        set_cpu_kernels(model, replace(kernels, attention=k, layer=None))
        logits.append(model.logits(model(ids, batch, kv.layers).hidden[:, 0]))
    assert len(calls) == len(attn)  # every layer's decode attention ran in the kernel
    torch.testing.assert_close(logits[0], logits[1], atol=0.1, rtol=0.05)


Step = tuple[list[int], list[list[int]], bool]  # (starts, tokens per row, packed)


def _paired_steps(models: list[LlamaModel]) -> tuple[list[KVCache], list[Step]]:
    """A bf16 cache of 3 rows for each model, and the steps they run side by side: a prefill
    of prompts of different lengths (padded rows), a decode step, a packed verify step of
    ragged drafts."""
    caches = [KVCache(m.cfg, rows=3, max_len=32, dtype=torch.bfloat16) for m in models]
    g = torch.Generator().manual_seed(0)
    V = models[0].cfg.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 9, 2)]
    return caches, [([0, 0, 0], prompts, False), ([5, 9, 2], [[1], [2], [3]], False),
                    ([6, 10, 3], [[4, 5, 6], [7], [8, 9]], True)]


@torch.inference_mode()
@pytest.mark.parametrize("own_rows", [MATVEC_ROWS, 4])
def test_whole_layer_kernel_gives_the_op_by_op_layers_bits(tiny_model_dir, own_rows) -> None:
    """The same forwards through two copies of a bf16 model, one with the whole-layer kernel
    and one op by op (the same product, norm and attention kernels): a prefill of prompts of
    different lengths (padding tokens), a decode step, a packed verify step of ragged drafts.
    Every real position's hidden state and every cache entry is the same bits."""
    from tlt_serve.engine.runner import extend_batch

    own_kernels()
    models = [build_model(tiny_model_dir, torch.bfloat16, 64, cpu_kernels=True) for _ in range(2)]
    kernels = models[0].kernels
    assert kernels is not None and kernels.layer is not None
    # every step's rows, on any host; with a limit of 4 the 6-token verify step and the
    # prefill multiply through torch's product inside the kernel, as op by op (where torch
    # has a bf16 GEMM)
    kernels = replace(kernels, matvec_rows=own_rows, large_rows=own_rows,
                      layer_rows=MATVEC_ROWS)
    set_cpu_kernels(models[0], kernels)
    set_cpu_kernels(models[1], replace(kernels, layer=None))
    layers = [m for m in models[0].modules() if isinstance(m, DecoderLayer)]
    assert layers and all(m.kernel is not None for m in layers)
    calls: list[int] = []

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernels.layer(x, *args)  # type: ignore[misc]

    for m in layers:
        m.kernel = counted
    caches, steps = _paired_steps(models)
    for starts, tokens, pack in steps:
        hidden = []
        for model, kv in zip(models, caches, strict=True):
            batch, ids = extend_batch(kv, 0, starts, tokens, pack=pack)
            hidden.append(model(ids, batch, kv.layers).hidden)
        for b, t in enumerate(tokens):
            assert torch.equal(hidden[0][b, : len(t)], hidden[1][b, : len(t)]), (starts, b)
    if own_rows < MATVEC_ROWS and layers[0].mlp.down_proj.weight_f32 is not None:
        # no bf16 GEMM in torch here (AVX2 only): Linear multiplies more rows than its limit
        # by an fp32 copy, and the kernel, whose torch products are bf16, leaves those steps
        # (the prefill, the 6-token verify step) to the op-by-op path: it takes the decode step
        assert calls == [3] * len(layers)
    else:
        assert calls and len(calls) == len(steps) * len(layers)
        assert calls[-1] == 6  # the packed verify step computed its 6 real tokens only
    ends = [s + len(t) for s, t in zip(steps[-1][0], steps[-1][1], strict=True)]
    for b, end in enumerate(ends):  # [layers, 2, rows, kvH, max_len + 1, D]
        assert torch.equal(caches[0].storage[:, :, b, :, :end], caches[1].storage[:, :, b, :, :end])


@torch.inference_mode()
def test_layer_stack_gives_the_layer_kernels_bits(tiny_model_dir) -> None:
    """Every layer in one call (``LayerStack``) against the same layers called one by one
    through the whole-layer kernel: a padded prefill, a decode step with two aux layers, a
    packed ragged verify step and a draft tree. The same bits in every real position's hidden
    state, every aux output and every cache entry; the stack ran each step."""
    from tlt_serve.engine.draft_tree import DraftTree
    from tlt_serve.engine.runner import extend_batch

    own_kernels()
    models = [build_model(tiny_model_dir, torch.bfloat16, 64, cpu_kernels=True) for _ in range(2)]
    assert models[0].stack is not None and models[0].kernels is not None
    stack = models[0].stack
    runs: list[int] = []

    def counted(x: torch.Tensor, *args: object) -> list[torch.Tensor]:
        runs.append(x.shape[0])
        return stack.kernel(x, *args)

    models[0].stack = replace(stack, kernel=counted)
    models[1].stack = None  # the layers one by one, each through the whole-layer kernel
    assert all(m.kernel is not None for m in models[1].modules() if isinstance(m, DecoderLayer))
    caches, steps = _paired_steps(models)
    aux = (0, models[0].cfg.num_layers - 1)
    for starts, tokens, pack in steps:
        outs = []
        for model, kv in zip(models, caches, strict=True):
            batch, ids = extend_batch(kv, 0, starts, tokens, pack=pack)
            outs.append(model(ids, batch, kv.layers, aux_layers=aux))
        for b, t in enumerate(tokens):
            for h0, h1 in zip((outs[0].hidden, *outs[0].aux), (outs[1].hidden, *outs[1].aux),
                              strict=True):
                assert torch.equal(h0[b, : len(t)], h1[b, : len(t)]), (starts, b)
        assert len(outs[0].aux) == len(aux)
    # draft trees over the three rows (root + nodes), packed: a root with two children and
    # a grandchild, a chain of two, a single node
    trees = [DraftTree((11, 12, 13), (0, 0, 1)), DraftTree((14, 15), (0, 1)),
             DraftTree((16,), (0,))]
    tokens = [[1, 11, 12, 13], [2, 14, 15], [3, 16]]
    trees_out = []
    for model, kv in zip(models, caches, strict=True):
        batch, ids = extend_batch(kv, 0, [9, 11, 5], tokens, trees=trees, pack=True)
        assert batch.tree_bits is not None
        trees_out.append(model(ids, batch, kv.layers).hidden)
    for b, t in enumerate(tokens):
        assert torch.equal(trees_out[0][b, : len(t)], trees_out[1][b, : len(t)]), b
    assert runs == [3 * 9, 3, 6, 9]
    for b in range(3):  # [layers, 2, rows, kvH, max_len + 1, D]
        assert torch.equal(caches[0].storage[:, :, b, :, :16], caches[1].storage[:, :, b, :, :16])


@torch.inference_mode()
def test_prefills_by_blocks_give_the_same_bits_through_every_layer_path(tmp_path) -> None:
    """A bf16 model of head size 64 prefilling an 80-token prompt beside a 5-token one, then
    extending the first by 70 tokens (its cached prefix read by blocks), then a decode step:
    every layer in one call, each layer's kernel and the layers op by op give the same bits
    (where the process has AMX tiles or AVX512-BF16, the long rows by blocks); within bf16
    rounding of the same model attending token by token everywhere (``batch_invariant``'s
    attention)."""
    from tests.tiny import make_tiny_model
    from tlt_serve.engine.runner import extend_batch

    own_kernels()
    path = make_tiny_model(tmp_path, hidden=256, heads=4, kv_heads=2)
    models = [build_model(path, torch.bfloat16, 256, cpu_kernels=True) for _ in range(4)]
    kernels = models[0].kernels
    assert kernels is not None and models[0].stack is not None
    models[1].stack = None  # each layer's kernel
    set_cpu_kernels(models[2], replace(kernels, layer=None))  # op by op
    set_cpu_kernels(models[3], replace(kernels, block_queries=EVERY_ROW))  # token by token
    g = torch.Generator().manual_seed(4)
    V = models[0].cfg.vocab_size
    steps = [([0, 0], [torch.randint(0, V, (n,), generator=g).tolist() for n in (80, 5)]),
             ([80, 5], [torch.randint(0, V, (70,), generator=g).tolist(), [7]]),
             ([150, 6], [[8], [9]])]
    caches = [KVCache(m.cfg, rows=2, max_len=256, dtype=torch.bfloat16) for m in models]
    for starts, tokens in steps:
        hidden = []
        for model, kv in zip(models, caches, strict=True):
            batch, ids = extend_batch(kv, 0, starts, tokens, pack=True)
            hidden.append(model(ids, batch, kv.layers).hidden)
        for b, t in enumerate(tokens):
            for other in hidden[1:3]:
                assert torch.equal(hidden[0][b, : len(t)], other[b, : len(t)]), (starts, b)
        torch.testing.assert_close(hidden[0], hidden[3], atol=0.1, rtol=0.05)
    if own_avx512_bf16():  # the blocks ran: long rows' cache entries differ from token by token
        assert not torch.equal(caches[0].storage[:, :, 0], caches[3].storage[:, :, 0])
    else:
        assert torch.equal(caches[0].storage, caches[3].storage)


@torch.inference_mode()  # as the engine runs: the kernel is only used without autograd
def test_bf16_model_with_kernels_tracks_fp32(tiny_model_dir) -> None:
    own_kernels()
    fp32 = build_model(tiny_model_dir, torch.float32, 64)
    bf16 = build_model(tiny_model_dir, torch.bfloat16, 64, cpu_kernels=True)
    assert bf16.kernels is not None
    ids = torch.tensor([[3, 4, 5, 6]])
    outs = []
    for m, dt in ((fp32, torch.float32), (bf16, torch.bfloat16)):
        kv = KVCache(m.cfg, rows=1, max_len=8, dtype=dt)
        pos = torch.arange(4).unsqueeze(0)
        m(ids, fb(kv, pos, _causal(1, 4)), kv.layers)  # prefill (batched path)
        step = torch.tensor([[4]])
        out = m(
            torch.tensor([[7]]), fb(kv, step, torch.ones(1, 1, 1, 5, dtype=torch.bool)), kv.layers
        )
        outs.append(m.logits(out.hidden[:, 0]))  # single row: the matvec path when built
    assert (outs[0] - outs[1]).abs().max() < 0.5


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_packed_batch_computes_real_tokens_only_and_matches_padded(
    tiny_model_factory, model_type: str
) -> None:
    """A ragged batch (prefill of prompts of different lengths, then a verify-like extension
    of 4, 1 and 0 drafts) run packed gives the padded run's hidden states, aux layers and KV
    at every real position, and zeros at padding; the projections see only the real rows."""
    from tlt_serve.engine.runner import extend_batch

    model = build_model(tiny_model_factory(model_type), torch.float32, 64)
    g = torch.Generator().manual_seed(3)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 2, 5)]
    drafts = [[11, 12, 13, 14], [15], []]
    outs, caches, rows = [], [], []

    def count_rows(_m: torch.nn.Module, args: tuple[torch.Tensor], _out: torch.Tensor) -> None:
        rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])

    for pack in (False, True):
        kv = KVCache(model.cfg, rows=3, max_len=32, dtype=torch.float32)
        fb1, ids = extend_batch(kv, 0, [0, 0, 0], prompts, pack=pack)
        assert (fb1.packed is not None) == pack
        first = model(ids, fb1, kv.layers, aux_layers=(0, 1))
        starts = [len(p) for p in prompts]
        fb2, ids = extend_batch(kv, 0, starts, [[1, *d] for d in drafts], pack=pack)
        rows.clear()
        hook = model.layers[0].mlp.down_proj.register_forward_hook(count_rows)
        second = model(ids, fb2, kv.layers, aux_layers=(0, 1))
        hook.remove()
        assert rows == [1 + 4 + 1 + 1 + 1 if pack else 3 * 5]  # 8 real tokens vs 15
        outs.append((first, second))
        caches.append(kv.storage.clone())
    (padded1, padded2), (packed1, packed2) = outs
    steps = ((padded1, packed1, prompts), (padded2, packed2, [[1, *d] for d in drafts]))
    for padded, packed, toks in steps:
        pairs = zip((padded.hidden, *padded.aux), (packed.hidden, *packed.aux), strict=True)
        for t_padded, t_packed in pairs:
            for b, t in enumerate(toks):
                torch.testing.assert_close(t_packed[b, : len(t)], t_padded[b, : len(t)])
                assert not t_packed[b, len(t) :].any()  # padding: zeros
    # the real KV columns are equal; padding went to the scratch column in both runs
    for b, n in enumerate(len(p) + 1 + len(d) for p, d in zip(prompts, drafts, strict=True)):
        torch.testing.assert_close(caches[1][:, :, b, :, :n], caches[0][:, :, b, :, :n])
