"""The example's task, in GSM8K's format: a short word problem in ``question``, worked steps and the
final answer after ``####`` in ``answer``. ``Ann has 3 pens and gets 4 more. How many pens?`` ->
``3 + 4 = 7\\n#### 7``."""

from __future__ import annotations

import random

NAMES = ("Ann", "Bo", "Cy", "Di")
THINGS = ("pens", "cups", "hats", "keys")


def make_problem(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    question = f"{name} has {a} {thing} and gets {b} more. How many {thing}?"
    return {"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}


def make_example(rng: random.Random) -> tuple[str, str]:
    """A prompt and the response the tiny model is warmed up towards: the final number alone."""
    problem = make_problem(rng)
    return problem["question"], problem["answer"].rsplit("#### ", 1)[1]


def make_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(count)]
