"""Scoring samples: reward functions run in worker processes (``runner``), the built-in ones
(``builtin``, ``math_checker``) and reward shaping.

The built-in reward functions are named in configs as ``trellis.engine.rollout.rewards:exact_match``,
``:math_answer`` and ``:math_verify``, so they are importable from here. ``math_verify`` needs the
``math-verify`` package and is imported only when named, so a run without it never needs it."""

from typing import Any

from trellis.engine.rollout.rewards.builtin import exact_match, math_answer

__all__ = ["exact_match", "math_answer", "math_verify"]


def __getattr__(name: str) -> Any:
    if name == "math_verify":
        try:
            from trellis.engine.rollout.rewards.math_checker import math_verify
        except ImportError as error:
            raise ImportError(f"trellis.engine.rollout.rewards:math_verify needs the math-verify package: pip install math-verify ({error})") from error
        return math_verify
    raise AttributeError(name)
