"""The training worker really trains: parameters move, options take effect, a step is never applied twice."""

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.storage.store import Store
from trellis.engine.data.prompts import load_prompts
from trellis.engine.train.logprob_head import batch_logprobs, output_head
from trellis.engine.algo.losses import token_logprobs
from trellis.engine.train.packing import to_packed, to_padded
from trellis.engine.data.prepare import IGNORE, prepare_train_data
from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.production.produce import rollout_groups, sampling_params
from trellis.engine.rollout.rewards.runner import RewardRunner
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.train.worker import LAYOUTS, enable_activation_checkpointing, StepAlreadyApplied, TrainingWorker, lr_factor
from trellis.engine.train.varlen_attention import use_varlen_attention
from helpers import worker_config
from teacher_forcing import teacher_forced_gaps


@pytest.fixture(scope="module")
def rollout_batch(tiny_model, reverse_data):
    """One real batch: 16 prompts x 8 samples from the tiny model, scored by the task's reward."""
    config = worker_config(tiny_model, reverse_data)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts, _ = load_prompts(config.train_dataset, tokenizer)
    with RewardRunner(config.reward) as rewards:
        produced = rollout_groups(
            [(0, prompt) for prompt in prompts[:16]],  # (epoch, prompt), as the sampler draws them
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
    worker, before, result = _fit(worker_config(tiny_model, reverse_data), groups, pad_id)
    unchanged = [n for n, p in worker.model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []
    metrics = result.metrics
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(3e-4)
    assert metrics["clipfrac"] == 0.0  # one mini-batch: on-policy, ratio is exactly 1
    assert metrics["mismatch/k3_kl"] < 1e-6  # the trainer sees the rollout's own logprobs
    assert 0 < metrics["entropy"] < 10


def test_the_mismatch_metrics_measure_a_known_gap_between_trainer_and_rollout(tiny_model, reverse_data, rollout_batch):
    """Every rollout logprob lowered by 0.5 (the trainer recomputes the originals to ~1e-3): per token
    d = log pi_train - log pi_rollout = 0.5, so k3 = e^0.5 - 1 - 0.5, |d| = 0.5 and the rollout
    perplexity is the trainer's times e^0.5. Tried: k3 of the wrong direction (exp(-d) - 1 + d) in
    ``engine/algo/losses.py::mismatch_sums`` gives 0.107 instead of 0.149 and fails it."""
    groups, pad_id = rollout_batch
    gap = 0.5
    shifted = [[replace(s, logprobs=[lp - gap for lp in s.logprobs]) for s in group] for group in groups]
    _, _, result = _fit(worker_config(tiny_model, reverse_data), shifted, pad_id)
    metrics = result.metrics
    assert metrics["mismatch/k3_kl"] == pytest.approx(math.exp(gap) - 1 - gap, abs=2e-3)
    assert metrics["mismatch/abs_logprob_diff"] == pytest.approx(gap, abs=2e-3)
    assert metrics["mismatch/abs_logprob_diff_max"] == pytest.approx(gap, abs=1e-2)
    assert metrics["mismatch/rollout_ppl"] == pytest.approx(metrics["mismatch/train_ppl"] * math.exp(gap), rel=2e-3)


def test_a_step_is_never_applied_twice(tiny_model, reverse_data, rollout_batch):
    groups, pad_id = rollout_batch
    config = worker_config(tiny_model, reverse_data)
    worker, _, _ = _fit(config, groups, pad_id, step=1)
    with pytest.raises(StepAlreadyApplied, match="Step 1 is already applied"):
        worker.fit(prepare_train_data(groups, config.advantage, shuffle=False, seed=0), 1)


IS_OFFSETS = (0.0, 0.3, -0.3, 1.5, -1.5)  # log IS weights; +-1.5 fall outside the mask's [0.5, 2]


def _with_is_offsets(sequences):
    """The sequences with the rollout logprobs of the i-th one's response tokens lowered by offset
    i mod 5 of IS_OFFSETS, so that their IS weight pi_train / pi_rollout is exp(offset) (to the ~1e-3
    by which the rollout's logprobs differ from the trainer's); returns them and each token's
    (advantage, offset). (One offset per sequence: cycling them per token can cancel out in the loss.)"""
    shifted, tokens = [], []
    for index, sequence in enumerate(sequences):
        offset = IS_OFFSETS[index % len(IS_OFFSETS)]
        logprobs = list(sequence.rollout_logprobs)
        for position, label in enumerate(sequence.labels):
            if label != IGNORE:
                logprobs[position] -= offset
                tokens.append((sequence.advantages[position], offset))
        shifted.append(replace(sequence, rollout_logprobs=logprobs))
    return shifted, tokens


def test_several_mini_batches_clip_kl_and_is_correction(tiny_model, reverse_data, rollout_batch):
    """Four mini-batches with token-level IS in mask mode, dual clip and a k3 KL penalty, on a batch
    whose rollout logprobs are shifted by hand (``_with_is_offsets``). The first mini-batch is on-policy
    (ratio 1, policy = reference): no clipping, no KL, and its IS figures and loss follow from the
    offsets alone: weights exp(0), exp(+-0.3) kept, exp(+-1.5) rejected (0), so the loss is
    sum(-advantage x weight) / tokens. The later ones have moved (clipfrac and KL > 0; their exact
    values depend on the update, whose clipping math ``test_losses`` checks token by token).
    Tried: IS weights left out of the loss (``policy_objective`` ignoring ``is_weights_NL``), and the
    mask mode's lower bound dropped (``rejected = weights > config.upper``): both fail it."""
    groups, pad_id = rollout_batch
    config = worker_config(
        tiny_model,
        reverse_data,
        train_worker={"optimizer_steps": 4, "pack_max_length": 256},
        optim={"lr": 1e-2},
        loss={"kl_coef": 0.1, "kl_type": "k3", "dual_clip_c": 3.0, "clip_eps_high": 0.28, "rollout_is": {"level": "token", "mode": "mask"}},
    )
    # A group with signal in the first mini-batch (its loss is checked) and the others in the last.
    signal = [group for group in groups if len({s.reward for s in group}) > 1]
    flat = [group for group in groups if len({s.reward for s in group}) == 1]
    assert len(signal) >= 2
    batch = prepare_train_data(signal[:1] + flat + signal[1:], config.advantage, shuffle=False, seed=0)
    first_mini_batch = batch.sequences[: math.ceil(len(batch.sequences) / 4)]
    shifted, _ = _with_is_offsets(batch.sequences)
    _, tokens = _with_is_offsets(first_mini_batch)
    worker = TrainingWorker(config, total_train_steps=4, pad_token_id=pad_id)
    result = worker.fit(replace(batch, sequences=shifted), 1)
    assert len(result.mini_batch_metrics) == 4

    first = result.mini_batch_metrics[0]
    kept = [(advantage, math.exp(offset)) for advantage, offset in tokens if abs(offset) < 1]
    assert first["clipfrac"] == 0.0 and first["dual_clipfrac"] == 0.0 and first["kl"] == 0.0
    assert first["rollout_is/rejected_fraction"] == (len(tokens) - len(kept)) / len(tokens)
    assert first["rollout_is/mean"] == pytest.approx(sum(w for _, w in kept) / len(tokens), rel=3e-3)
    assert first["rollout_is/max"] == pytest.approx(math.exp(0.3), rel=3e-3)
    assert first["rollout_is/min"] == 0.0
    assert first["pg_loss"] == pytest.approx(sum(-a * w for a, w in kept) / len(tokens), rel=3e-3, abs=1e-4)
    assert abs(first["pg_loss"] - sum(-a for a, _ in tokens) / len(tokens)) > 1e-3  # the weights changed the loss (10x the tolerance)

    later = result.mini_batch_metrics[-1]
    assert later["clipfrac"] > 0  # after 3 large updates the policy has moved past the trust region
    assert later["clipfrac"] == pytest.approx(later["clipfrac_low"] + later["clipfrac_high"])
    assert later["kl"] > 0  # and away from the reference model


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_other_loss_aggregations_train(tiny_model, reverse_data, rollout_batch, mode):
    groups, pad_id = rollout_batch
    worker, before, result = _fit(worker_config(tiny_model, reverse_data, loss={"aggregation": mode}), groups, pad_id)
    assert result.metrics["grad_norm"] > 0
    assert not torch.equal(worker.model.model.embed_tokens.weight, before["model.embed_tokens.weight"])


def test_exported_weights_load_into_the_rollout_backend(tiny_model, reverse_data, rollout_batch):
    """The backend serves the trained weights tensor for tensor, and samples with their logprobs (a
    teacher-forced recompute with the exported weights agrees; one with the initial weights does not).
    Tried: ``TransformersRollout.load_weights`` loading nothing (``strict=False`` with an empty state
    dict), or all but the norm weights, fails it, where the old check of the version number passed."""
    groups, pad_id = rollout_batch
    worker, before, _ = _fit(worker_config(tiny_model, reverse_data, optim={"lr": 1e-2}), groups, pad_id)
    exported = {name: tensor.detach().clone() for name, tensor in worker.export_weights().items()}
    backend = TransformersRollout(str(tiny_model), AutoTokenizer.from_pretrained(tiny_model))
    backend.load_weights(worker.export_weights(), policy_version=1)
    assert backend.policy_version == 1

    served = backend.served_weights()
    assert served.keys() == exported.keys()
    assert [name for name in exported if not torch.equal(served[name], exported[name])] == []
    assert not torch.equal(served["model.embed_tokens.weight"], before["model.embed_tokens.weight"])

    prompts = [group[0].prompt_ids for group in groups[:4]]
    generations = backend.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.7, seed=5))
    trained = AutoModelForCausalLM.from_pretrained(tiny_model)
    trained.load_state_dict(exported)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert teacher_forced_gaps(trained, prompts, generations, 0.7).max() < 2e-4
    assert teacher_forced_gaps(initial, prompts, generations, 0.7).max() > 1e-2


