"""The trainer on a mixture-of-experts policy: routing replay (r3, r2) in the packed and padded layouts,
the router still learning, the router metrics, bad settings refused, checkpoints and HF exports, and 2
gloo ranks making the update of one. The policy is the tiny MoE without its warm-up (its routing is
as real as a trained one's); its real rollouts are scored by the parity of their token ids, so groups differ."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig
from trellis.engine.config.loading import load_config
from trellis.engine.data.prepare import prepare_train_data
from trellis.engine.data.prompts import load_prompts
from trellis.engine.data.samples import RolloutSample
from trellis.engine.errors import SettingError
from trellis.engine.moe.routers import moe_shape
from trellis.engine.rollout.agents.generate import generate
from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.run.preflight import InputError, check_inputs
from trellis.engine.storage.checkpoints import CheckpointError
from trellis.engine.storage.store import Store
from trellis.engine.tiny.model import build_tiny_checkpoint, build_tokenizer
from trellis.engine.tiny.moe import build_moe_model
from trellis.engine.train.worker import TrainingWorker

COMPARED = ("pg_loss", "grad_norm", "entropy", "mismatch/k3_kl", "router/replayed_tokens", "router/load_entropy", "router/agreement")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe") / "model"
    tokenizer = build_tokenizer()
    build_moe_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _config(model, reverse_data, **changes):
    return load_config(
        None, load_from=str(model), train_dataset={"path": str(reverse_data["train"]), "limit": 16, "max_prompt_length": 64},
        total_train_steps=4, train_batch_size=8, prompt_repeat_k=4, reward={"function": "trellis.engine.tiny.reverse_task:score"},
        **changes,
    )


@pytest.fixture(scope="module")
def moe_groups(moe_model, reverse_data):
    """8 prompts x 4 real samples with their routing; reward 1 when its token ids sum to an odd number."""
    tokenizer = AutoTokenizer.from_pretrained(moe_model)
    prompts, _ = load_prompts(_config(moe_model, reverse_data).train_dataset, tokenizer)
    backend = TransformersRollout(str(moe_model), tokenizer, capture_routing=True)
    groups = []
    for index, prompt in enumerate(prompts[:8]):
        group = [RolloutSample(f"r{index}-{i}", f"g{index}", f"r{index}-{i}", index, prompt.messages, list(prompt.prompt_ids),
                               prompt.label, "reverse", "reverse") for i in range(4)]
        generate(group, backend, SamplingParams(max_new_tokens=8, seed=index))
        for sample in group:
            sample.reward = float(sum(sample.response_ids) % 2)
        groups.append(group)
    return groups, tokenizer.pad_token_id


def _fit(config, groups, pad_id):
    worker = TrainingWorker(config, total_train_steps=4, pad_token_id=pad_id)
    routers = {name: p.detach().clone() for name, p in worker.model.named_parameters() if name.endswith("mlp.gate.weight")}
    result = worker.fit(prepare_train_data(groups, config.advantage, shuffle=False, seed=0), 1)
    return worker, routers, result.metrics


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_r3_replays_every_response_token_and_the_router_still_learns(moe_model, reverse_data, moe_groups, layout):
    groups, pad_id = moe_groups
    config = _config(moe_model, reverse_data, train_worker={"routing_replay": "r3", "optimizer_steps": 2, "layout": layout})
    worker, routers, metrics = _fit(config, groups, pad_id)
    response_tokens = sum(len(s.response_ids) for group in groups for s in group)
    assert metrics["router/replayed_tokens"] == response_tokens and metrics["router/fallback_sequences"] == 0
    assert metrics["router/agreement"] > 0.9  # fp32 on CPU: trainer and engine share weights and mostly rounding
    assert 0 < metrics["router/load_entropy"] <= 1 and 1 / 8 <= metrics["router/load_max_share"] <= 1
    for name, before in routers.items():
        assert not torch.equal(before, dict(worker.model.named_parameters())[name]), name


def test_a_response_without_routing_falls_back_and_is_counted(moe_model, reverse_data, moe_groups):
    groups, pad_id = moe_groups
    changed = [[RolloutSample(**{**s.__dict__}) for s in group] for group in groups]
    changed[0][0].routed_experts = None
    config = _config(moe_model, reverse_data, train_worker={"routing_replay": "r3"})
    metrics = _fit(config, changed, pad_id)[2]
    assert metrics["router/fallback_sequences"] == 1
    assert metrics["router/replayed_tokens"] == sum(len(s.response_ids) for group in groups for s in group) - len(groups[0][0].response_ids)


def test_r2_replays_the_old_pass_routing_and_the_balancing_loss_is_an_option(moe_model, reverse_data, moe_groups):
    groups, pad_id = moe_groups
    r2 = _fit(_config(moe_model, reverse_data, train_worker={"routing_replay": "r2", "optimizer_steps": 2}), groups, pad_id)[2]
    assert r2["router/replayed_tokens"] > sum(len(s.response_ids) for group in groups for s in group)  # prompts too
    with_aux = _fit(_config(moe_model, reverse_data, loss={"router_aux_coef": 0.01}), groups, pad_id)[2]
    assert with_aux["router/aux_loss"] > 0 and "router/aux_loss" not in r2


def test_routing_settings_on_a_dense_policy_are_refused_naming_both(tmp_path, reverse_data):
    dense = build_tiny_checkpoint(tmp_path / "dense", warmup=False)
    config = _config(dense, reverse_data, train_worker={"routing_replay": "r3"})
    with pytest.raises(InputError, match="routing_replay: r3.*Qwen2ForCausalLM"):
        check_inputs(config)
    with pytest.raises(SettingError, match="routing_replay: r3.*Qwen2ForCausalLM.*dense"):
        TrainingWorker(config, total_train_steps=4, pad_token_id=0)


def test_a_checkpoint_of_another_expert_count_is_refused_and_the_hf_export_loads(moe_model, reverse_data, moe_groups, tmp_path):
    groups, pad_id = moe_groups
    worker = _fit(_config(moe_model, reverse_data), groups, pad_id)[0]
    worker.save_checkpoint(Store(str(tmp_path / "ckpt")), save_optimizer=True)
    worker.export_hf(Store(str(tmp_path / "hf")), str(moe_model))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert moe_shape(exported) == moe_shape(worker.model)
    for name, tensor in worker.export_weights().items():
        assert torch.equal(exported.state_dict()[name], tensor), name

    other = tmp_path / "four-experts"
    config = Qwen3MoeConfig.from_pretrained(moe_model)
    config.num_experts = 4
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    AutoTokenizer.from_pretrained(moe_model).save_pretrained(other)
    four = TrainingWorker(_config(other, reverse_data), total_train_steps=4, pad_token_id=pad_id)
    with pytest.raises(CheckpointError, match="8 experts.*4 experts"):
        four.load_checkpoint(Store(str(tmp_path / "ckpt")))
    again = TrainingWorker(_config(moe_model, reverse_data), total_train_steps=4, pad_token_id=pad_id)
    assert again.load_checkpoint(Store(str(tmp_path / "ckpt"))) == 1


def test_two_gloo_ranks_make_the_update_of_one_on_an_moe_batch(moe_model, reverse_data, moe_groups, tmp_path, ray_cluster):
    """As the dense parity test: two mini-batches with r3 replay, experts sharded by FSDP2 like every
    other parameter; loss, grad norm and router metrics of 2 ranks equal one rank's to 1e-5, weights to
    5e-5; their sharded checkpoint resumes in one plain worker."""
    from helpers import fit_on_trainer_ranks

    groups, pad_id = moe_groups
    batch = prepare_train_data(groups, _config(moe_model, reverse_data).advantage, shuffle=True, seed=0)
    changes = dict(train_worker={"optimizer_steps": 2, "routing_replay": "r3", "layout": "padded"}, experiment_name="moe-ranks",
                   work_dir=str(tmp_path), cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 120})
    one_rank = TrainingWorker(_config(moe_model, reverse_data, **changes), total_train_steps=4, pad_token_id=pad_id)
    with fit_on_trainer_ranks(_config(moe_model, reverse_data, train_resources={"num_workers": 2}, **changes), batch) as (sharded, workers):
        single = one_rank.fit(batch, 1)
        for name in COMPARED:
            assert sharded[0].metrics[name] == pytest.approx(single.metrics[name], rel=1e-5, abs=1e-5), name
        weights = workers.wait([rank.export_weights.remote() for rank in workers.actors("trainer")])[0]
        # AdamW's first steps move a weight by about lr x sign(grad) = 3e-4 each, so a gradient element
        # near 0 that rounds differently on 2 ranks moves by a share of that: 1.4e-5 at most, measured.
        for name, tensor in one_rank.export_weights().items():
            assert torch.allclose(weights[name], tensor, atol=5e-5), name
        uri = Store(str(tmp_path / "sharded"))
        workers.wait([rank.call.remote(partial(TrainingWorker.save_checkpoint, save_optimizer=True), uri) for rank in workers.actors("trainer")])
        assert TrainingWorker(one_rank.config, total_train_steps=4, pad_token_id=pad_id).load_checkpoint(uri) == 1
