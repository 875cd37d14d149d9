"""A deterministic prompt set built from templates: chat, reasoning and code, in equal parts.

No downloads: every prompt is a template filled from small word lists (chat, code) or random
numbers (reasoning), drawn from ``random.Random(seed)``. The space holds tens of thousands of
distinct prompts; ``build_prompts`` returns ``n`` distinct ones, interleaved by kind.
"""

from __future__ import annotations

import random
from collections.abc import Callable

KINDS = ("chat", "reasoning", "code")

_TOPICS = (
    "time management",
    "learning a new language",
    "saving money",
    "starting to run",
    "sleeping better",
    "public speaking",
    "cooking for one",
    "moving to a new city",
    "preparing for a job interview",
    "keeping houseplants alive",
    "reducing screen time",
    "writing a novel",
    "learning to play the guitar",
    "working from home",
    "making friends",
    "planning a vegetable garden",
    "studying for exams",
    "negotiating a salary",
    "training a puppy",
    "staying motivated",
    "organising a small kitchen",
    "traveling on a budget",
)
_CONCEPTS = (
    "photosynthesis",
    "inflation",
    "how vaccines work",
    "black holes",
    "the water cycle",
    "compound interest",
    "how the internet routes data",
    "climate change",
    "supply and demand",
    "how airplanes fly",
    "the immune system",
    "machine learning",
    "plate tectonics",
    "how batteries store energy",
    "the French Revolution",
    "DNA replication",
    "blockchains",
    "why the sky is blue",
    "how a refrigerator works",
    "the theory of evolution",
    "how search engines rank pages",
    "the greenhouse effect",
    "recursion in programming",
)
_AUDIENCES = (
    "a ten-year-old",
    "a beginner",
    "a busy manager",
    "a high school student",
    "my grandmother",
)
_EMAILS = (
    "asking my manager for a day off next Friday",
    "thanking a colleague for helping with a project",
    "declining a meeting invitation politely",
    "following up on a job application",
    "apologising to a customer for a late delivery",
    "inviting the team to a farewell lunch",
    "asking a landlord to fix a broken heater",
    "requesting feedback on a presentation",
    "introducing myself to a new client",
    "reminding a friend about money they owe me",
)
_TONES = ("friendly", "formal", "short", "warm but professional")
_PASSAGES = (
    "Regular exercise improves mood, sleep and heart health. Even short daily walks help, "
    "and people who build small habits are more likely to keep exercising for years.",
    "The city council approved a new bike lane network. Supporters say it will cut traffic "
    "and pollution, while some shop owners worry about losing parking spaces.",
    "Honeybees communicate the location of flowers with a waggle dance. The angle of the "
    "dance shows the direction relative to the sun and its length shows the distance.",
    "Remote work grew quickly after 2020. Many employees value the flexibility, but some "
    "companies report that new staff learn more slowly without in-person mentoring.",
    "The library will extend its opening hours during exam season. Study rooms can be booked "
    "online up to a week in advance, and quiet zones will be enforced.",
    "Ocean levels are rising as glaciers melt and warming water expands. Coastal cities are "
    "building sea walls and restoring wetlands to reduce flood damage.",
)
_CHAT_TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    lambda r: f"Can you give me some practical advice on {r.choice(_TOPICS)}?",
    lambda r: f"What are {r.randint(3, 7)} tips for {r.choice(_TOPICS)}?",
    lambda r: f"Explain {r.choice(_CONCEPTS)} to {r.choice(_AUDIENCES)}.",
    lambda r: f"What is {r.choice(_CONCEPTS)}? Please keep it simple.",
    lambda r: f"Write a {r.choice(_TONES)} email {r.choice(_EMAILS)}.",
    lambda r: f"Summarize this in {r.randint(1, 3)} sentences: {r.choice(_PASSAGES)}",
    lambda r: (
        f"Give me a short plan for {r.choice(_TOPICS)} over the next {r.randint(2, 8)} weeks."
    ),
    lambda r: f"What are the pros and cons of {r.choice(_TOPICS)}?",
)

_NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "coins")


