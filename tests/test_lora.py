"""LoRA RL: only the adapters train, the reference policy is the base, an adapter sync gives the rollout
engine the trainer's policy, and checkpoints, HF exports, resume and offline evaluation work on the
adapters. Bad LoRA settings are refused before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.config.loading import ConfigError
from trellis.engine.data.prepare import prepare_train_data
from trellis.engine.data.prompts import load_prompts
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.rollout.production.produce import sampling_params
from trellis.engine.run.checkpoint_source import PolicySource, load_policy, resolve_source
from trellis.engine.run.evaluate_checkpoint import evaluate_checkpoint
from trellis.engine.run.local import LocalRun
from trellis.engine.run.preflight import InputError, check_inputs
from trellis.engine.storage.checkpoints import CheckpointError, SaveStore
from trellis.engine.storage.store import Store
from trellis.engine.train.worker import TrainingWorker
from trellis.engine.weights.lora import adapter_merger, payload_bytes
from helpers import lake_rows, logged_metrics, sampled_groups, tiny_config
from helpers import run_local as run
from teacher_forcing import teacher_forced_gaps

LORA = {"rank": 8, "alpha": 16}


@pytest.fixture(scope="module")
def rollout_batch(tiny_model, reverse_data, tmp_path_factory):
    """One real batch: 16 prompts x 8 samples from the tiny model, scored by the task's reward."""
    config = tiny_config(tiny_model, reverse_data, tmp_path_factory.mktemp("batch"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts, _ = load_prompts(config.train_dataset, tokenizer)
    held_out = [list(prompt.prompt_ids) for prompt in prompts[16:24]]
    return prepare_train_data(sampled_groups(tiny_model, config, prompts[:16]), config.advantage, shuffle=False, seed=0), tokenizer, held_out


def _lora_worker(tiny_model, reverse_data, tmp_path, pad_id, **changes):
    config = tiny_config(tiny_model, reverse_data, tmp_path, **{"lora": LORA, "loss": {"kl_coef": 0.1}, **changes})
    return TrainingWorker(config, total_train_steps=4, pad_token_id=pad_id)


def test_only_the_adapters_train_and_the_reference_is_the_base_with_them_off(tiny_model, reverse_data, tmp_path, rollout_batch):
    """Tried: two LoRA steps (the learning rate raised so that they move the policy visibly) with a KL
    term. The base weights stay bit-for-bit, every adapter matrix moves (A only from the second step:
    B starts at zero, so A's first gradient is zero), AdamW holds adapters only, and the reference
    logprobs of the trained worker equal a plain base model's, while its policy's differ."""
    batch, tokenizer, _ = rollout_batch
    worker = _lora_worker(tiny_model, reverse_data, tmp_path, tokenizer.pad_token_id, optim={"lr": 1e-2})
    before = {name: p.detach().clone() for name, p in worker.model.named_parameters()}
    assert worker.fit(batch, 1).metrics["kl"] == 0.0  # the first update starts at the base policy: no divergence yet
    assert worker.fit(batch, 2).metrics["kl"] > 0  # the second sees the first one's divergence from the reference
    trainable = {name for name, p in worker.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    for name, param in worker.model.named_parameters():
        assert torch.equal(param, before[name]) != (name in trainable), name
    assert sum(len(group["params"]) for group in worker.optimizer.param_groups) == len(trainable)

    base = TrainingWorker(tiny_config(tiny_model, reverse_data, tmp_path), total_train_steps=4, pad_token_id=tokenizer.pad_token_id)
    micro = worker._micro_batches(batch.sequences)[0]
    with torch.no_grad():
        expected = base._logprobs_no_grad(base.policy, micro)
        reference = worker._reference_logprobs(micro)
        policy = worker._logprobs_no_grad(worker.policy, micro)
    mask = micro.loss_mask_NL
    assert torch.allclose(reference[mask], expected[mask], atol=1e-6)
    assert (policy[mask] - expected[mask]).abs().max() > 1e-2


def test_a_synced_adapter_gives_the_engine_the_trainers_logprobs(tiny_model, reverse_data, tmp_path, rollout_batch):
    """Tried: an engine still on the base generates (its logprobs are far from the trained policy's),
    then gets the adapters alone, merged into the base it read from load_from, and generates again:
    teacher-forced under the trainer's model, its logprobs now agree to float32 rounding. The adapter
    payload is a small fraction of the full weights (the tiny model is mostly embeddings and layers of
    width 128; on a 7B model rank 8 is ~0.3%)."""
    batch, tokenizer, prompts = rollout_batch
    worker = _lora_worker(tiny_model, reverse_data, tmp_path, tokenizer.pad_token_id, optim={"lr": 1e-2})
    worker.fit(batch, 1)
    worker.model.eval()
    engine = TransformersRollout(str(tiny_model), tokenizer, seed=0)
    params = sampling_params(worker.config.rollout, seed=0)
    before = teacher_forced_gaps(worker.model, prompts, engine.generate(prompts, params), worker.config.rollout.temperature)
    assert before.max() > 1e-2

    adapter = worker.export_adapter()
    assert payload_bytes(adapter) < 0.25 * payload_bytes(worker.export_weights())
    engine.load_weights(adapter_merger(worker.config).merged(adapter), policy_version=1)
    after = teacher_forced_gaps(worker.model, prompts, engine.generate(prompts, params), worker.config.rollout.temperature)
    assert after.max() < 1e-4
    served = engine.served_weights()
    assert all(torch.equal(served[name], tensor) for name, tensor in worker.export_weights().items())  # the same merge, bit for bit


def test_a_lora_run_resumes_exactly_and_its_exports_load(tiny_model, reverse_data, tmp_path):
    """Tried: a LoRA run with a KL term, adapter syncs (which auto would not choose in-process) and a weight
    check after every sync (the merged weights equal to the bit), whole and interrupted after
    step 3 then resumed from its step-2 checkpoint (adapters and their AdamW state only): the same
    metrics and lake rows. Its HF export is a PEFT adapter folder that PeftModel loads over the base,
    with the merged model beside it; both, and the trainer checkpoint, give the same policy, which
    evaluate_checkpoint evaluates."""
    changes = dict(lora={**LORA, "export_merged": True, "sync": "adapter"}, loss={"kl_coef": 0.1}, check_weights_interval=1, hf_interval=4)
    whole = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="whole", **changes)
    LocalRun(whole).run()
    broken = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="broken", **changes)
    run(broken, steps=3)  # dies after step 3: the latest checkpoint is step 2
    assert SaveStore(Store(broken.checkpoint_uri)).complete_steps() == [2]
    run(broken, resume=True)
    assert logged_metrics(broken) == logged_metrics(whole)
    assert lake_rows(broken) == lake_rows(whole)
    assert all(step["weights/largest_difference"] == 0.0 for step in logged_metrics(whole).values() if "weights/largest_difference" in step)

    checkpoint = f"{whole.checkpoint_uri}/step-000004"
    assert sorted(load_file(f"{checkpoint}/adapter.safetensors")) == sorted(
        name for name in TrainingWorker(whole, total_train_steps=4, pad_token_id=0).model.state_dict() if ".lora_" in name
    )
    export = f"{whole.hf_uri}/step-000004"
    assert json.loads(open(f"{export}/adapter_config.json").read())["r"] == LORA["rank"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), export).eval()
    merged = AutoModelForCausalLM.from_pretrained(f"{export}/merged").eval()
    from_checkpoint = load_policy(whole, resolve_source(whole, "4"))
    from_folder = load_policy(whole, PolicySource(export, 4, "hf"))
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_model)("reverse ABCD")["input_ids"]])
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for model in (peft_model, merged, from_checkpoint, from_folder)]
    base_logits = AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=ids).logits
    assert (logits[0] - base_logits).abs().max() > 1e-3  # the adapters moved the policy
    assert all(torch.allclose(other, logits[0], atol=1e-5) for other in logits[1:])
    assert evaluate_checkpoint(whole, export).metrics["accuracy"] >= 0.0


