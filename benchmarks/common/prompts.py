"""The benchmark prompt set and its tokenizer.

A varied built-in prompt set (chat, reasoning, code). No downloads. 24 hand-written prompts,
then generated ones (topic, number and task lists that are not the warm-up trainer's, see
trainer/prompts.py), all distinct: a benchmark that gives every sequence its own prompt
measures speculation honestly. With repeated prompts at T=0 the n-gram proposer copies a
sibling's or an earlier run's output, which plain decoding cannot.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.common.load import Requests

CHAT = [
    "Give me three tips for staying focused while working from home.",
    "Write a short, friendly email declining a meeting invitation.",
    "Explain what a hash table is to a ten-year-old.",
    "What are the main differences between a virus and a bacterium?",
    "Suggest a name for a coffee shop that also sells books, and explain why.",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "How do I politely ask my neighbour to turn the music down?",
    "Describe the water cycle.",
]
REASONING = [
    "A train leaves at 3pm travelling 60 km/h. Another leaves the same station at 4pm at "
    "90 km/h. When does the second catch the first? Think step by step.",
    "If 5 machines make 5 widgets in 5 minutes, how long do 100 machines take to make 100 "
    "widgets? Explain your reasoning.",
    "What is 17 * 23? Show your work.",
    "Alice is older than Bob. Bob is older than Carol. Is Carol older than Alice? Explain.",
    "A shop sells pens at 3 for $2. How much do 12 pens cost? Reason carefully.",
    "Solve for x: 3x + 7 = 22. Explain each step.",
    "Is 221 a prime number? Check step by step.",
    "I have 3 apples, eat one, buy five more and give away half. How many do I have?",
]
CODE = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function to compute the n-th Fibonacci number iteratively.",
    "Explain what this does: `sorted(d.items(), key=lambda kv: kv[1], reverse=True)`.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Write a bash one-liner that counts lines in all .py files in a directory tree.",
    "Implement binary search in Python and state its complexity.",
    "What is the difference between a list and a tuple in Python?",
    "Write a JavaScript function that debounces another function.",
]
KINDS = ("chat", "reasoning", "code")
HAND_WRITTEN = CHAT + REASONING + CODE

_SUBJECTS = (
    "how tides work", "why leaves change colour in autumn", "how a bill becomes a law",
    "what a credit score is", "how noise-cancelling headphones work", "why we dream",
    "how bread rises", "what causes earthquakes", "how a bicycle stays upright",
    "how GPS finds your position", "why cats purr", "how solar panels make electricity",
    "what an index fund is", "how the heart pumps blood", "why the moon has phases",
    "how coffee is decaffeinated", "what a mortgage is", "how elections are counted",
    "how rainbows form", "why ice floats", "how antibiotics work", "what jet lag is",
    "how a compiler works", "how bees make honey", "why salt melts ice",
    "how a camera lens focuses", "what a recession is", "how glaciers move",
    "how the stock market works", "why some people are left-handed",
)
_CHAT_FORMS = (
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "What are common misconceptions about {}?",
    "Give me a quick overview of {}.",
    "I have always wondered about {}. Can you help me understand it?",
)
_LANGS = ("Python", "JavaScript", "Go", "C", "Rust", "Java")
_TASKS = (
    "returns the median of a list of numbers", "validates an email address",
    "converts a number to its binary representation",
    "finds all pairs in an array that sum to a target", "parses a CSV line into fields",
    "computes the power set of a set", "reverses a linked list",
    "checks whether a sudoku row is valid", "counts the set bits in an integer",
    "computes the edit distance of two strings", "returns the intersection of two arrays",
    "generates the first n prime numbers", "converts snake_case to camelCase",
    "finds the longest common prefix of some strings",
    "implements a stack with push, pop and peek", "shuffles an array in place",
)


def _reasoning(r: random.Random) -> str:
    a, b, c = r.randint(12, 99), r.randint(3, 40), r.randint(50, 400)
    forms = (
        f"What is {a} * {b}? Show your work.",
        f"Solve for x: {b}x + {a} = {a + b * r.randint(2, 12)}. Explain each step.",
        f"A car travels {c} km in {r.randint(2, 6)} hours. What is its average speed? "
        "Think step by step.",
        f"A jacket costs ${c} and is {r.choice((10, 15, 20, 25, 30))}% off. What is the sale "
        "price? Explain.",
        f"Is {r.randrange(101, 999, 2)} a prime number? Check step by step.",
        f"A recipe for {r.randint(2, 6)} people needs {b} grams of flour. How much flour is "
        f"needed for {r.randint(7, 15)} people? Reason carefully.",
    )
    return r.choice(forms)


def _generated(n: int, seed: int = 1234) -> list[str]:
    """n distinct prompts, chat / reasoning / code in turn (each kind has room for > n/3)."""
    r = random.Random(seed)
    makers = (
        lambda: r.choice(_CHAT_FORMS).format(r.choice(_SUBJECTS)),
        lambda: _reasoning(r),
        lambda: (f"Write a {r.choice(_LANGS)} function that {r.choice(_TASKS)}."
                 + r.choice(("", " Add comments."))),
    )
    seen = set(HAND_WRITTEN)
    out: list[str] = []
    while len(out) < n:
        text = makers[len(out) % 3]()
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


ALL = HAND_WRITTEN + _generated(264)  # 288 distinct prompts


def chat_messages(i: int) -> list[dict[str, str]]:
    """The i-th prompt (cycling after 288; all distinct before) as a one-turn chat."""
    return [{"role": "user", "content": ALL[i % len(ALL)]}]


def kind_of(i: int) -> str:
    """The kind of prompt i: chat, reasoning or code (hand-written by kind; then in turn)."""
    i %= len(ALL)
    for kind, hand in zip(KINDS, (CHAT, REASONING, CODE), strict=True):
        if i < len(hand):
            return kind
        i -= len(hand)
    return KINDS[i % len(KINDS)]


def tokenizer(model: str) -> Any:
    """The tokenizer of ``model`` (a name or a directory)."""
    from tlt_serve.models.provision import resolve_model_path
    from tlt_serve.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(model))


def chat_prompts(tok: Any, first: int, n: int) -> list[list[int]]:
    """Prompts ``first`` .. ``first + n - 1`` of the set as chat-templated token ids."""
    return [tok.apply_chat_template(chat_messages(i)) for i in range(first, first + n)]


def varied_requests(tok: Any, n: int, min_new: int, max_new: int) -> Requests:
    """``n`` chat prompts, greedy, EOS ignored, lengths spread evenly over
    ``min_new`` .. ``max_new`` (so continuous batching matters)."""
    span = max_new - min_new + 1
    params = {"temperature": 0.0, "ignore_eos": True}
    return [(tok.apply_chat_template(chat_messages(i)),
             {**params, "max_new_tokens": min_new + (i * 37) % span}) for i in range(n)]
