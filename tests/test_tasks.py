"""The arithmetic task (clients/tasks.py) and the load benchmark's bookkeeping."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.common.timing import Timed, latency_stats, small_batch_phase, timeline
from clients.tasks import STYLES, Problem, make_problems, reward, solution


def test_every_style_solves_and_the_reward_checks_the_answer() -> None:
    for p in make_problems(50, seed=3):
        for style in range(STYLES):
            assert reward(p, solution(p, style)) == 1.0
        assert reward(p, f"Answer: {p.answer + 1}") == 0.0
        assert reward(p, "no answer at all") == 0.0
        # The last answer counts (a model that corrects itself).
        assert reward(p, f"Answer: {p.answer + 1}\nAnswer: {p.answer}") == 1.0
    with pytest.raises(ValueError, match="style"):
        solution(make_problems(1, 0)[0], STYLES)


def test_values_and_prompt() -> None:
    p = Problem(4, (("+", 3), ("*", 2), ("-", 5)))
    assert p.values() == [7, 14, 9] and p.answer == 9
    assert p.prompt.startswith("Start with 4. Add 3, then multiply by 2, then subtract 5.")


def test_problem_lengths_are_long_tailed_and_seeded() -> None:
    probs = make_problems(2000, seed=0)
    ops = [len(p.ops) for p in probs]
    assert 2.5 < statistics.fmean(ops) < 3.5 and max(ops) >= 10  # geometric, capped at 16
    assert sum(o == 1 for o in ops) > sum(o >= 6 for o in ops) > 0
    assert make_problems(20, seed=5) == make_problems(20, seed=5)
    assert make_problems(20, seed=5) != make_problems(20, seed=6)


def test_load_bookkeeping() -> None:
    t0 = 100.0
    a = Timed(sent=t0, first=t0 + 0.5, done=t0 + 2.5, tokens=5,
              token_times=[(t0 + 0.5, 1), (t0 + 1.5, 2), (t0 + 2.5, 2)])
    b = Timed(sent=t0, first=t0 + 1.0, done=t0 + 1.2, tokens=2,
              token_times=[(t0 + 1.0, 1), (t0 + 1.2, 1)], accept_length=2.0, verify_ct=1)
    err = Timed(sent=t0, error="HTTP 503")
    s = latency_stats([a, b, err], t0)
    assert s["requests"] == 3 and s["errors"] == 1 and s["tokens"] == 7
    assert s["seconds"] == pytest.approx(2.5) and s["tok_s"] == pytest.approx(7 / 2.5)
    assert s["ttft"]["p50"] == pytest.approx(1.0) and a.tpot == pytest.approx(0.5)
    assert s["accept_length"] == pytest.approx(2.0)
    tl = timeline([a, b], t0, 1.0)
    assert sum(tl["tok_s"]) == pytest.approx(7.0)  # every token lands in one 1 s bin
    assert tl["running"][0] == 2 and tl["running"][-1] == 1


def test_small_batch_phase_bounds_what_tail_speculation_can_gain() -> None:
    # 5 sequences ending at 1..4 s and 10 s: <= 2 running from the 3rd completion (3 s) on.
    s = small_batch_phase([1.0, 2.0, 3.0, 4.0, 10.0], max_batch=2)
    assert s["small_batch_s"] == pytest.approx(7.0)
    assert s["ceiling_free"] == pytest.approx(10 / 3)
    assert s["ceiling_2x"] == pytest.approx(10 / 6.5)
    # Never as few as 2 running before the end: nothing to gain.
    s = small_batch_phase([5.0, 5.0, 5.0, 5.0], max_batch=2)
    assert s["small_batch_s"] == 0 and s["ceiling_free"] == 1.0
    # All of it runs small.
    s = small_batch_phase([1.0, 3.0], max_batch=8)
    assert s["small_batch_s"] == 3.0 and s["ceiling_free"] is None and s["ceiling_2x"] == 2.0
