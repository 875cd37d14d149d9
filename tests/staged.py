"""Requests that arrive partway through a generation, driven step by step through an engine:
what the batch-size switch of speculative decoding sees (a lone request, a crowd, the tail)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tlt_serve import SamplingParams
from tlt_serve.engine.engine import Engine


@dataclass
class Staged:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # rid -> generated ids
    running: list[int] = field(default_factory=list)  # sequences running at each step
    speculated: list[bool] = field(default_factory=list)  # did that step verify drafts

    def ids(self, n: int) -> list[list[int]]:
        return [self.tokens[f"r{i}"] for i in range(n)]


def run_staged(
    eng: Engine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    join_at: int = 6,
    max_steps: int = 1000,
) -> Staged:
    """r0 starts alone; r1.. join at step ``join_at``; steps until the engine is idle."""
    out = Staged()
    eng.add_request("r0", list(prompts[0]), params[0])
    for step in range(max_steps):
        if step == join_at:
            for i in range(1, len(prompts)):
                eng.add_request(f"r{i}", list(prompts[i]), params[i])
        before = eng.stats.spec.steps
        out.running.append(len(eng.scheduler.running))
        for o in eng.step():
            out.tokens.setdefault(o.rid, []).extend(o.token_ids)
        out.speculated.append(eng.stats.spec.steps > before)
        if not eng.has_work():
            return out
    raise AssertionError(f"not done after {max_steps} steps")


def assert_never_above(run: Staged, max_batch: int) -> None:
    """A crowd above max_batch ran, and no step of it speculated."""
    crowded = [s for s, n in zip(run.speculated, run.running, strict=True) if n > max_batch]
    assert crowded and not any(crowded), "never speculates above max_batch"


def assert_switched_on_off_on(run: Staged, max_batch: int) -> None:
    """Speculation ran before the crowd joined and again in its tail, never above max_batch."""
    assert_never_above(run, max_batch)
    first_big = next(i for i, n in enumerate(run.running) if n > max_batch)
    last_big = max(i for i, n in enumerate(run.running) if n > max_batch)
    assert any(run.speculated[:first_big]), "speculates while alone"
    assert any(run.speculated[last_big + 1 :]), "speculates again in the tail"