def test_a_checkpoint_resumes_only_a_run_of_its_own_kind(tiny_model, reverse_data, tmp_path, rollout_batch):
    """Tried: a LoRA checkpoint loaded by a full fine-tune, by LoRA of another rank, and a full checkpoint
    loaded by LoRA: each is refused with what differs, before any weight is touched."""
    batch, tokenizer, _ = rollout_batch
    pad = tokenizer.pad_token_id
    lora = _lora_worker(tiny_model, reverse_data, tmp_path, pad)
    lora.save_checkpoint(Store(str(tmp_path / "lora")), save_optimizer=True)
    full = TrainingWorker(tiny_config(tiny_model, reverse_data, tmp_path), total_train_steps=4, pad_token_id=pad)
    full.save_checkpoint(Store(str(tmp_path / "full")), save_optimizer=True)
    with pytest.raises(CheckpointError, match="holds LoRA adapters"):
        full.load_checkpoint(Store(str(tmp_path / "lora")))
    with pytest.raises(CheckpointError, match="rank 8 there, 4 here"):
        _lora_worker(tiny_model, reverse_data, tmp_path, pad, lora={"rank": 4}).load_checkpoint(Store(str(tmp_path / "lora")))
    with pytest.raises(CheckpointError, match="full fine-tune"):
        lora.load_checkpoint(Store(str(tmp_path / "full")))


def test_lora_settings_that_cannot_work_are_refused_before_the_run_starts(tiny_model, reverse_data, tmp_path):
    """Tried: target modules that match no layer of the policy (one right, one wrong: only the wrong one
    is named, with the layers there are), and an empty name."""
    config = tiny_config(tiny_model, reverse_data, tmp_path, lora={"target_modules": ["q_proj", "qkv_proj"]})
    with pytest.raises(InputError, match=r"lora.target_modules: qkv_proj match no linear layer .* q_proj, up_proj, v_proj"):
        check_inputs(config)
    with pytest.raises(ConfigError, match="empty name"):
        tiny_config(tiny_model, reverse_data, tmp_path, lora={"target_modules": [" "]})
