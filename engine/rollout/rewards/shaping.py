"""A run's overlong shaping (``reward.overlong_buffer_len``), applied to training samples as they are
scored; the penalty itself is ``engine.algo.reward_shaping.overlong_penalty``."""

from __future__ import annotations

from dataclasses import dataclass

from trellis.engine.algo.reward_shaping import overlong_penalty
from trellis.engine.config import TrellisConfig
from trellis.engine.data.samples import RolloutSample


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
