"""Reward shaping applied to training samples after the reward function: DAPO's soft overlong
punishment, which lets the policy feel its length budget before it hits it."""

from __future__ import annotations


def overlong_penalty(length: int, budget: int, buffer_len: int, factor: float) -> float:
    """0 up to ``budget - buffer_len`` tokens, then falling linearly to ``-factor`` at ``budget``."""
    if buffer_len <= 0:
        return 0.0
    excess = length - (budget - buffer_len)
    return -factor * min(max(excess, 0), buffer_len) / buffer_len
