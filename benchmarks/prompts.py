"""A small, varied built-in prompt set (chat, reasoning, code) for benchmarks. No downloads."""

from __future__ import annotations

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
ALL = CHAT + REASONING + CODE


def chat_messages(i: int) -> list[dict[str, str]]:
    """The i-th prompt (cycling) as a one-turn chat."""
    return [{"role": "user", "content": ALL[i % len(ALL)]}]
