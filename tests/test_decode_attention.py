"""The Triton attention of decode and chain-verify steps (``kernels/decode_attention.py``),
run by Triton's interpreter on the CPU, against torch's attention over the same keys: rows
of different lengths, causal verify rows, grouped heads, padding queries, one slice of the
keys or many, fp32 and bf16.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so the kernels run in a
process of their own (``python -m tests.test_decode_attention DTYPE``), which prints each
case's largest error as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# (B, Q, G, keys, programs): decode at batch 1 over four slices, some past the row's end;
# rows of different lengths; chain verify, causal within the drafts; one slice
CASES = [(1, 1, 2, 256, 64), (3, 1, 4, 256, 8), (2, 5, 2, 128, 64), (4, 3, 1, 64, 1)]
DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 2e-2)}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_lo: int,
              lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention query by query over each query's first lens[b, j] keys (at least one), in
    fp64."""
    B, kvH, R, D = q.shape
    QN = lens.shape[1]
    out = torch.empty(B, kvH, R, D, dtype=torch.float64)
    for b in range(B):
        for r in range(R):
            n = max(int(lens[b, r % QN]), 1)
            keys = k[row_lo + b, :, :n].double()  # [kvH, n, D]
            w = torch.softmax((keys @ q[b, :, r].double().unsqueeze(-1)).squeeze(-1) * scale, -1)
            out[b, :, r] = (w.unsqueeze(-1) * v[row_lo + b, :, :n].double()).sum(1)
    return out


def case_error(dtype: torch.dtype, B: int, QN: int, G: int, keys: int, programs: int) -> float:
    from tlt_serve.kernels.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(B * 100 + QN * 10 + G)
    kvH, D, S, L1, row_lo = 2, 32, B + 3, 300, 2
    k = torch.randn(S, kvH, L1, D, generator=gen).to(dtype)
    v = torch.randn(S, kvH, L1, D, generator=gen).to(dtype)
    q = torch.randn(B, kvH, G * QN, D, generator=gen).to(dtype)
    starts = torch.randint(0, keys - QN, (B,), generator=gen)
    lens = (starts.view(B, 1) + torch.arange(QN).view(1, QN) + 1).to(torch.int32)  # causal
    if QN > 1:
        lens[0, -1] = 0  # a padding query (a row that drafted fewer tokens)
    scale = D**-0.5
    got = decode_attention(q, k, v, row_lo, lens, keys, scale, programs=programs)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.isfinite(got).all()  # padding queries included
    want = reference(q, k, v, row_lo, lens, scale)
    real = torch.ones(B, kvH, G * QN, dtype=torch.bool)
    if QN > 1:
        real[0, :, QN - 1 :: QN] = False  # the padding query's rows: not read
    return float((got.double() - want)[real].abs().max())


def interpreted(*args: str) -> str:
    """The last line this module prints run as ``python -m`` with ``args``, under Triton's
    interpreter."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "tests.test_decode_attention", *args],
                         env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_kernel_attends_what_torch_attends(dtype: str) -> None:
    errors = json.loads(interpreted(dtype))
    assert len(errors) == len(CASES)
    for case, err in zip(CASES, errors, strict=True):
        assert err < DTYPES[dtype][1], (case, err)


def test_static_steps_attending_through_the_kernel_change_no_real_row() -> None:
    """The static steps of ``test_step_graphs`` with the layers' regions attending through
    the kernel (what a GPU's captured steps do), fp32: hidden states, features and K/V as
    the model's own forward gives them."""
    assert interpreted("static") == "static steps: the kernel's attention throughout"


def static_steps() -> str:
    import tempfile

    import tlt_serve.kernels.decode_attention as kernel
    from tests.test_step_graphs import check_static_steps
    from tests.tiny import make_tiny_model
    from tlt_serve.models.compiled import CompiledLayers

    calls = []
    attend = kernel.decode_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return attend(*args, **kwargs)

    kernel.decode_attention = counted
    with tempfile.TemporaryDirectory() as tmp:
        layer_fn = CompiledLayers(compile=False, attention="triton")
        graphs = check_static_steps(make_tiny_model(Path(tmp) / "llama"), layer_fn=layer_fn)
    assert graphs.layer_fn is layer_fn and layer_fn.attention == "triton"  # no fallback
    layers = graphs.model.cfg.num_layers
    assert len(calls) == layers * (len(graphs.steps) + 5)  # a warm-up, then the 5 steps
    return "static steps: the kernel's attention throughout"


if __name__ == "__main__":
    if sys.argv[1] == "static":
        print(static_steps())
    else:
        print(json.dumps([case_error(DTYPES[sys.argv[1]][0], *c) for c in CASES]))
