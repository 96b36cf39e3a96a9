"""Several trainer ranks (one FSDP2 group on gloo) and several rollout workers, as Ray actors on a real
cluster: N ranks make the update one rank makes, checkpoints resume at another world size, the
controller spreads whole groups over the rollout workers, and the bundled task learns."""

from __future__ import annotations

import json
import time
from functools import partial

import pytest
import ray
import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoTokenizer

from trellis.engine.cluster.workers import RunWorkers
from trellis.engine.errors import WorkerError
from trellis.engine.faults import FAULT_FILE
from trellis.engine.data.prepare import prepare_train_data
from trellis.engine.data.prompts import load_prompts
from trellis.engine.rollout.backends.base import SamplingParams
from trellis.engine.rollout.backends.pool import RolloutPool, spread_by_load
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.run.checkpoint_source import PolicySource, load_policy
from trellis.engine.storage.checkpoints import SaveStore
from trellis.engine.storage.store import Store
from trellis.engine.train.packing import split_by_tokens
from trellis.engine.train.sharded_checkpoint import is_sharded
from trellis.engine.train.worker import TrainingWorker
from trellis.flows.rl_train import rl_train
from helpers import flow_runs, lake_rows, ledger_check, logged_metrics, sampled_groups, tiny_config

COMPARED = ("pg_loss", "grad_norm", "entropy", "kl", "clipfrac", "mismatch/k3_kl")


