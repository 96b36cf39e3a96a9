"""Several trainer ranks (one FSDP2 group on gloo) and several rollout workers, as Ray actors on a real
cluster: N ranks make the update one rank makes, checkpoints resume at another world size, the
controller spreads whole groups over the rollout workers, and the bundled task learns."""

from __future__ import annotations

import pytest
import ray
import torch
from transformers import AutoTokenizer

from engine.cluster.workers import RunWorkers
from engine.data.prepare import prepare_train_data
from engine.data.prompts import load_prompts
from engine.rollout.base import SamplingParams
from engine.rollout.pool import RolloutPool, spread_by_load
from engine.rollout.produce import rollout_groups, sampling_params
from engine.rollout.rewards import RewardRunner
from engine.rollout.transformers_backend import TransformersRollout
from engine.train.packing import split_by_tokens
from engine.train.worker import TrainingWorker
from helpers import tiny_config

COMPARED = ("pg_loss", "grad_norm", "entropy", "kl", "clipfrac", "mismatch/k3_kl")


@pytest.fixture(scope="module")
def rollout_batch(tiny_model, reverse_data, tmp_path_factory):
    """One real batch: 16 prompts x 8 samples from the tiny model, scored by the task's reward."""
    config = tiny_config(tiny_model, reverse_data, tmp_path_factory.mktemp("batch"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts, _ = load_prompts(config.train_dataset, tokenizer)
    with RewardRunner(config.reward) as rewards:
        produced = rollout_groups(
            [(0, prompt) for prompt in prompts[:16]], repeat=8, backend=TransformersRollout(str(tiny_model), tokenizer),
            rewards=rewards, params=sampling_params(config.rollout, seed=0), train_step=1, id_prefix="t-",
        )
    return prepare_train_data(produced.groups, config.advantage, shuffle=True, seed=0), tokenizer.pad_token_id


def test_two_trainer_ranks_make_the_update_of_one_and_resume_at_one(tiny_model, reverse_data, tmp_path, ray_cluster, rollout_batch):
    """Two mini-batches (so old logprobs and clipping are live) with a KL reference: 2 gloo ranks give
    one rank's loss, grad norm and weights to within 1e-5 (relative for the grad norm, which is
    ~300 here, so float32 rounding alone is ~1e-4 absolute). Their checkpoint (per-rank shards) resumes
    in one plain worker, whose next step again matches the two ranks'. Both rollout workers get the
    trainer's weights."""
    batch, pad_id = rollout_batch
    changes = dict(train_worker={"optimizer_steps": 2}, loss={"kl_coef": 0.1}, experiment_name="two-ranks",
                   cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 120})
    config = tiny_config(tiny_model, reverse_data, tmp_path, train_resources={"num_workers": 2},
                         rollout_resources={"num_workers": 2}, **changes)
    one_rank = TrainingWorker(tiny_config(tiny_model, reverse_data, tmp_path, **changes), total_train_steps=4, pad_token_id=pad_id)
    workers = RunWorkers(config)
    workers.attach()
    try:
        ranks = workers.actors("trainer")
        assert len(ranks) == 2 and len(workers.actors("rollout")) == 2
        batch_ref = ray.put(batch)
        for step in (1, 2):
            if step == 2:  # resume the one-rank worker from the two ranks' checkpoint of step 1
                uri = str(tmp_path / "ckpt")
                workers.wait([rank.save_checkpoint.remote(uri, {}, True) for rank in ranks])
                one_rank = TrainingWorker(one_rank._config, total_train_steps=4, pad_token_id=pad_id)
                assert one_rank.load_checkpoint(uri, {}) == 1
            sharded = workers.wait([rank.fit.remote(batch_ref, step) for rank in ranks])
            single = one_rank.fit(batch, step)
            assert sharded[0].metrics == sharded[1].metrics  # every rank reports the whole step
            for name in COMPARED:
                assert sharded[0].metrics[name] == pytest.approx(single.metrics[name], rel=1e-5, abs=1e-5), (step, name)
            weights = workers.wait([rank.export_weights.remote() for rank in ranks])[0]
            for name, tensor in one_rank.export_weights().items():
                assert torch.allclose(weights[name], tensor, atol=1e-5), (step, name)

        assert workers.sync_weights(2) == "object_store"
        for rollout in workers.actors("rollout"):
            assert ray.get(rollout.policy_version.remote()) == 2
            served = ray.get(rollout.served_weights.remote())
            assert all(torch.equal(served[name], tensor) for name, tensor in weights.items())
    finally:
        workers.release()


def test_ranks_split_a_mini_batch_by_tokens_keeping_groups_whole(rollout_batch):
    batch, _ = rollout_batch
    sequences = batch.sequences
    shares = split_by_tokens(sequences, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(sequences)))
    loads = [sum(sequences[i].num_tokens for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(s.num_tokens for s in sequences) * 8  # at most one group apart
    prompt_of = {i: tuple(s.input_ids[: s.prompt_length]) for i, s in enumerate(sequences)}
    for a, b in zip(range(len(sequences) - 1), range(1, len(sequences))):
        if prompt_of[a] == prompt_of[b]:  # neighbours of one group share a rank
            assert any(a in share and b in share for share in shares)


def test_a_pool_spreads_whole_groups_by_load_and_streams_every_sample(tiny_model):
    prompts = [[5, 6, 7]] * 4 + [[8, 9]] * 4 + [[10, 11, 12, 13]] * 4
    shares = spread_by_load(prompts, [6] * len(prompts), 2)
    assert sorted(len(s) for s in shares) == [4, 8] and all(len({tuple(prompts[i]) for i in s}) <= 2 for s in shares)
    assert spread_by_load(prompts, [6] * len(prompts), 5)[3:] == [[], []]  # more engines than groups

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engines = [TransformersRollout(str(tiny_model), tokenizer) for _ in range(2)]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    alone = engines[0].generate(prompts, greedy)
    pool = RolloutPool(engines)
    assert [g.response_ids for g in pool.generate(prompts, greedy)] == [g.response_ids for g in alone]
    streamed = dict(pool.stream(prompts, greedy, [3] * len(prompts)))
    assert sorted(streamed) == list(range(len(prompts)))
    assert all(streamed[i].response_ids == alone[i].response_ids[:3] for i in streamed)