def test_learning_rate_schedules():
    assert lr_factor(0, warmup=4, total=10, kind="constant", min_ratio=0.0) == 0.25
    assert lr_factor(7, warmup=4, total=10, kind="constant", min_ratio=0.0) == 1.0
    assert lr_factor(7, warmup=4, total=10, kind="linear", min_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(10, warmup=4, total=10, kind="cosine", min_ratio=0.1) == pytest.approx(0.1)


def _full_logits_reference(model, sequences, pad_id):
    """Logprobs and gradients the plain way: padded rows, the model's own full logits."""
    batch = to_padded(sequences, list(range(len(sequences))), pad_id)
    model.zero_grad()
    logprobs = token_logprobs(model(input_ids=batch.input_ids_NL, attention_mask=batch.attention_mask_NL).logits, batch.labels_NL)
    (logprobs * batch.advantages_NL).sum().backward()
    return logprobs[batch.loss_mask_NL].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "layout", ["packed", "padded", "shared_prefix", "packed+checkpointing", "packed+fixed_row", "packed+kept_logits"]
)
def test_every_layout_gives_the_full_logits_logprobs_and_gradients(tiny_model, reverse_data, rollout_batch, layout):
    """Packing, prompt sharing, the chunked head (7 positions per chunk here, so every micro-batch
    spans many chunks; its logits recomputed in the backward pass or kept), activation checkpointing
    and a packed row filled to a fixed shape (a pad sequence and empty ones, as CUDA graphs need)
    change the compute, not the math."""
    groups, pad_id = rollout_batch
    config = worker_config(tiny_model, reverse_data)
    sequences = prepare_train_data(groups, config.advantage, shuffle=True, seed=1).sequences
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    expected_lp, expected_grad = _full_logits_reference(model, sequences, pad_id)

    name, _, extra = layout.partition("+")
    if name == "packed":
        use_varlen_attention(model)
    if extra == "checkpointing":
        enable_activation_checkpointing(model)
        model.train()
    indices = list(range(len(sequences)))
    if extra == "fixed_row":
        batch = to_packed(sequences, indices, pad_id, row_length=sum(s.num_tokens for s in sequences) + 13)
    else:
        batch = LAYOUTS[name](sequences, indices, pad_id)
    model.zero_grad()
    logprobs, entropy = batch_logprobs(model, batch, temperature=1.0, chunk_tokens=7, keep_logits=extra == "kept_logits")
    (logprobs * batch.advantages_NL).sum().backward()
    picked = logprobs[batch.loss_mask_NL].detach()  # response tokens, row by row, in every layout
    assert picked.shape == expected_lp.shape and torch.allclose(picked, expected_lp, atol=1e-5)
    assert bool((entropy[batch.loss_mask_NL] > 0).all()) and float(entropy[~batch.loss_mask_NL].abs().sum()) == 0.0
    for param_name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected_grad[param_name], atol=1e-5, rtol=1e-4), param_name


