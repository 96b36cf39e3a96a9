"""The sampler resumes exactly: a restored sampler hands out what the original would have."""

import pytest

from trellis.engine.data.sampler import PromptSampler


def test_resume_continues_the_same_order_across_epochs():
    items = list(range(10))
    original = PromptSampler(items, seed=3)
    original.sample(7)
    state = original.state_dict()
    expected = original.sample(25)  # crosses two epoch boundaries

    resumed = PromptSampler(items, seed=3)
    resumed.load_state_dict(state)
    assert resumed.sample(25) == expected
    assert resumed.epoch == original.epoch == 3


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(list(range(50)), seed=0)
    first, second = sampler.sample(50), sampler.sample(50)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second


def test_seed_changes_the_order_and_shuffle_can_be_off():
    assert PromptSampler(list(range(20)), seed=1).sample(20) != PromptSampler(list(range(20)), seed=2).sample(20)
    assert PromptSampler(list(range(5)), seed=1, shuffle=False).sample(7) == [0, 1, 2, 3, 4, 0, 1]


def test_state_from_another_dataset_is_refused():
    state = PromptSampler(list(range(10)), seed=0).state_dict()
    with pytest.raises(ValueError, match="cannot be resumed"):
        PromptSampler(list(range(11)), seed=0).load_state_dict(state)
