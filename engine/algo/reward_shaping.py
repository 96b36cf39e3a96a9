"""Reward shaping applied to training samples after the reward function: DAPO's soft overlong
punishment, which lets the policy feel its length budget before it hits it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import TrellisConfig
from engine.data.samples import RolloutSample


def overlong_penalty(length: int, budget: int, buffer_len: int, factor: float) -> float:
    """0 up to ``budget - buffer_len`` tokens, then falling linearly to ``-factor`` at ``budget``."""
    if buffer_len <= 0:
        return 0.0
    excess = length - (budget - buffer_len)
    return -factor * min(max(excess, 0), buffer_len) / buffer_len


@dataclass(frozen=True)
class OverlongShaping:
    max_new_tokens: int  # the run's budget; a prompt may carry a smaller one of its own
    buffer_len: int
    factor: float

    @classmethod
    def of(cls, config: TrellisConfig) -> OverlongShaping | None:
        reward = config.reward
        if reward.overlong_buffer_len == 0:
            return None
        return cls(config.rollout.max_new_tokens, reward.overlong_buffer_len, reward.overlong_penalty_factor)

    def penalty(self, sample: RolloutSample) -> float:
        budget = min(self.max_new_tokens, sample.max_new_tokens or self.max_new_tokens)
        return overlong_penalty(len(sample.response_ids), budget, min(self.buffer_len, budget), self.factor)
