"""Weight sync between the trainer and rollout actors on a real local Ray cluster: over gloo on CPU
(CI), over NCCL between two GPUs (GPU machines)."""

from __future__ import annotations

import os
import signal

import pytest
import ray
import torch
from ray.exceptions import RayActorError

from trellis.engine.cluster import weight_sync
from trellis.engine.cluster.workers import RunWorkers
from trellis.engine.rollout.backends.base import SamplingParams
from helpers import tiny_config


PLACEMENTS = [
    pytest.param({"weight_sync": "broadcast"}, "gloo", id="gloo-on-cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU placement")),
    pytest.param({"gpu_share": 1.0}, "nccl", id="nccl-between-two-gpus",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]),
]


@pytest.mark.parametrize("cluster, transport", PLACEMENTS)
def test_a_broadcast_between_the_actors_restores_zeroed_rollout_weights(tiny_model, reverse_data, tmp_path, ray_cluster,
                                                                        cluster, transport):
    """On CPU with cluster.weight_sync: broadcast (gloo), or with each worker on a GPU of its own
    (NCCL, the default there). Tried: the rollout worker's weights zeroed (its greedy completions
    change), then the trainer's broadcast over a group of the two actors: the completions come back
    token for token, twice, the second time through the same group."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="weight-sync",
        cluster={"address": ray_cluster["address"], **cluster},
    )
    workers = RunWorkers(config)
    workers.attach()
    trainer, rollout = workers.actor("trainer"), workers.actor("rollout")
    try:
        prompts, greedy = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_new_tokens=6, temperature=0.0)

        def completions():
            return [g.response_ids for g in ray.get(rollout.generate.remote(prompts, greedy))]

        served = completions()
        zeros = {name: torch.zeros_like(t) for name, t in ray.get(trainer.export_weights.remote()).items()}
        ray.get(rollout.load_weights.remote(zeros, 0))
        assert completions() != served
        for version in (1, 2):
            assert weight_sync.push_weights(config, trainer, rollout, version) == transport
            assert completions() == served
            assert ray.get(rollout.policy_version.remote()) == version
    finally:
        workers.release()


@pytest.mark.parametrize("choice, transport", [("auto", "object_store"), ("broadcast", "gloo")])
def test_after_a_cpu_sync_the_rollout_worker_serves_the_trainers_weights_tensor_by_tensor(
    tiny_model, reverse_data, tmp_path, ray_cluster, choice, transport
):
    """Tried: the trainer's weights changed by a training step, then synced through the object store
    (the CPU default) or a gloo broadcast. Every tensor the rollout worker generates with equals the
    trainer's, not only the version label."""
    from trellis.engine.cluster.ray_workers import RayWorkers
    from trellis.engine.run.metrics import RunCounters
    from trellis.engine.run.phases import FIT, PREPARE_DATA, PRODUCE_BATCH, PhaseContext, run_phase
    from trellis.engine.run.plan import resolve_run_plan
    from trellis.engine.run.resume import StartPlan

    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name=f"sync-equal-{choice}",
                         cluster={"address": ray_cluster["address"], "weight_sync": choice})
    ray_workers = RayWorkers(config)
    workers = ray_workers.cluster
    facts = workers.attach()
    ctx = PhaseContext(config, resolve_run_plan(config, facts, StartPlan(action="fresh", step=0), RunCounters.resumed(None)), ray_workers)
    try:
        trainer, rollout = workers.actor("trainer"), workers.actor("rollout")
        initial = ray.get(rollout.served_weights.remote())
        run_phase(PRODUCE_BATCH, ctx, 1)
        run_phase(FIT, ctx, 1, run_phase(PREPARE_DATA, ctx, 1))
        trained = ray.get(trainer.export_weights.remote())
        assert any(not torch.equal(trained[name], initial[name]) for name in initial)  # the step changed them
        assert weight_sync.push_weights(config, trainer, rollout, 1) == transport
        served = ray.get(rollout.served_weights.remote())
        assert served.keys() == trained.keys()
        for name, tensor in trained.items():
            assert torch.equal(served[name], tensor), name
        assert ray.get(rollout.policy_version.remote()) == 1
    finally:
        workers.release()


def test_the_transport_follows_placement_and_setting():
    choose = weight_sync.weight_transport
    assert choose("auto", ["gpu-a"], ["gpu-a"]) == choose("broadcast", ["gpu-a"], ["gpu-a"]) == "cuda_ipc"
    assert choose("auto", ["gpu-a"], ["gpu-b"]) == "nccl" and choose("object_store", ["gpu-a"], ["gpu-b"]) == "object_store"
    assert choose("auto", [None], [None]) == "object_store" and choose("broadcast", [None], [None]) == "gloo"
    assert choose("broadcast", ["gpu-a"], [None]) == "gloo" and choose("auto", ["gpu-a"], [None]) == "object_store"
    # several ranks and engines: colocated pairs use IPC, other GPUs one broadcast group
    assert choose("auto", ["gpu-a", "gpu-b"], ["gpu-b", "gpu-a"]) == "cuda_ipc"
    assert choose("auto", ["gpu-a", "gpu-b"], ["gpu-c", "gpu-d"]) == "nccl"
    with pytest.raises(weight_sync.WeightSyncError, match="Some rollout workers share a GPU"):
        choose("auto", ["gpu-a", "gpu-b"], ["gpu-a", "gpu-c"])


def test_a_rollout_worker_killed_after_a_broadcast_is_replaced_and_paired_anew(tiny_model, reverse_data, tmp_path, ray_cluster):
    """Tried: the rollout worker's process SIGKILLed after a gloo broadcast. Its replacement (what a
    retried sync task does) pairs with the trainer in a new group, the trainer dropping the group of
    the dead peer without waiting on it, and serves the trainer's weights."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="weight-sync-fault",
        cluster={"address": ray_cluster["address"], "weight_sync": "broadcast", "ray_get_timeout_s": 60},
    )
    workers = RunWorkers(config)
    workers.attach()
    trainer, rollout = workers.actor("trainer"), workers.actor("rollout")
    prompts, greedy = [[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, temperature=0.0)
    try:
        served = ray.get(rollout.generate.remote(prompts, greedy))[0].response_ids
        assert weight_sync.push_weights(config, trainer, rollout, 1) == "gloo"
        os.kill(ray.get(rollout.pid.remote()), signal.SIGKILL)
        with pytest.raises(RayActorError):
            weight_sync.push_weights(config, trainer, rollout, 2)
        replacement = workers.restart_rollout()
        assert ray.get(replacement.policy_version.remote()) == 0  # versioned by the trainer's applied step (none yet)
        assert ray.get(replacement.generate.remote(prompts, greedy))[0].response_ids == served
        assert weight_sync.push_weights(config, trainer, replacement, 3) == "gloo"
    finally:
        workers.release()
