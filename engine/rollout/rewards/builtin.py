"""The built-in reward functions, named in configs as ``trellis.engine.rollout.rewards:exact_match`` and
``trellis.engine.rollout.rewards:math_answer``."""

from __future__ import annotations

import math
import re
from typing import Any


def exact_match(sample: dict[str, Any]) -> float:
    """1.0 iff the stripped response equals the stripped label."""
    return 1.0 if str(sample["response"]).strip() == str(sample["label"]).strip() else 0.0


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def math_answer(sample: dict[str, Any]) -> dict[str, Any]:
    """Verify a math answer: the last ``\\boxed{...}`` (else the last number) against the label.

    Numbers compare by value (``1,000`` == ``1000.0``, ``3/4`` == ``0.75``); other answers compare
    as whitespace-free strings.
    """
    response = str(sample["response"])
    boxed = _BOXED.findall(response)
    if boxed:
        answer = boxed[-1]
    else:
        numbers = _NUMBER.findall(response)
        answer = numbers[-1] if numbers else ""
    correct = _same_answer(answer, str(sample["label"]))
    return {"score": 1.0 if correct else 0.0, "extracted": answer}


def _same_answer(answer: str, label: str) -> bool:
    left, right = _as_number(answer), _as_number(label)
    if left is not None and right is not None:
        return math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-9)
    return "".join(answer.split()) == "".join(label.split()) != ""


def _as_number(text: str) -> float | None:
    text = text.strip().replace(",", "").removeprefix("$").removesuffix("$")
    try:
        if "/" in text:
            numerator, denominator = text.split("/", 1)
            return float(numerator) / float(denominator)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None