def test_packed_rows_hold_no_padding(rollout_batch, tiny_model, reverse_data):
    groups, pad_id = rollout_batch
    sequences = prepare_train_data(groups, worker_config(tiny_model, reverse_data).advantage, shuffle=False, seed=0).sequences
    batch = to_packed(sequences, [0, 1, 2], pad_id)
    lengths = [sequences[i].num_tokens for i in (0, 1, 2)]
    assert batch.input_ids_1T.shape == (1, sum(lengths))
    assert batch.cu_seq_lens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert batch.position_ids_1T[0, lengths[0]].item() == 0  # positions restart with each sequence
    assert batch.label_positions_K.numel() == batch.label_index_K.numel() == int(batch.loss_mask_NL.sum())


def test_a_fixed_shape_row_fills_with_one_pad_sequence_and_empty_ones(rollout_batch, tiny_model, reverse_data):
    groups, pad_id = rollout_batch
    sequences = prepare_train_data(groups, worker_config(tiny_model, reverse_data).advantage, shuffle=False, seed=0).sequences
    lengths = [sequences[i].num_tokens for i in (0, 1, 2)]
    batch = to_packed(sequences, [0, 1, 2], pad_id, row_length=200)
    assert batch.input_ids_1T.shape == batch.position_ids_1T.shape == (1, 200) and batch.max_length == 200
    # three sequences, the pad sequence, then empty sequences up to a power-of-two size
    assert batch.cu_seq_lens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths), 200, 200, 200, 200]
    assert batch.input_ids_1T[0, sum(lengths):].eq(pad_id).all() and batch.position_ids_1T[0, sum(lengths)].item() == 0
    assert batch.label_positions_K.tolist() == to_packed(sequences, [0, 1, 2], pad_id).label_positions_K.tolist()
    with pytest.raises(ValueError, match=f"{sum(lengths)} tokens do not fit a row of 20"):
        to_packed(sequences, [0, 1, 2], pad_id, row_length=20)