@pytest.fixture(scope="module")
def rollout_batch(tiny_model, reverse_data, tmp_path_factory):
    """One real batch: 16 prompts x 8 samples from the tiny model, scored by the task's reward."""
    config = tiny_config(tiny_model, reverse_data, tmp_path_factory.mktemp("batch"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts, _ = load_prompts(config.train_dataset, tokenizer)
    groups = sampled_groups(tiny_model, config, prompts[:16])
    return prepare_train_data(groups, config.advantage, shuffle=True, seed=0), tokenizer.pad_token_id


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
                         rollout_resources={"num_workers": 2}, attest={"enabled": True}, **changes)
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
                workers.wait([rank.call.remote(partial(TrainingWorker.save_checkpoint, save_optimizer=True), Store(uri)) for rank in ranks])
                one_rank = TrainingWorker(one_rank.config, total_train_steps=4, pad_token_id=pad_id)
                assert one_rank.load_checkpoint(Store(uri)) == 1
            sharded = workers.wait([rank.call.remote(TrainingWorker.fit, batch_ref, step) for rank in ranks])
            single = one_rank.fit(batch, step)
            assert all(result.metrics == sharded[0].metrics for result in sharded)  # every rank reports the whole step
            for name in COMPARED:
                assert sharded[0].metrics[name] == pytest.approx(single.metrics[name], rel=1e-5, abs=1e-5), (step, name)
            weights = workers.wait([rank.export_weights.remote() for rank in ranks])[0]
            for name, tensor in one_rank.export_weights().items():
                assert torch.allclose(weights[name], tensor, atol=1e-5), (step, name)

        assert workers.sync_weights(2)["attest/passed"] == 1.0 and workers.transport == "object_store"  # 2 ranks, 2 engines attested
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
    assert SaveStore(Store(config.checkpoint_uri)).complete_steps() == [25, 50]
    assert is_sharded(Store(f"{config.checkpoint_uri}/step-000050"))


@pytest.mark.parametrize(
    "trainer, train, rollout, on_gpu, devices",
    [
        ("colocated", (2, 1.0), (2, 1.0), True, (2, 2)),  # a trainer rank and a rollout worker on each GPU
        ("disaggregated", (1, 1.0), (2, 0.5), True, (1, 1)),  # two engines on one rollout GPU
        ("disaggregated", (2, 1.0), (2, 2.0), True, (2, 4)),  # engines of two GPUs each
        ("disaggregated", (2, 2.0), (3, 2.0), False, (2, 3)),  # on CPU it counts cores: a worker is one device
    ],
)
def test_the_run_plan_counts_each_sides_devices(tiny_model, reverse_data, tmp_path, trainer, train, rollout, on_gpu, devices):
    """What the per-device throughput/* divide by, from the config and where the workers landed."""
    from trellis.engine.run.plan import WorkerFacts, run_devices

    config = tiny_config(tiny_model, reverse_data, tmp_path, trainer=trainer,
                         train_resources={"num_workers": train[0], "accelerators_per_worker": train[1]},
                         rollout_resources={"num_workers": rollout[0], "accelerators_per_worker": rollout[1]})
    facts = WorkerFacts(dataset_size=64, pad_token_id=0, train_report="", applied_step=0, holds_state=False,
                        rollout_on_gpu=on_gpu, train_on_gpu=on_gpu)
    resolved = run_devices(config, facts)
    assert (resolved.train.devices, resolved.rollout.devices) == devices
    assert (resolved.train.workers, resolved.rollout.workers) == (train[0], rollout[0])


def test_throughput_per_device_divides_each_side_by_its_own_workers(tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api):
    """2 trainer ranks and 3 rollout workers (unequal, so the two counts cannot stand in for each
    other), 2 steps as Prefect flow runs. Every logged per-device figure must equal its total, from
    the same step's logged counters, over that side's workers (as XTuner's throughput divides by each
    side's worker count): trained tokens and samples over 2, produced ones over 3. Tried: the counts
    not passed (every figure a whole-run total, the old behaviour), and the two sides' counts swapped."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="per-device", total_train_steps=2, enable_evaluate=False,
        enable_initial_evaluate=False, checkpoint_interval=-1,
        train_resources={"num_workers": 2}, rollout_resources={"num_workers": 3},
        cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 300},
    )
    started = time.time()
    rl_train(config)
    wall_s = time.time() - started
    plan = json.loads((tmp_path / "per-device" / "logs" / "run_plan.json").read_text())
    assert plan["devices"] == {"train": {"workers": 2, "devices_per_worker": 1.0}, "rollout": {"workers": 3, "devices_per_worker": 1.0}}
    lines = (tmp_path / "per-device" / "logs" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        trained_tokens, trained_samples = r["response/training_tokens"], r["response/training_samples"]
        assert trained_tokens > 0 and r["rollout/produced_tokens"] > 0
        expected = {
            "throughput/training_tgs": trained_tokens / r["time/fit"] / 2,
            "throughput/effective_tgs": trained_tokens / r["time/step"] / 2,
            "throughput/effective_sgs": trained_samples / r["time/step"] / 2,
            "throughput/rollout_tgs": r["rollout/produced_tokens"] / r["time/rollout_window"] / 3,
            "throughput/rollout_sgs": r["rollout/produced_samples"] / r["time/rollout_window"] / 3,
        }
        for name, value in expected.items():
            assert r[name] == pytest.approx(value, rel=1e-9), (r["step"], name)
    # The run-level figures: all tokens trained over the 2 ranks and the run's time so far, which lies
    # between the steps' own times (on CPU a step's rollout starts in the step) and the flow's wall time.
    last = records[-1]
    tokens = sum(r["response/training_tokens"] for r in records)
    samples = sum(r["response/training_samples"] for r in records)
    e2e_s = tokens / last["throughput/e2e_effective_tgs"] / 2
    assert sum(r["time/step"] for r in records) <= e2e_s <= wall_s
    assert samples / last["throughput/e2e_effective_sgs"] / 2 == pytest.approx(e2e_s, rel=1e-9)


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


def test_a_start_that_fails_ends_the_trainer_group_it_rebuilt(tiny_model, reverse_data, tmp_path, ray_cluster):
    """Tried: a run's workers are up (2 trainer ranks); trainer rank 1 and the rollout worker die; the next
    start's rollout worker is SIGKILLed in its constructor. The start fails naming it, and ends every
    worker it created: rank 0, which was alive but rebuilt with its group, included. The controller, which
    it found running, stays."""
    marker = tmp_path / "fault"
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="rebuilt-group", train_resources={"num_workers": 2},
                         cluster={**ray_cluster["cluster"], "runtime_env": {"env_vars": {FAULT_FILE: str(marker)}}})
    workers = RunWorkers(config)
    workers.attach()
    try:
        workers._kill([workers.names("trainer")[1], workers.name("rollout")])
        marker.write_text("rollout.start")
        with pytest.raises(WorkerError, match="rollout worker 0"):
            workers.attach()
        assert (tmp_path / "fault.fired").read_text().startswith("rollout.start")
        assert workers.lost() == [*workers.names("trainer"), *workers.names("rollout")]
    finally:
        workers.release()


def test_the_in_process_runner_refuses_several_workers_per_side(tiny_model, reverse_data, tmp_path):
    from trellis.engine.run.local import LocalRun

    config = tiny_config(tiny_model, reverse_data, tmp_path, train_resources={"num_workers": 2})
    with pytest.raises(ValueError, match="without --in-process"):
        LocalRun(config)


def test_lora_on_two_ranks_makes_the_update_of_one_and_syncs_the_adapters_alone(
    tiny_model, reverse_data, tmp_path, ray_cluster, rollout_batch
):
    """LoRA on 2 gloo ranks (FSDP2 shards base and adapters, the base frozen) with a KL term: one rank's
    loss, grad norm and merged weights; the checkpoint holds the adapters' shards alone and resumes in
    one plain worker; a sync sends the adapters alone (transport "adapter"), and each rollout worker
    then serves exactly the trainer's merged weights."""
    batch, pad_id = rollout_batch
    changes = dict(loss={"kl_coef": 0.1}, experiment_name="lora-ranks", lora={"rank": 8, "alpha": 16}, optim={"lr": 1e-2},
                   cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 120})
    config = tiny_config(tiny_model, reverse_data, tmp_path, train_resources={"num_workers": 2}, rollout_resources={"num_workers": 2},
                         attest={"enabled": True}, **changes)
    one_rank = TrainingWorker(tiny_config(tiny_model, reverse_data, tmp_path, **changes), total_train_steps=4, pad_token_id=pad_id)
    workers = RunWorkers(config)
    workers.attach()
    try:
        ranks = workers.actors("trainer")
        batch_ref = ray.put(batch)
        for step in (1, 2):
            sharded = workers.wait([rank.call.remote(TrainingWorker.fit, batch_ref, step) for rank in ranks])
            single = one_rank.fit(batch, step)
            for name in COMPARED:
                assert sharded[0].metrics[name] == pytest.approx(single.metrics[name], rel=1e-5, abs=1e-5), (step, name)
        weights = workers.wait([rank.export_weights.remote() for rank in ranks])[0]
        for name, tensor in one_rank.export_weights().items():
            assert torch.allclose(weights[name], tensor, atol=1e-5), name

        uri = str(tmp_path / "ckpt")
        workers.wait([rank.call.remote(partial(TrainingWorker.save_checkpoint, save_optimizer=True), Store(uri)) for rank in ranks])
        stored = FileSystemReader(f"{uri}/model").read_metadata().state_dict_metadata
        assert stored and [name for name in stored if ".lora_" not in name] == []  # the base is load_from's, not saved again
        restored = TrainingWorker(one_rank.config, total_train_steps=4, pad_token_id=pad_id)
        assert restored.load_checkpoint(Store(uri)) == 2
        saved = workers.wait([rank.export_adapter.remote() for rank in ranks])[0]
        assert all(torch.equal(restored.export_adapter()[name], tensor) for name, tensor in saved.items())
        offline = load_policy(one_rank.config, PolicySource(uri, 2, "checkpoint")).state_dict()  # export and evaluate read it so
        assert all(torch.allclose(offline[name], tensor, atol=1e-6) for name, tensor in restored.export_weights().items())

        assert workers.sync_weights(2)["attest/passed"] == 1.0 and workers.transport == "adapter"
        for rollout in workers.actors("rollout"):
            served = ray.get(rollout.served_weights.remote())
            assert all(torch.equal(served[name], tensor) for name, tensor in weights.items())
    finally:
        workers.release()
