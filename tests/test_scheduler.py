"""Scheduler bookkeeping without a model: random admit / step / abort sequences (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_serve.engine.request import Request, Status
from tlt_serve.engine.scheduler import Sampled, Scheduler
from tlt_serve.sampling_params import SamplingParams

ROWS, MAX_LEN, EOS = 4, 24, 0


class FakeKV:
    """Each row remembers which request's tokens it holds, as a real KV row would."""

    def __init__(self) -> None:
        self.owner: list[str | None] = [None] * ROWS

    def move(self, src: int, dst: int, length: int) -> None:
        assert 0 <= src < ROWS and 0 <= dst < ROWS and src != dst and length > 0
        self.owner[dst] = self.owner[src]


def run_batch(sched: Scheduler, kv: FakeKV, token: int):
    batch = sched.schedule()
    if batch is None:
        return []
    rows = [r.row for r in batch.forward]
    assert rows == list(range(rows[0], rows[0] + len(rows))), "forward rows must be contiguous"
    for r in batch.forward:
        kv.owner[r.row] = r.rid
    for src, dst, _ in batch.copies:
        kv.owner[dst] = kv.owner[src]
    for r, i in zip(batch.samplers, batch.logit_index, strict=True):
        lead = batch.forward[i]
        assert r is lead or (r.group == lead.group and kv.owner[r.row] == lead.rid)
        if r is not lead:
            kv.owner[r.row] = r.rid  # from now on the sibling's own tokens
    assert all(r.output_ids for r in batch.forward[: batch.decodes])  # running: decoding
    assert not any(r.output_ids for r in batch.prefilling)
    n = len(batch.samplers)
    return sched.postprocess(batch, Sampled([token] * n, [0.0] * n, None), "v")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 10), st.integers(1, 3)),
        st.tuples(st.just("step"), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, budget=st.integers(4, 40), mixed=st.sampled_from([0, 4, MAX_LEN]))
def test_random_schedules_keep_invariants(ops, budget: int, mixed: int) -> None:
    kv = FakeKV()
    sched = Scheduler(ROWS, MAX_LEN, budget, frozenset({EOS}), kv.move, mixed=mixed)
    finished: dict[str, int] = {}
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, plen, max_new, n = op
            rid = f"r{len(added)}"
            params = SamplingParams(max_new_tokens=max_new, n=n)
            for i in range(n):
                sub = rid if n == 1 else f"{rid}#{i}"
                sched.add(Request(sub, [1] * plen, params, None, group=rid if n > 1 else None))
                added.append(sub)
        elif op[0] == "step":
            for out in run_batch(sched, kv, token=EOS if op[1] == 0 else 5):
                if out.finished:
                    finished[out.rid] = finished.get(out.rid, 0) + 1
        elif added:
            rid = added[op[1] % len(added)]
            out = sched.abort(rid, "v")
            if out is not None:
                finished[rid] = finished.get(rid, 0) + 1
        # invariants after every operation
        assert [r.row for r in sched.running] == list(range(len(sched.running)))
        assert len(sched.running) <= ROWS
        assert all(r.status is Status.RUNNING for r in sched.running)
        assert all(r.status is Status.WAITING and r.row == -1 for r in sched.waiting)
        assert all(kv.owner[r.row] == r.rid for r in sched.running if r.output_ids)
        assert all(r.num_tokens <= MAX_LEN for r in sched.running)
    while sched.has_work():
        for out in run_batch(sched, kv, token=5):
            if out.finished:
                finished[out.rid] = finished.get(out.rid, 0) + 1
    assert sorted(finished) == sorted(added), "every request ends"
    assert all(v == 1 for v in finished.values()), "and ends exactly once"


def test_prefill_budget_and_rows_bound_admission() -> None:
    kv = FakeKV()
    sched = Scheduler(ROWS, MAX_LEN, 10, frozenset({EOS}), kv.move)
    for i in range(6):
        sched.add(Request(f"r{i}", [1] * 4, SamplingParams(max_new_tokens=3), None))
    first = sched.schedule()
    assert first is not None and first.is_prefill and len(first.forward) == 2  # 3 * 4 > 10
    sched.postprocess(first, Sampled([5, 5], [0.0, 0.0], None), "v")
    second = sched.schedule()
    assert second is not None and second.is_prefill and len(second.forward) == 2
    sched.postprocess(second, Sampled([5, 5], [0.0, 0.0], None), "v")
    third = sched.schedule()  # rows are full: decode the 4 running
    assert third is not None and not third.is_prefill and len(third.forward) == ROWS


def test_siblings_share_one_prefill_even_when_interleaved() -> None:
    kv = FakeKV()
    sched = Scheduler(ROWS, MAX_LEN, 100, frozenset({EOS}), kv.move)
    p2 = SamplingParams(max_new_tokens=3, n=2)
    sched.add(Request("a#0", [1, 2, 3], p2, None, group="a"))
    sched.add(Request("b", [4, 5], SamplingParams(max_new_tokens=3), None))
    sched.add(Request("a#1", [1, 2, 3], p2, None, group="a"))
    batch = sched.schedule()
    assert batch is not None
    assert [r.rid for r in batch.forward] == ["a#0", "b"]
    assert [r.rid for r in batch.samplers] == ["a#0", "b", "a#1"]
    assert batch.logit_index == [0, 1, 0]
    assert batch.copies == [(0, 2, 3)]
    assert batch.samplers[2].cached_tokens == 3


def test_multi_token_steps_stop_at_the_first_finishing_token() -> None:
    """A speculative step emits several tokens; stop rules apply token by token and drop
    whatever follows the finishing one."""
    from tlt_serve.engine.scheduler import Emitted

    kv = FakeKV()
    sched = Scheduler(ROWS, MAX_LEN, 100, frozenset({EOS}), kv.move)
    sched.add(Request("eos", [1, 2], SamplingParams(max_new_tokens=10), None))
    stop7 = SamplingParams(max_new_tokens=10, stop_token_ids=[7])
    sched.add(Request("stop_id", [1, 2], stop7, None))
    sched.add(Request("len", [1, 2], SamplingParams(max_new_tokens=3), None))
    sched.add(Request("free", [1, 2], SamplingParams(max_new_tokens=10), None))
    first = sched.schedule()
    assert first is not None
    for r in first.forward:
        kv.owner[r.row] = r.rid
    sched.postprocess(first, Sampled([5] * 4, [0.0] * 4, None), "v")
    batch = sched.schedule()
    assert batch is not None and not batch.is_prefill
    emitted = Emitted(
        token_ids=[[5, EOS, 6], [7, 8], [5, 5, 5], [5, 6, 8]],
        logprobs=[[-0.1, -0.2, -0.3], [-0.4, -0.5], [-0.6, -0.7, -0.8], [-1.0, -1.1, -1.2]],
        top_logprobs=None,
    )
    outs = {o.rid: o for o in sched.postprocess(batch, emitted, "v")}
    assert outs["eos"].token_ids == [5, EOS] and outs["eos"].finish.matched == EOS
    assert outs["eos"].logprobs == [-0.1, -0.2]
    assert outs["stop_id"].token_ids == [7] and outs["stop_id"].finish.matched == 7
    assert outs["len"].token_ids == [5, 5] and outs["len"].finish.type == "length"
    assert outs["free"].token_ids == [5, 6, 8] and outs["free"].finish is None
    assert [r.rid for r in sched.running] == ["free"]
    assert sched.running[0].num_tokens == 2 + 1 + 3 and sched.running[0].row == 0
    assert kv.owner[0] == "free"  # its KV row was moved into the first hole
