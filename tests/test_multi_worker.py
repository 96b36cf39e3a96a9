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
from engine.storage.checkpoints import SaveStore
from engine.train.packing import split_by_tokens
from engine.train.sharded_checkpoint import is_sharded
from engine.train.worker import TrainingWorker
from flows.rl_train import rl_train
from helpers import flow_runs, lake_rows, ledger_check, logged_metrics, tiny_config

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


@pytest.mark.parametrize("world, shard_size", [(2, None), (4, 2)], ids=["fsdp-2", "hsdp-2x2"])
def test_n_trainer_ranks_make_the_update_of_one_and_resume_at_one(
    tiny_model, reverse_data, tmp_path, ray_cluster, rollout_batch, world, shard_size
):
    """Two mini-batches (so old logprobs and clipping are live) with a KL reference: 2 gloo ranks (or 4
    as HSDP, two copies each sharded over 2 ranks) give one rank's loss, grad norm and weights to
    within 1e-5 (relative for the grad norm, which is ~300 here, so float32 rounding alone is ~1e-4
    absolute). Their checkpoint (per-rank shards) resumes in one plain worker, whose next step again
    matches the ranks'. Both rollout workers get the trainer's weights."""
    batch, pad_id = rollout_batch
    changes = dict(loss={"kl_coef": 0.1}, experiment_name=f"ranks-{world}",
                   cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 120})
    config = tiny_config(tiny_model, reverse_data, tmp_path, train_resources={"num_workers": world},
                         train_worker={"optimizer_steps": 2, "hsdp_shard_size": shard_size},
                         rollout_resources={"num_workers": 2}, **changes)
    one_rank = TrainingWorker(tiny_config(tiny_model, reverse_data, tmp_path, train_worker={"optimizer_steps": 2}, **changes),
                              total_train_steps=4, pad_token_id=pad_id)
    workers = RunWorkers(config)
    workers.attach()
    try:
        ranks = workers.actors("trainer")
        assert len(ranks) == len(set(workers.wait([rank.pid.remote() for rank in ranks]))) == world
        batch_ref = ray.put(batch)
        for step in (1, 2):
            if step == 2:  # resume the one-rank worker from the ranks' checkpoint of step 1
                uri = str(tmp_path / "ckpt")
                workers.wait([rank.save_checkpoint.remote(uri, {}, True) for rank in ranks])
                one_rank = TrainingWorker(one_rank._config, total_train_steps=4, pad_token_id=pad_id)
                assert one_rank.load_checkpoint(uri, {}) == 1
            sharded = workers.wait([rank.fit.remote(batch_ref, step) for rank in ranks])
            single = one_rank.fit(batch, step)
            assert all(result.metrics == sharded[0].metrics for result in sharded)  # every rank reports the whole step
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


def test_two_ranks_and_two_rollout_workers_learn_the_bundled_task(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """The bundled task as Prefect flow runs, colocated, with 2 trainer ranks (FSDP2 on gloo) and 2
    rollout workers the controller spreads groups over: held-out greedy accuracy from ~0.38 to >= 0.75
    in the config's 50 steps, as with one of each. Its sharded checkpoints are complete."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="two-by-two", total_train_steps=50, evaluate_step=50,
        checkpoint_interval=25, eval_dataset={"path": str(reverse_data["eval"]), "max_prompt_length": 64},
        train_resources={"num_workers": 2}, rollout_resources={"num_workers": 2},
        cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 300},
    )
    rl_train(config)
    metrics = logged_metrics(config)
    assert 0.3 <= metrics[0]["eval/accuracy"] <= 0.5 and metrics[50]["eval/accuracy"] >= 0.75, (metrics[0], metrics[50])
    assert SaveStore(config.checkpoint_uri).complete_steps() == [25, 50]
    assert is_sharded(f"{config.checkpoint_uri}/step-000050", {})


def test_a_trainer_rank_killed_mid_run_is_rebuilt_with_its_group_and_the_run_resumes(
    tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api
):
    """Tried: trainer rank 1 SIGKILLed while step 3 is scored. fit[step=3] fails at once (rank 0,
    waiting for rank 1 in a collective, is not waited for), the flow run fails and Prefect retries
    it; the retry rebuilds both ranks as one new group, restores the step-2 sharded checkpoint and
    trains steps 3-4."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="rank-killed", enable_evaluate=False,
        enable_initial_evaluate=False, train_resources={"num_workers": 2}, reward={"function": "fault_rewards:kill_once"},
        cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 120, "release_workers_at_end": False},
    )
    workers = RunWorkers(config)
    workers.attach()
    first_pids = workers.wait([rank.pid.remote() for rank in workers.actors("trainer")])
    ray_cluster["kill_file"].write_text(f"{first_pids[1]} {2 * 16 * 8 + 64}")  # halfway through step 3's scoring
    try:
        rl_train(config)
        assert not ray_cluster["kill_file"].exists()
        new_pids = workers.wait([rank.pid.remote() for rank in workers.actors("trainer")])
        assert set(new_pids).isdisjoint(first_pids)  # the whole group was rebuilt
        assert workers.wait(workers.actor("trainer").applied_step.remote()) == 4
    finally:
        workers.release()
    (run,) = flow_runs("rl_run[rank-killed]")
    assert run.run_count == 2 and run.state_name == "Completed"
    rows = lake_rows(config)
    assert len(rows) == 4 * 128 and len({r["rollout_id"] for r in rows}) == len(rows)
    assert sorted(logged_metrics(config)) == [1, 2, 3, 4]
    ledger_check(config)


def test_the_in_process_runner_refuses_several_workers_per_side(tiny_model, reverse_data, tmp_path):
    from engine.run.local import LocalRun

    config = tiny_config(tiny_model, reverse_data, tmp_path, train_resources={"num_workers": 2})
    with pytest.raises(ValueError, match="without --in-process"):
        LocalRun(config)