def _reasoning(r: random.Random) -> str:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(5, 90), r.randint(2, 40), r.randint(2, 12)
    price, hours = r.randint(2, 25), r.randint(2, 9)
    speed = r.randint(30, 110)
    problems = (
        f"{name} has {a} {item} and buys {b} more, then gives away {c}. How many {item} "
        f"does {name} have now?",
        f"A box holds {c} {item}. How many boxes are needed for {a * c + b % c} {item}?",
        f"{name} buys {c} notebooks at ${price} each and pays with ${c * price + b}. "
        f"How much change does {name} get?",
        f"A train travels at {speed} km/h for {hours} hours. How far does it go?",
        f"What is {a} times {b} plus {c}?",
        f"{name} reads {c} pages a day. How many days to finish a book of {a * c} pages?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"{name} earns ${price} per hour and works {hours} hours a day for {c} days. "
        f"How much does {name} earn?",
    )
    suffix = r.choice(
        ("Think step by step.", "Let's think step by step.", "Show your reasoning.", "")
    )
    return f"{r.choice(problems)} {suffix}".strip()


_CODE_TASKS = (
    "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number",
    "counts the vowels in a string",
    "reverses the words in a sentence",
    "returns the largest element of a list",
    "removes duplicates from a list while keeping the order",
    "checks whether a number is prime",
    "computes the factorial of n",
    "merges two sorted lists into one sorted list",
    "returns the second smallest number in a list",
    "converts a temperature from Celsius to Fahrenheit",
    "counts how often each word appears in a text",
    "flattens a nested list",
    "checks whether two strings are anagrams",
    "computes the average of a list of numbers",
    "finds the greatest common divisor of two integers",
    "capitalizes the first letter of every word",
    "returns all even numbers from a list",
    "sums the digits of an integer",
    "performs binary search on a sorted list",
    "rotates a list by k positions",
    "checks whether parentheses in a string are balanced",
    "returns the longest word in a sentence",
    "converts a Roman numeral to an integer",
    "transposes a matrix given as a list of lists",
    "groups a list of words by their first letter",
    "computes the running sum of a list",
    "checks whether a year is a leap year",
    "finds the most common character in a string",
    "splits a list into chunks of size n",
)
_CODE_STYLES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a docstring.",
    "Write a Python function that {task}, and show an example call.",
    "Implement a function in Python that {task}. Explain how it works briefly.",
    "Write a short Python function that {task}. Add type hints.",
    "How would you write a Python function that {task}?",
)
_CHECKS = (
    "",
    " Handle the empty case.",
    " Keep it under {k} lines.",
    " Do not use imports.",
    " Add a few assert tests.",
    " Use a loop, not recursion.",
    " Make it efficient.",
)


def _code(r: random.Random) -> str:
    text = r.choice(_CODE_STYLES).format(task=r.choice(_CODE_TASKS))
    return text + r.choice(_CHECKS).format(k=r.randint(8, 20))


_CONTEXTS = (
    "",
    "",
    "I am a university student. ",
    "I work long hours. ",
    "I am new to this. ",
    "My friend asked me about this. ",
    "I am retired and have free time. ",
    "Quick question: ",
)
_FORMATS = (
    "",
    "",
    " Use bullet points.",
    " Be concise.",
    " Give an example.",
    " Answer in a friendly tone.",
)


def _chat(r: random.Random) -> str:
    return r.choice(_CONTEXTS) + r.choice(_CHAT_TEMPLATES)(r) + r.choice(_FORMATS)


_MAKERS: dict[str, Callable[[random.Random], str]] = {
    "chat": _chat,
    "reasoning": _reasoning,
    "code": _code,
}


def build_prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct user prompts, kinds interleaved (chat, reasoning, code, chat, ...)."""
    if n < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    for i in range(n):
        make = _MAKERS[KINDS[i % len(KINDS)]]
        for _ in range(1000):
            text = make(rng)
            if text not in seen:
                break
        else:
            raise ValueError(f"num_prompts: cannot build {n} distinct prompts")
        seen.add(text)
        out.append(text)
    return out
