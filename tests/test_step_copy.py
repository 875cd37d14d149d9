"""The drafter inputs vLLM's worker keeps per request (``backends/vllm/step_copy.py``): of
each step's rows the accepted ones, in position order, whatever the caller does with its
buffers after the call; on CUDA the same, through pinned copies and events (no host sync in
the step)."""

from __future__ import annotations

import os

import pytest
import torch

from tlt_serve.backends.vllm.step_copy import StepCopies

H = 8


def run_steps(device: str) -> dict[str, list[tuple[int, list[int], torch.Tensor]]]:
    """Two requests: a prefill step (prompts of 3 and 2 rows), then a verify step of 1 + 3
    rows each with 2 and 0 rejected; every buffer reused and scribbled over after each add."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(16, dtype=torch.long, device=device)
    positions = torch.zeros(16, dtype=torch.long, device=device)
    hidden = torch.zeros(16, H, device=device)
    copies = StepCopies()
    expect: dict[str, list[tuple[int, list[int], torch.Tensor]]] = {"a": [], "b": []}

    def step(starts: list[int], first_pos: list[int], rejected: list[int] | None) -> None:
        T = starts[-1]
        tok = torch.randint(0, 1000, (T,), generator=g)
        hid = torch.randn(T, H, generator=g)
        pos = torch.cat([torch.arange(p, p + starts[r + 1] - starts[r])
                         for r, p in enumerate(first_pos)])
        tokens[:T], positions[:T], hidden[:T] = tok.to(device), pos.to(device), hid.to(device)
        rej = None if rejected is None else torch.tensor(rejected, device=device)
        copies.add(["a", "b"], starts, tokens, positions, hidden, rej)
        tokens.fill_(-1), positions.fill_(-1), hidden.fill_(float("nan"))  # reused at once
        for r, rid in enumerate(["a", "b"]):
            a = starts[r]
            keep = starts[r + 1] - a - (0 if rejected is None else rejected[r])
            expect[rid].append((first_pos[r], tok[a:a + keep].tolist(), hid[a:a + keep]))

    step([0, 3, 5], [0, 0], None)  # prefill
    step([0, 4, 8], [3, 2], [2, 0])  # verify: a keeps 2 of 4 rows, b all 4
    got = {rid: [(s, t.tolist(), f.cpu()) for s, t, f in copies.take(rid)] for rid in "ab"}
    assert copies.take("a") == []  # forgotten once taken
    for rid in "ab":
        assert [(s, t) for s, t, _ in got[rid]] == [(s, t) for s, t, _ in expect[rid]]
        for (_, _, f), (_, _, e) in zip(got[rid], expect[rid], strict=True):
            torch.testing.assert_close(f, e, rtol=0, atol=0)
    return got


def test_kept_rows_on_the_host() -> None:
    got = run_steps("cpu")
    assert [len(t) for _, t, _ in got["a"]] == [3, 2] and [len(t) for _, t, _ in got["b"]] == [2, 4]


def test_dropped_requests_are_forgotten() -> None:
    copies = StepCopies()
    copies.add(["a"], [0, 2], torch.arange(2), torch.arange(2), torch.zeros(2, H), None)
    copies.drop("a")
    assert copies.take("a") == [] and not copies.segments


def test_kept_rows_through_pinned_copies_on_cuda() -> None:
    if not torch.cuda.is_available():  # scripts/gpu_check.sh runs it on a GPU
        if os.environ.get("TLT_REQUIRE_CUDA") == "1":
            pytest.fail("no CUDA device; TLT_REQUIRE_CUDA=1 requires one", pytrace=False)
        pytest.skip("no CUDA device")
    run_steps("cuda")
