"""Policy losses, KL estimators, aggregation and IS correction against hand-computed values."""

import math

import pytest
import torch

from trellis.engine.config import LossConfig, RolloutISConfig
from trellis.engine.algo.losses import (
    aggregate, kl_penalty, mismatch_sums, policy_objective, ppo_clip_loss, rollout_is_weights, token_logprobs,
)


def _ppo(ratio, advantage, **kwargs):
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64)
    loss, counts = ppo_clip_loss(
        logprobs, torch.zeros_like(logprobs), torch.tensor([[advantage]], dtype=torch.float64), torch.ones(1, 1), **kwargs
    )
    return loss.item(), {k: v.item() for k, v in counts.items()}


def test_ppo_clip_caps_a_positive_advantage_at_one_plus_eps_high():
    loss, counts = _ppo(1.5, 1.0, clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss == pytest.approx(-1.2, abs=1e-6)
    assert counts["clipped_high"] == 1 and counts["clipped_low"] == 0


def test_clip_higher_widens_only_the_upper_bound():
    loss, _ = _ppo(1.5, 1.0, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx(-1.28, abs=1e-6)
    loss, counts = _ppo(0.5, -1.0, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx(0.8, abs=1e-6)  # max(0.5, 0.8): pessimistic bound
    assert counts["clipped_low"] == 1


def test_unclipped_inside_the_trust_region():
    loss, counts = _ppo(1.1, 2.0, clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss == pytest.approx(-2.2, abs=1e-6)
    assert counts == {"clipped_low": 0, "clipped_high": 0}


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    loss, counts = _ppo(5.0, -1.0, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)
    assert loss == pytest.approx(3.0, abs=1e-6)  # without dual clip: max(5.0, 1.2) = 5.0
    assert counts["dual_clipped"] == 1
    loss, _ = _ppo(5.0, -1.0, clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss == pytest.approx(5.0, abs=1e-6)


def test_the_policy_objective_of_a_hand_built_micro_batch_token_by_token():
    """Two sequences of four tokens, old logprobs 0 so the ratio is exp(logprob); eps 0.2 / 0.28, dual
    clip 3. Row 0: inside (1.1, A=1), clipped high (1.5, A=1), clipped low (0.5, A=-1), dual-clipped
    (5.0, A=-1). Row 1: below the range with A>0 (not clipped: the pessimistic bound is the ratio's),
    above it with A<0 (not dual-clipped: 3.0 < 2 x 3), then two masked tokens in clip and dual-clip
    regions, which count nowhere. IS weights 1, 2, 0.5, 1 / 1, 0 (rejected), 1, 1 multiply the loss.
    Tried: the IS weights left out, clip-higher's eps replaced by eps_low, the dual clip applied to
    positive advantages too, the clip counts not masked, and k3 in the other direction: each fails it."""
    ratios = torch.tensor([[1.1, 1.5, 0.5, 5.0], [0.5, 1.5, 2.0, 4.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0], [2.0, -2.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    weights = torch.tensor([[1.0, 2.0, 0.5, 1.0], [1.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    logprobs = ratios.log()
    config = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0, kl_coef=0.1, kl_type="k3")
    loss, kl, counts = policy_objective(
        logprobs, torch.zeros_like(logprobs), advantages, mask, config,
        is_weights_NL=weights, ref_logprobs_NL=logprobs - math.log(2),
    )
    unweighted = [[-1.1, -1.28, 0.8, 3.0], [-1.0, 3.0]]
    assert (loss * mask).tolist()[0] == pytest.approx([u * w for u, w in zip(unweighted[0], [1.0, 2.0, 0.5, 1.0])])
    assert (loss * mask).tolist()[1][:2] == pytest.approx([-1.0, 0.0])
    assert {name: value.item() for name, value in counts.items()} == {"clipped_low": 1.0, "clipped_high": 1.0, "dual_clipped": 1.0}
    assert kl.flatten().tolist() == pytest.approx([0.5 - 1 + math.log(2)] * 8)
    assert aggregate(loss, mask, "token-mean", total_tokens=6, total_sequences=2).item() == pytest.approx(
        (-1.1 - 2.56 + 0.4 + 3.0 - 1.0 + 0.0) / 6
    )


def test_kl_estimators():
    logprobs, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty(logprobs, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-6)
    assert kl_penalty(logprobs, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert kl_penalty(logprobs, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2), abs=1e-6)


LOSS = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3) / 3),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 3 / 1) / 2),
        ("seq-mean-token-sum", ((1 + 2) + 3) / 2),
    ],
)
def test_aggregation_modes(mode, expected):
    assert aggregate(LOSS, MASK, mode, total_tokens=3, total_sequences=2).item() == pytest.approx(expected, abs=1e-6)


def test_aggregation_over_micro_batches_equals_the_whole_batch():
    whole = aggregate(LOSS, MASK, "token-mean", total_tokens=3, total_sequences=2)
    parts = sum(aggregate(LOSS[i : i + 1], MASK[i : i + 1], "token-mean", total_tokens=3, total_sequences=2) for i in range(2))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_token_logprobs_match_log_softmax_and_zero_ignored_labels():
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])
    out = token_logprobs(logits, torch.tensor([[1, -100]]))
    assert out.tolist()[0] == pytest.approx([math.log(0.75), 0.0], abs=1e-6)
    halved = token_logprobs(logits, torch.tensor([[1, -100]]), temperature=2.0)
    assert halved[0, 0].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)


def _is(level, mode, old, rollout):
    old_t = torch.tensor([old], dtype=torch.float64)
    return rollout_is_weights(old_t, torch.zeros_like(old_t), torch.ones_like(old_t), RolloutISConfig(level=level, mode=mode, upper=2.0))


def test_token_is_truncate_and_mask():
    weights, stats = _is("token", "truncate", [math.log(3.0), math.log(0.5)], None)
    assert weights.tolist()[0] == pytest.approx([2.0, 0.5], abs=1e-6)
    assert stats["rejected"].item() == 1
    weights, _ = _is("token", "mask", [math.log(3.0), math.log(0.5)], None)
    assert weights.tolist()[0] == pytest.approx([0.0, 0.5], abs=1e-6)  # 0.5 is the lower bound 1/upper, kept


def test_sequence_is_uses_the_product_of_token_ratios():
    weights, _ = _is("sequence", "truncate", [math.log(3.0), math.log(0.5)], None)
    assert weights.tolist()[0] == pytest.approx([1.5, 1.5], abs=1e-6)


def test_mismatch_is_zero_when_train_and_rollout_agree():
    logprobs = torch.tensor([[-0.5, -1.0]])
    sums = mismatch_sums(logprobs, logprobs.clone(), torch.ones(1, 2))
    assert sums["k3_kl"].item() == 0.0 and sums["abs_logprob_diff_max"].item() == 0.0


def test_mismatch_on_tokens_drawn_in_the_rollout_policys_exact_proportions_gives_the_closed_form_kl():
    """Rollout policy q = (1/2, 1/4, 1/4) over tokens a, b, c; trainer p = (1/4, 1/4, 1/2). Four
    response tokens a, a, b, c are q's exact proportions, so the per-token means are expectations
    under q: k3 must give KL(q || p) = 1/2 ln 2 - 1/4 ln 2 = ln 2 / 4, the rollout NLL q's entropy
    H(q) = 3/2 ln 2, the train NLL the cross-entropy H(q, p) = 7/4 ln 2; |log p - log q| is ln 2, 0, ln 2.
    A masked position with a wild gap must count nowhere. Tried: the k3 of the wrong direction,
    exp(-d) - 1 + d (it gives 0.202, not 0.173), and dropping the mask both fail it."""
    q = {"a": 0.5, "b": 0.25, "c": 0.25}
    p = {"a": 0.25, "b": 0.25, "c": 0.5}
    rows = [["a", "a"], ["b", "c"]]
    train = torch.tensor([[math.log(p[t]) for t in row] + [-0.01] for row in rows])
    rollout = torch.tensor([[math.log(q[t]) for t in row] + [-9.0] for row in rows])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    sums = {name: value.item() for name, value in mismatch_sums(train, rollout, mask).items()}
    tokens = 4
    ln2 = math.log(2)
    assert sums["k3_kl"] / tokens == pytest.approx(sum(q[t] * math.log(q[t] / p[t]) for t in q), abs=1e-6)
    assert sums["k3_kl"] / tokens == pytest.approx(ln2 / 4, abs=1e-6)
    assert sums["abs_logprob_diff"] == pytest.approx(3 * ln2, abs=1e-6)
    assert sums["abs_logprob_diff_max"] == pytest.approx(ln2, abs=1e-6)
    assert sums["rollout_nll"] / tokens == pytest.approx(1.5 * ln2, abs=1e-6)
    assert sums["train_nll"] / tokens == pytest.approx(1.75 * ln2, abs=1e-6)


def _is_with(old: list[list[float]], **settings):
    old_t = torch.tensor(old, dtype=torch.float64)
    return rollout_is_weights(old_t, torch.zeros_like(old_t), torch.ones_like(old_t), RolloutISConfig(**settings))


def test_geometric_is_is_the_geometric_mean_of_the_token_ratios():
    """Ratios 3 and 1/3: the sequence ratio is 1 (product) and so is the geometric mean; 4 and 1: product
    4 (truncated to 2), geometric mean 2."""
    weights, _ = _is_with([[math.log(4.0), 0.0]], level="geometric", mode="truncate", upper=3.0)
    assert weights.tolist()[0] == pytest.approx([2.0, 2.0], abs=1e-9)
    weights, _ = _is_with([[math.log(4.0), 0.0]], level="sequence", mode="truncate", upper=3.0)
    assert weights.tolist()[0] == pytest.approx([3.0, 3.0], abs=1e-9)  # the product, 4, capped at 3


def test_both_mode_and_separate_mask_bounds():
    """Ratios 6, 3, 1, 0.1; truncate at 2, mask outside [0.25, 5]: 6 and 0.1 dropped, 3 capped to 2."""
    ratios = [[math.log(6.0), math.log(3.0), 0.0, math.log(0.1)]]
    weights, stats = _is_with(ratios, level="token", mode="both", upper=2.0, mask_upper=5.0, mask_lower=0.25)
    assert weights.tolist()[0] == pytest.approx([0.0, 2.0, 1.0, 0.0], abs=1e-9) and stats["rejected"].item() == 3
    weights, _ = _is_with(ratios, level="token", mode="mask", upper=2.0, mask_upper=5.0, mask_lower=0.25)
    assert weights.tolist()[0] == pytest.approx([0.0, 3.0, 1.0, 0.0], abs=1e-9)  # kept ratios are not capped in mask mode


def test_a_veto_drops_the_whole_sequence_of_a_catastrophic_token():
    """Two sequences: one token at ratio 1e-5 under the veto 1e-4 drops all of the first; the second stays."""
    weights, stats = _is_with([[0.0, math.log(1e-5)], [math.log(1.5), 0.0]], level="token", mode="truncate", veto_threshold=1e-4)
    assert weights.flatten().tolist() == pytest.approx([0.0, 0.0, 1.5, 1.0], abs=1e-9) and stats["rejected"].item() == 2


def test_dr_grpo_divides_each_sequence_sum_by_the_constant_length():
    """Two sequences, token losses [1, 1, -] and [2, -, -] (- masked), budget 4: (2 + 2) / (2 x 4) = 0.5,
    where token-mean gives 4 / 3 and seq-mean-token-mean (1 + 2) / 2."""
    loss = torch.tensor([[1.0, 1.0, 5.0], [2.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    totals = dict(total_tokens=3.0, total_sequences=2.0)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", **totals, norm_length=4.0).item() == 0.5
    assert aggregate(loss, mask, "token-mean", **totals).item() == pytest.approx(4 / 3)
    assert aggregate(loss, mask, "seq-mean-token-mean", **totals).item() == 1.5
