"""``trellis.engine.rollout.rewards:math_verify``: math answers checked with Hugging Face's ``math-verify``
(``pip install math-verify``), the checker TRL and verl use: LaTeX, fractions, sets, intervals and
plain numbers compare by meaning (``\\frac{1}{2}`` == ``0.5``, ``1,000`` == ``1000``).

GSM8K's format is read on both sides: a label's answer is what follows its last ``####``, and so is a
response's when it has one; otherwise the response's last ``\\boxed{}`` or expression is its answer.
"""

from __future__ import annotations

from typing import Any

from math_verify import parse, verify

GSM8K_MARK = "####"


def math_verify(sample: dict[str, Any]) -> dict[str, Any]:
    """1.0 iff the response's final answer equals the label's by math-verify; ``extracted``: the answer read."""
    gold = parse(_final_part(str(sample["label"])))
    if not gold:
        raise ValueError(f"math_verify: no answer could be read from the label {str(sample['label'])[-80:]!r}")
    answer = parse(_final_part(str(sample["response"])))
    correct = bool(answer) and verify(gold, answer)
    return {"score": 1.0 if correct else 0.0, "extracted": str(answer[-1]) if answer else ""}


def _final_part(text: str) -> str:
    return text.rsplit(GSM8K_MARK, 1)[-1].strip() if GSM8K_MARK in text else text
