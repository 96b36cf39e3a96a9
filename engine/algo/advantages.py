"""Outcome advantage estimators, as plain torch functions.

Shapes: ``G`` samples (sessions) of one prompt; ``rewards_G`` one scalar reward each, ``lengths_G``
each session's generated tokens (OPO). Batch-level estimators (REINFORCE++) take ``rewards_NG`` for N
groups. Every function returns one advantage per sample; data preparation broadcasts it to the
sample's response tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from trellis.engine.config import AdvantageConfig


def grpo(rewards_G: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean) / (std + eps), std unbiased over the group (DeepSeekMath); zeros for a lone sample."""
    if rewards_G.numel() < 2:
        return torch.zeros_like(rewards_G)
    return (rewards_G - rewards_G.mean()) / (rewards_G.std(unbiased=True) + eps)


def dr_grpo(rewards_G: torch.Tensor) -> torch.Tensor:
    """r - mean: Dr. GRPO drops the std normalisation that favours too easy / too hard groups."""
    return rewards_G - rewards_G.mean()


def rloo(rewards_G: torch.Tensor) -> torch.Tensor:
    """r_i - mean of the other G-1 rewards (leave-one-out baseline)."""
    count = rewards_G.numel()
    if count < 2:
        return torch.zeros_like(rewards_G)
    return (rewards_G * count - rewards_G.sum()) / (count - 1)


def reinforce_pp_baseline(rewards_NG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with baseline: subtract the group mean, then whiten over the whole batch.

    Whitening is over samples (each sample weighs one), since an outcome reward is constant over a
    sample's tokens.
    """
    centred_NG = rewards_NG - rewards_NG.mean(dim=-1, keepdim=True)
    flat = centred_NG.flatten()
    std = flat.std(unbiased=True) if flat.numel() > 1 else flat.new_tensor(0.0)
    return (centred_NG - flat.mean()) / (std + eps)


def opo(rewards_G: torch.Tensor, lengths_G: torch.Tensor) -> torch.Tensor:
    """r - b with the length-weighted baseline b = sum(l r) / sum(l) (OPO, Hao et al. 2025: the
    baseline that minimises the gradient variance when a sequence's gradient norm grows with its length)."""
    weights_G = lengths_G.to(rewards_G.dtype)
    total = weights_G.sum()
    if total <= 0:
        return torch.zeros_like(rewards_G)
    return rewards_G - (weights_G * rewards_G).sum() / total


def pass_at_k(rewards_G: torch.Tensor, k: int, threshold: float = 0.5) -> torch.Tensor:
    """Pass@k training advantages (Chen et al., 2025), in closed form over a group of binary outcomes.

    With c correct of G samples: group pass@k R = 1 - C(G-c, k) / C(G, k) and std s = sqrt(R (1 - R)).
    Correct samples get (1 - R) / s; incorrect ones (1 - R - C(G-c-1, k-1) / C(G-1, k-1)) / s.
    A group that is all right or all wrong has s = 0 and gets zero advantages.
    """
    correct_G = rewards_G > threshold
    group, right = rewards_G.numel(), int(correct_G.sum())
    if not 1 <= k <= group:
        raise ValueError(f"pass@k needs 1 <= k <= group size, got k={k} for {group} samples.")
    mean = 1.0 - math.comb(group - right, k) / math.comb(group, k)
    std = math.sqrt(mean * (1.0 - mean))
    if std == 0.0:
        return torch.zeros_like(rewards_G)
    wrong_advantage = (1.0 - mean - math.comb(group - right - 1, k - 1) / math.comb(group - 1, k - 1)) / std
    right_advantage = (1.0 - mean) / std
    return torch.where(correct_G, right_advantage, wrong_advantage).to(rewards_G.dtype)


Rewards = list[torch.Tensor]  # one tensor of session rewards per group


def _whitened_over_batch(rewards_NG: Rewards, config: AdvantageConfig, lengths_NG: Rewards | None) -> Rewards:
    lengths = [r.numel() for r in rewards_NG]
    if len(set(lengths)) == 1:
        return list(reinforce_pp_baseline(torch.stack(rewards_NG)).unbind(0))
    centred = torch.cat([r - r.mean() for r in rewards_NG])
    whitened = (centred - centred.mean()) / (centred.std(unbiased=True) + 1e-6)
    return list(whitened.split(lengths))


def _opo_groups(rewards_NG: Rewards, config: AdvantageConfig, lengths_NG: Rewards | None) -> Rewards:
    if lengths_NG is None:
        raise ValueError("The OPO estimator needs the sessions' response lengths.")
    return [opo(r, lengths) for r, lengths in zip(rewards_NG, lengths_NG)]


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``advantages(rewards_NG, config, lengths_NG)`` gives one advantage per
    session of each group; a ``whole_batch`` one needs every group of the batch at once."""

    advantages: Callable[[Rewards, AdvantageConfig, Rewards | None], Rewards]
    whole_batch: bool = False


# The names are advantage.estimator's choices (a test holds the two together).
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(lambda rewards_NG, config, _: [grpo(r, config.eps) for r in rewards_NG]),
    "drgrpo": Estimator(lambda rewards_NG, config, _: [dr_grpo(r) for r in rewards_NG]),
    "rloo": Estimator(lambda rewards_NG, config, _: [rloo(r) for r in rewards_NG]),
    "pass_at_k": Estimator(
        lambda rewards_NG, config, _: [pass_at_k(r, config.pass_at_k, config.correct_threshold) for r in rewards_NG]
    ),
    "opo": Estimator(_opo_groups),
    "reinforce_pp": Estimator(_whitened_over_batch, whole_batch=True),
}


def estimator(name: str) -> Estimator:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"Unknown advantage estimator {name!r}; trellis has {', '.join(sorted(ESTIMATORS))}.") from None


def compute_group_advantages(rewards_NG: Rewards, config: AdvantageConfig, lengths_NG: Rewards | None = None) -> Rewards:
    """One advantage per session for each of N groups (groups may differ in size); ``lengths_NG``,
    the sessions' generated tokens, only OPO needs."""
    return estimator(config.estimator).advantages(rewards_NG, config, lengths_NG)
