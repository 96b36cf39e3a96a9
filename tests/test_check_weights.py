"""check_weights: after a weight sync, the rollout serves the trainer's weights, or the step fails and
says which tensors differ. The fingerprint (a few sums per tensor) sees a changed value and a
permutation, and forgives a 16-bit copy its rounding."""

from __future__ import annotations

import pytest
import torch

from trellis.engine.run.local import LocalRun
from trellis.engine.run.plan import plan_step
from trellis.engine.weights.fingerprint import WeightMismatchError, fingerprint, largest_difference
from helpers import tiny_config


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=generator), "a.bias": torch.randn(32, generator=generator)}


def test_equal_weights_agree_and_a_bf16_copy_is_forgiven_its_rounding():
    trainer = fingerprint(weights())
    assert largest_difference(trainer, fingerprint(weights()), engine="engine 0") == 0.0
    half = fingerprint({name: tensor.to(torch.bfloat16) for name, tensor in weights().items()})
    assert 0.0 < largest_difference(trainer, half, engine="engine 0") < 2.0**-7


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda w: w["a.bias"].add_(1e-3), "a.bias (relative difference"),
        (lambda w: w.__setitem__("a.weight", w["a.weight"].flip(0)), "a.weight (relative difference"),  # same values, moved
        (lambda w: w.pop("a.bias"), "a.bias (missing on the rollout)"),
        (lambda w: w.__setitem__("a.bias", torch.zeros(31)), "a.bias (another size)"),
    ],
    ids=["value", "permutation", "missing", "size"],
)
def test_a_difference_fails_naming_the_tensor(change, named):
    served = weights()
    change(served)
    with pytest.raises(WeightMismatchError, match="rollout engine 1 serves other weights") as error:
        largest_difference(fingerprint(weights()), fingerprint(served), engine="rollout engine 1")
    assert named in str(error.value)


def test_the_check_falls_on_every_nth_sync(tiny_model, reverse_data, tmp_path):
    config = tiny_config(tiny_model, reverse_data, tmp_path, total_train_steps=8, sync_weights_interval=2,
                         checkpoint_interval=-1, check_weights_interval=2)
    with LocalRun(config, track=False) as run:
        due = [step for step in range(1, 9) if plan_step(config, run.plan, step).check_weights]
        synced = [step for step in range(1, 9) if plan_step(config, run.plan, step).sync_weights]
    assert synced == [2, 4, 6, 8] and due == [4, 8]


def test_a_sync_that_did_not_reach_the_rollout_fails_the_step(tiny_model, reverse_data, tmp_path):
    """Tried: the weight sync skipped (as a transport that silently dropped the weights would). The
    trainer trained, the rollout kept the initial weights: check_weights fails the step."""
    config = tiny_config(tiny_model, reverse_data, tmp_path, total_train_steps=1, checkpoint_interval=-1, check_weights_interval=1)
    with LocalRun(config, track=False) as run:
        run.workers.sync_weights = lambda policy_version: {}  # nothing synced, nothing attested
        with pytest.raises(WeightMismatchError, match="rollout engine 0 serves other weights than the trainer's"):
            run.train_step()
