"""Weight sync between the trainer and rollout actors on a real local Ray cluster (CPU)."""

from __future__ import annotations

import ray
import torch

from engine import actors
from engine.rollout.base import SamplingParams
from helpers import tiny_config


def test_a_gloo_broadcast_between_the_actors_restores_zeroed_rollout_weights(tiny_model, reverse_data, tmp_path, ray_cluster):
    """cluster.weight_sync: broadcast on CPU. Tried: the rollout worker's weights zeroed (its greedy
    completions change), then the trainer's broadcast over a gloo group of the two actors: the
    completions come back token for token, twice, the second time through the same group."""
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="weight-sync",
        cluster={"address": ray_cluster["address"], "weight_sync": "broadcast"},
    )
    actors.attach_workers(config)
    trainer, rollout = actors.lookup(config, "trainer"), actors.lookup(config, "rollout")
    try:
        prompts, greedy = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_new_tokens=6, temperature=0.0)

        def completions():
            return [g.response_ids for g in ray.get(rollout.generate.remote(prompts, greedy))]

        served = completions()
        zeros = {name: torch.zeros_like(t) for name, t in ray.get(trainer.export_weights.remote()).items()}
        ray.get(rollout.load_weights.remote(zeros, 0))
        assert completions() != served
        for version in (1, 2):
            assert actors.push_weights(config, trainer, rollout, version) == "gloo"
            assert completions() == served
            assert ray.get(rollout.policy_version.remote()) == version
    finally:
        actors.release_workers(config)


def test_the_transport_follows_placement_and_setting():
    choose = actors.weight_transport
    assert choose("auto", "gpu-a", "gpu-a") == choose("broadcast", "gpu-a", "gpu-a") == "cuda_ipc"
    assert choose("auto", "gpu-a", "gpu-b") == "nccl" and choose("object_store", "gpu-a", "gpu-b") == "object_store"
    assert choose("auto", None, None) == "object_store" and choose("broadcast", None, None) == "gloo"
    assert choose("broadcast", "gpu-a", None) == "gloo" and choose("auto", "gpu-a", None) == "object_store"
