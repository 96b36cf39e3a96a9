"""The training worker really trains: parameters move, options take effect, a step is never applied twice."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config_loading import load_config
from engine.data import load_prompts
from engine.losses import token_logprobs
from engine.packing import to_padded
from engine.prepare import prepare_train_data
from engine.produce import rollout_groups, sampling_params
from engine.rewards import RewardRunner
from engine.rollout.transformers_backend import TransformersRollout
from engine.shared_prefix import to_shared_prefix
from engine.train_worker import StepAlreadyApplied, TrainingWorker, lr_factor


def _config(tiny_model, reverse_data, **changes):
    return load_config(
        None,
        load_from=str(tiny_model),
        train_dataset={"path": str(reverse_data["train"]), "limit": 16, "max_prompt_length": 64},
        total_train_steps=4,
        train_batch_size=8,
        **changes,
    )


@pytest.fixture(scope="module")
def rollout_batch(tiny_model, reverse_data):
    """One real batch: 16 prompts x 8 samples from the tiny model, scored by the task's reward."""
    config = _config(tiny_model, reverse_data)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts, _ = load_prompts(config.train_dataset, tokenizer)
    with RewardRunner(config.reward) as rewards:
        produced = rollout_groups(
            prompts[:16],
            repeat=8,
            backend=TransformersRollout(str(tiny_model), tokenizer),
            rewards=rewards,
            params=sampling_params(config.rollout, seed=0),
            train_step=1,
            id_prefix="t-",
        )
    return produced.groups, tokenizer.pad_token_id


def _fit(config, groups, pad_id, step=1):
    worker = TrainingWorker(config, total_train_steps=4, pad_token_id=pad_id)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    batch = prepare_train_data(groups, config.advantage, shuffle=False, seed=0)
    result = worker.fit(batch, step)
    return worker, before, result


def test_every_parameter_changes_and_metrics_are_reported(tiny_model, reverse_data, rollout_batch):
    groups, pad_id = rollout_batch
    assert any(len({s.reward for s in g}) > 1 for g in groups), "the batch needs a group with signal"
    worker, before, result = _fit(_config(tiny_model, reverse_data), groups, pad_id)
    unchanged = [n for n, p in worker.model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []
    metrics = result.metrics
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(3e-4)
    assert metrics["clipfrac"] == 0.0  # one mini-batch: on-policy, ratio is exactly 1
    assert metrics["mismatch/k3_kl"] < 1e-6  # the trainer sees the rollout's own logprobs
    assert 0 < metrics["entropy"] < 10


def test_a_step_is_never_applied_twice(tiny_model, reverse_data, rollout_batch):
    groups, pad_id = rollout_batch
    config = _config(tiny_model, reverse_data)
    worker, _, _ = _fit(config, groups, pad_id, step=1)
    with pytest.raises(StepAlreadyApplied, match="Step 1 is already applied"):
        worker.fit(prepare_train_data(groups, config.advantage, shuffle=False, seed=0), 1)


def test_several_mini_batches_clip_kl_and_is_correction(tiny_model, reverse_data, rollout_batch):
    groups, pad_id = rollout_batch
    config = _config(
        tiny_model,
        reverse_data,
        train_worker={"optimizer_steps": 4, "pack_max_length": 256},
        optim={"lr": 1e-2},
        loss={"kl_coef": 0.1, "kl_type": "k3", "dual_clip_c": 3.0, "clip_eps_high": 0.28, "rollout_is": {"level": "token", "mode": "mask"}},
    )
    _, _, result = _fit(config, groups, pad_id)
    assert len(result.mini_batch_metrics) == 4
    later = result.mini_batch_metrics[-1]
    assert later["clipfrac"] > 0  # after 3 large updates the policy has moved past the trust region
    assert later["kl"] > 0  # and away from the reference model
    assert {"rollout_is/mean", "rollout_is/rejected_fraction", "dual_clipfrac"} <= later.keys()


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_other_loss_aggregations_train(tiny_model, reverse_data, rollout_batch, mode):
    groups, pad_id = rollout_batch
    worker, before, result = _fit(_config(tiny_model, reverse_data, loss={"aggregation": mode}), groups, pad_id)
    assert result.metrics["grad_norm"] > 0
    assert not torch.equal(worker.model.model.embed_tokens.weight, before["model.embed_tokens.weight"])


def test_exported_weights_load_into_the_rollout_backend(tiny_model, reverse_data, rollout_batch):
    groups, pad_id = rollout_batch
    worker, _, _ = _fit(_config(tiny_model, reverse_data), groups, pad_id)
    backend = TransformersRollout(str(tiny_model), AutoTokenizer.from_pretrained(tiny_model))
    backend.load_weights(worker.export_weights(), policy_version=1)
    assert backend.policy_version == 1


def test_learning_rate_schedules():
    assert lr_factor(0, warmup=4, total=10, kind="constant", min_ratio=0.0) == 0.25
    assert lr_factor(7, warmup=4, total=10, kind="constant", min_ratio=0.0) == 1.0
    assert lr_factor(7, warmup=4, total=10, kind="linear", min_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(10, warmup=4, total=10, kind="cosine", min_ratio=0.1) == pytest.approx(0.1)


def test_shared_prompt_prefix_equals_the_padded_layout(tiny_model, reverse_data, rollout_batch):
    """Sharing each prompt across its group changes the compute, not the math: same logprobs, same gradients."""
    groups, pad_id = rollout_batch
    config = _config(tiny_model, reverse_data)
    sequences = prepare_train_data(groups, config.advantage, shuffle=True, seed=1).sequences
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    outputs = {}
    for name, layout in (("shared", to_shared_prefix), ("padded", to_padded)):
        batch = layout(sequences, list(range(len(sequences))), pad_id)
        model.zero_grad()
        logprobs = token_logprobs(batch.logits(model), batch.labels_NL)
        (logprobs * batch.advantages_NL).sum().backward()
        picked = logprobs[batch.loss_mask_NL]  # response tokens, row by row, in both layouts
        outputs[name] = (picked.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (shared_lp, shared_grad), (padded_lp, padded_grad) = outputs["shared"], outputs["padded"]
    assert shared_lp.shape == padded_lp.shape and torch.allclose(shared_lp, padded_lp, atol=1e-5)
    for name, grad in shared_grad.items():
        assert torch.allclose(grad, padded_grad[name], atol=1e-5, rtol=1e-4), name
