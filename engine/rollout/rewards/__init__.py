"""Scoring samples: reward functions run in worker processes (``runner``), the built-in ones
(``builtin``) and reward shaping.

The built-in reward functions are named in configs as ``trellis.engine.rollout.rewards:exact_match`` and
``trellis.engine.rollout.rewards:math_answer``, so they are importable from here."""

from trellis.engine.rollout.rewards.builtin import exact_match, math_answer

__all__ = ["exact_match", "math_answer"]
