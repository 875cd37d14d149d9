"""A CPU-sized task with verifiable rewards and naturally long-tailed response lengths.

"Start with 7. Add 5, then multiply by 3, then subtract 4. What number do you end with?"
The number of operations is drawn from a geometric distribution (capped), so most problems
are short and a few are long: the response of a model that works step by step is as long as
the chain, which gives rollouts the long tail RL sees. The reward checks the final
``Answer: N`` line against the exact result.

``solution(problem, style)`` writes a worked answer in one of a few styles; fine-tuning a model
on one style after another gives successive target versions whose outputs really drift
(``python -m benchmarks.adaptation drift``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPS = ("+", "-", "*")
WORDS = {"+": "add", "-": "subtract", "*": "multiply by"}
STYLES = 4
ANSWER = re.compile(r"Answer:\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    start: int
    ops: tuple[tuple[str, int], ...]  # (operator, operand) applied left to right

    @property
    def prompt(self) -> str:
        steps = ", then ".join(f"{WORDS[op]} {n}" for op, n in self.ops)
        steps = steps[0].upper() + steps[1:]
        return (
            f"Start with {self.start}. {steps}. What number do you end with? "
            "Work it out step by step and finish with 'Answer: <number>'."
        )

    def values(self) -> list[int]:
        """The running value after each operation."""
        out, v = [], self.start
        for op, n in self.ops:
            v = v + n if op == "+" else v - n if op == "-" else v * n
            out.append(v)
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]


def make_problem(rng: random.Random, mean_ops: float = 3.0, max_ops: int = 16) -> Problem:
    """A chain of operations; its length is geometric with mean ``mean_ops`` (capped)."""
    n = 1
    while n < max_ops and rng.random() > 1.0 / mean_ops:
        n += 1
    start = v = rng.randint(1, 20)
    ops = []
    for _ in range(n):
        op = rng.choice(OPS if abs(v) < 200 else OPS[:2])  # keeps the numbers short
        k = rng.randint(2, 5) if op == "*" else rng.randint(1, 20)
        v = v + k if op == "+" else v - k if op == "-" else v * k
        ops.append((op, k))
    return Problem(start, tuple(ops))


def make_problems(n: int, seed: int, mean_ops: float = 3.0, max_ops: int = 16) -> list[Problem]:
    rng = random.Random(seed)
    return [make_problem(rng, mean_ops, max_ops) for _ in range(n)]


def solution(p: Problem, style: int) -> str:
    """A correct worked answer in style ``style`` (0 .. STYLES-1)."""
    vals = p.values()
    prev = [p.start, *vals[:-1]]
    rows = list(zip(p.ops, prev, vals, strict=True))
    if style == 0:
        lines = [f"{a} {op} {n} = {v}" for (op, n), a, v in rows]
    elif style == 1:
        lines = [f"Step {i + 1}: {_phrase(op, a, n)} gives {v}." for i, ((op, n), a, v)
                 in enumerate(rows)]
    elif style == 2:
        said = " ".join(f"After we {WORDS[op]} {n}, we have {v}." for (op, n), _, v in rows)
        lines = [f"We begin at {p.start}. {said} So the final number is {vals[-1]}."]
    elif style == 3:
        lines = ["Let me keep a running total.", f"- start: {p.start}"]
        lines += [f"- {WORDS[op]} {n}: {v}" for (op, n), _, v in rows]
    else:
        raise ValueError(f"style: must be in [0, {STYLES}), got {style}")
    return "\n".join([*lines, f"Answer: {vals[-1]}"])


def _phrase(op: str, a: int, n: int) -> str:
    if op == "+":
        return f"adding {n} to {a}"
    if op == "-":
        return f"subtracting {n} from {a}"
    return f"multiplying {a} by {n}"


def prompt_ids(tokenizer: Any, problems: Sequence[Problem]) -> list[list[int]]:
    """Each problem as a one-turn chat prompt (token ids, assistant turn opened)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}])
            for p in problems]


def reward(p: Problem, text: str) -> float:
    """1.0 when the last ``Answer: N`` in ``text`` is the exact result, else 0.0."""
    found = ANSWER.findall(text)
    return 1.0 if found and int(found[-1]) == p.answer else 0.0