def test_flash_attention_4_where_it_cannot_run_is_refused_before_training(tiny_model, reverse_data):
    """Asked for FA4 on this CPU-only machine (packed rows, which would otherwise run here), the worker
    says why it cannot run and what to set instead, rather than silently using another kernel."""
    config = worker_config(tiny_model, reverse_data, train_worker={"attention_kernel": "fa4", "layout": "packed"})
    with pytest.raises(ValueError, match="attention_kernel: fa4 cannot run here: it runs on CUDA GPUs and the trainer runs on cpu"):
        TrainingWorker(config, total_train_steps=4, pad_token_id=0)


def test_a_model_that_rescales_its_logits_is_refused(tiny_model):
    """The chunked head computes head(hidden); a model that post-processes logits must not be trained with it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert output_head(model) is model.get_output_embeddings()
    original = model.forward

    def scaled_forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = scaled_forward
    with pytest.raises(ValueError, match="changes its logits after the output layer"):
        output_head(model)


def test_fsdp2_at_world_size_one_trains_and_checkpoints_like_the_plain_worker(tiny_model, reverse_data, rollout_batch, tmp_path):
    """fully_shard on CPU (gloo, one rank, fp32 compute): two mini-batches with a KL reference and a
    packed layout give the plain worker's metrics and weights; its checkpoint restores into a plain
    worker, which then takes the same next step; its HF export loads."""
    groups, pad_id = rollout_batch
    changes = dict(
        train_worker={"optimizer_steps": 2, "layout": "packed", "logprob_chunk_tokens": 64},
        loss={"kl_coef": 0.1},
    )
    batch = prepare_train_data(groups, worker_config(tiny_model, reverse_data).advantage, shuffle=False, seed=0)
    workers = {}
    for fsdp in (False, True):
        config = worker_config(tiny_model, reverse_data, **{**changes, "train_worker": {**changes["train_worker"], "fsdp": fsdp}})
        workers[fsdp] = TrainingWorker(config, total_train_steps=4, pad_token_id=pad_id)
        workers[fsdp].result = workers[fsdp].fit(batch, 1).metrics
    plain, sharded = workers[False], workers[True]
    assert type(next(sharded.model.parameters())).__name__ == "DTensor"
    for name in ("pg_loss", "grad_norm", "entropy", "kl"):
        assert sharded.result[name] == pytest.approx(plain.result[name], rel=1e-4, abs=1e-6), name
    sharded_weights = sharded.export_weights()
    for name, tensor in plain.export_weights().items():
        assert torch.allclose(sharded_weights[name], tensor, atol=1e-6), name

    sharded.save_checkpoint(Store(str(tmp_path / "ckpt")), save_optimizer=True)
    plain.fit(batch, 2)
    restored = TrainingWorker(plain.config, total_train_steps=4, pad_token_id=pad_id)
    assert restored.load_checkpoint(Store(str(tmp_path / "ckpt"))) == 1
    restored.fit(batch, 2)
    for name, tensor in plain.export_weights().items():
        assert torch.allclose(restored.export_weights()[name], tensor, atol=1e-5), name

    sharded.export_hf(Store(str(tmp_path / "hf")), str(tiny_model))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(exported.model.embed_tokens.weight, sharded_weights["model.embed_tokens.weight"])
