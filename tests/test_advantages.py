"""Advantage estimators against values computed by hand on fixed tensors (tolerance 1e-6)."""

import math

import pytest
import torch

from trellis.engine.algo.advantages import compute_group_advantages, dr_grpo, grpo, pass_at_k, reinforce_pp_baseline, rloo
from trellis.engine.config import AdvantageConfig

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)


def test_grpo_is_group_zscore_with_unbiased_std():
    std = math.sqrt((4 * 0.25) / 3)  # unbiased: divide by G - 1
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4)]
    assert grpo(REWARDS, eps=1e-4).tolist() == pytest.approx(expected, abs=1e-6)


def test_grpo_gives_zero_when_every_sample_scores_the_same():
    assert grpo(torch.ones(8)).abs().max().item() == 0.0


def test_dr_grpo_only_centres():
    assert dr_grpo(REWARDS).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5], abs=1e-6)


def test_rloo_subtracts_mean_of_the_others():
    # sample 0: 1 - (0 + 0 + 1) / 3; sample 1: 0 - (1 + 0 + 1) / 3
    assert rloo(REWARDS).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-6)


def test_reinforce_pp_whitens_group_centred_rewards_over_the_batch():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    std = math.sqrt((0.25 + 0.25) / 3)  # centred values .5, -.5, 0, 0; mean 0
    expected = [[0.5 / (std + 1e-6), -0.5 / (std + 1e-6)], [0.0, 0.0]]
    assert reinforce_pp_baseline(rewards).tolist()[0] == pytest.approx(expected[0], abs=1e-6)
    assert reinforce_pp_baseline(rewards).tolist()[1] == pytest.approx(expected[1], abs=1e-6)


def test_pass_at_k_closed_form():
    # G=4, one correct, k=2: R = 1 - C(3,2)/C(4,2) = 0.5, std 0.5
    # correct: (1 - .5) / .5 = 1; wrong: (1 - .5 - C(2,1)/C(3,1)) / .5 = -1/3
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert pass_at_k(rewards, k=2).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-6)
    assert pass_at_k(torch.zeros(4), k=2).abs().max().item() == 0.0


def test_pass_at_k_rejects_k_larger_than_group():
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(torch.zeros(4), k=5)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce_pp", "pass_at_k"])
def test_every_estimator_gives_one_advantage_per_sample(estimator):
    config = AdvantageConfig(estimator=estimator, pass_at_k=2)
    groups = [torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 1.0])]
    out = compute_group_advantages(groups, config)
    assert [a.shape for a in out] == [torch.Size([4]), torch.Size([4])]
    assert all(torch.isfinite(a).all() for a in out)
