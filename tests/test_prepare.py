"""Data preparation follows the reference's rules: shifted labels, masks, aligned rollout logprobs,
per-session advantages broadcast to segments, invalid groups skipped and counted."""

import math

import pytest

from trellis.engine.config import AdvantageConfig
from trellis.engine.train.packing import pack, to_padded
from trellis.engine.data.prepare import IGNORE, TrainSequence, build_sequence, prepare_train_data
from trellis.engine.data.samples import RolloutSample, Status


def sample(rollout_id, reward, *, session=None, response=(4, 5, 6), mask=None, status=Status.COMPLETED):
    return RolloutSample(
        rollout_id=rollout_id,
        group_id="g",
        session_id=session or rollout_id,
        prompt_index=0,
        messages=[{"role": "user", "content": "x"}],
        prompt_ids=[1, 2, 3],
        label="y",
        data_source="d",
        task_name="t",
        response_ids=list(response),
        logprobs=[-0.1, -0.2, -0.3][: len(response)],
        response="abc" if response else "",
        response_mask=mask,
        status=status,
        reward=reward,
    )


def test_labels_are_shifted_and_logprobs_aligned_with_them():
    seq = build_sequence(sample("a", 1.0), advantage=0.7)
    assert seq.input_ids == [1, 2, 3, 4, 5]  # prompt + response[:-1]
    assert seq.labels == [IGNORE, IGNORE, 4, 5, 6]  # position i predicts token i + 1
    assert seq.rollout_logprobs == [0.0, 0.0, -0.1, -0.2, -0.3]
    assert seq.advantages == [0.0, 0.0, 0.7, 0.7, 0.7]


def test_response_mask_removes_tool_tokens_from_labels_logprobs_and_advantages():
    seq = build_sequence(sample("a", 1.0, mask=[1, 0, 1]), advantage=0.7)
    assert seq.labels == [IGNORE, IGNORE, 4, IGNORE, 6]
    assert seq.rollout_logprobs == [0.0, 0.0, -0.1, 0.0, -0.3]
    assert seq.advantages == [0.0, 0.0, 0.7, 0.0, 0.7]


def test_advantage_is_computed_once_per_session_and_broadcast_to_its_segments():
    # Session A has two segments; GRPO must see rewards [1, 0, 0] (one per session), not [1, 1, 0, 0].
    group = [sample("a1", 1.0, session="A"), sample("a2", 1.0, session="A"), sample("b", 0.0), sample("c", 0.0)]
    batch = prepare_train_data([group], AdvantageConfig(), shuffle=False, seed=0)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = [(2 / 3) / (std + 1e-4)] * 2 + [(-1 / 3) / (std + 1e-4)] * 2
    assert [seq.advantages[-1] for seq in batch.sequences] == pytest.approx(expected, abs=1e-6)
    assert batch.info["rewards/mean"] == pytest.approx(1 / 3)  # per session, not per segment
    assert batch.info["training_samples"] == 4


def test_invalid_groups_are_skipped_and_counted():
    good = [sample("g1", 1.0), sample("g2", 0.0)]
    failed = [sample("f1", None, status=Status.FAILED), sample("f2", 1.0)]
    empty = [sample("e1", 1.0, response=()), sample("e2", 0.0)]
    aborted = [sample("x1", 1.0, status=Status.ABORTED), sample("x2", 0.0)]
    batch = prepare_train_data([good, failed, empty, aborted], AdvantageConfig(), shuffle=False, seed=0)
    assert [seq.rollout_id for seq in batch.sequences] == ["g1", "g2"]
    assert batch.info["skipped_groups"] == 3
    assert batch.info["raw_rewards/mean"] == pytest.approx((1 + 0 + 1 + 1 + 0 + 1 + 0) / 7)


