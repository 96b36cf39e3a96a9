"""Scoring samples: reward functions run in worker processes (``runner``), the built-in ones
(``builtin``) and reward shaping.

The built-in reward functions are named in configs as ``engine.rollout.rewards:exact_match`` and
``engine.rollout.rewards:math_answer``, so they are importable from here."""

from engine.rollout.rewards.builtin import exact_match, math_answer

__all__ = ["exact_match", "math_answer"]
