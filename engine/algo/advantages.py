"""Outcome advantage estimators, as plain torch functions.

Shapes: ``G`` samples (sessions) of one prompt; ``rewards_G`` one scalar reward each, ``lengths_G``
each session's generated tokens (OPO). Batch-level estimators (REINFORCE++) take ``rewards_NG`` for N
groups. Every function returns one advantage per sample; data preparation broadcasts it to the
sample's response tokens.
"""

from __future__ import annotations

import math

import torch

from engine.config import AdvantageConfig


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


def compute_group_advantages(
    rewards_NG: list[torch.Tensor], config: AdvantageConfig, lengths_NG: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """One advantage per session for each of N groups (groups may differ in size); ``lengths_NG``,
    the sessions' generated tokens, only OPO needs."""
    if config.estimator == "reinforce_pp":
        lengths = [r.numel() for r in rewards_NG]
        if len(set(lengths)) == 1:
            return list(reinforce_pp_baseline(torch.stack(rewards_NG)).unbind(0))
        centred = torch.cat([r - r.mean() for r in rewards_NG])
        whitened = (centred - centred.mean()) / (centred.std(unbiased=True) + 1e-6)
        return list(whitened.split(lengths))
    if config.estimator == "grpo":
        return [grpo(r, config.eps) for r in rewards_NG]
    if config.estimator == "drgrpo":
        return [dr_grpo(r) for r in rewards_NG]
    if config.estimator == "rloo":
        return [rloo(r) for r in rewards_NG]
    if config.estimator == "opo":
        if lengths_NG is None:
            raise ValueError("The OPO estimator needs the sessions' response lengths.")
        return [opo(r, lengths) for r, lengths in zip(rewards_NG, lengths_NG)]
    return [pass_at_k(r, config.pass_at_k, config.correct_threshold) for r in rewards_NG]