def test_response_metrics_follow_the_reference_names():
    batch = prepare_train_data([[sample("a", 1.0), sample("b", 0.0, response=(4, 5))]], AdvantageConfig(), shuffle=False, seed=0)
    info = batch.info
    assert info["response_len/mean"] == 2.5 and info["response_len/max"] == 3 and info["response_len/min"] == 2
    assert info["prompt_len/mean"] == 3
    assert info["training_tokens"] == 5 + 4
    for key in ("rewards/max", "rewards/min", "advantages/mean", "advantages/min", "advantages/max", "response_len/std"):
        assert key in info


def test_shuffle_is_seeded_and_off_when_deterministic():
    groups = [[sample(f"{g}-{k}", float(k % 2)) for k in range(4)] for g in range(4)]
    ordered = [s.rollout_id for s in prepare_train_data(groups, AdvantageConfig(), shuffle=False, seed=0).sequences]
    assert ordered == [f"{g}-{k}" for g in range(4) for k in range(4)]
    first = [s.rollout_id for s in prepare_train_data(groups, AdvantageConfig(), shuffle=True, seed=5).sequences]
    again = [s.rollout_id for s in prepare_train_data(groups, AdvantageConfig(), shuffle=True, seed=5).sequences]
    assert first == again != ordered


def test_packing_respects_the_token_budget_and_keeps_every_sequence():
    sequences = [build_sequence(sample(str(i), 1.0), 1.0) for i in range(7)]  # 5 tokens each
    packs = pack(sequences, pack_max_length=12)
    assert packs == [[0, 1], [2, 3], [4, 5], [6]]
    micro = to_padded(sequences, packs[0], pad_id=0)
    assert micro.input_ids_NL.shape == (2, 5) and int(micro.loss_mask_NL.sum()) == 6
    with pytest.raises(ValueError, match="exceeds pack_max_length=4"):
        pack(sequences, pack_max_length=4)


def test_dense_packing_fills_fewer_micro_batches_than_packing_in_order():
    """Lengths 4, 6, 4, 2 in budgets of 8: in order they need three micro-batches, sorted two."""
    sequences = [TrainSequence([1] * n, [IGNORE] * n, [0.0] * n, [0.0] * n, prompt_length=1) for n in (4, 6, 4, 2)]
    assert pack(sequences, pack_max_length=8) == [[0], [1], [2, 3]]
    for fill in ("tightest", "even"):
        assert pack(sequences, pack_max_length=8, fill=fill) == [[1, 3], [0, 2]]
        with pytest.raises(ValueError, match="exceeds pack_max_length=5"):
            pack(sequences, pack_max_length=5, fill=fill)


def test_even_packing_spreads_the_tokens_over_first_fit_decreasings_count():
    """256 GRPO-like sequences of 191-383 tokens (73,221 in all) in budgets of 8000: first-fit decreasing
    fills nine and leaves 1,956 tokens to a tenth, a length a compiled layer recompiles for; packed rows
    (``even``) take the tokens evenly over the ten instead, while padded rows (``tightest``) keep like
    lengths together. Where spreading evenly would overflow a micro-batch, first-fit decreasing's packs."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(191, 383) for _ in range(256)]
    sequences = [TrainSequence([1] * n, [IGNORE] * n, [0.0] * n, [0.0] * n, prompt_length=1) for n in lengths]
    tight = [sum(lengths[i] for i in indices) for indices in pack(sequences, pack_max_length=8000, fill="tightest")]
    assert len(tight) == 10 and min(tight) == 1956
    packs = pack(sequences, pack_max_length=8000, fill="even")
    loads = [sum(lengths[i] for i in indices) for indices in packs]
    assert len(packs) == math.ceil(sum(lengths) / 8000) == 10
    assert sorted(i for indices in packs for i in indices) == list(range(256))
    assert max(loads) <= 8000 and min(loads) >= sum(lengths) // 10 - max(lengths)

    uneven = [TrainSequence([1] * n, [IGNORE] * n, [0.0] * n, [0.0] * n, prompt_length=1) for n in (4, 3, 3, 3, 3, 2, 2)]
    assert pack(uneven, pack_max_length=10, fill="even") == [[0, 1, 2], [3, 4, 5, 6]]
