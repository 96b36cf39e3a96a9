"""Which workers ask Ray for a GPU, and how much of one."""

import pytest

from trellis.engine.cluster.placement import GpuPlacementError, gpu_requests
from trellis.engine.config.loading import load_config


def _config(**changes):
    return load_config(None, load_from="m", train_dataset={"path": "d.parquet"}, reward={"function": "r:score"}, total_train_steps=1,
                       **changes)


def test_cpu_cluster_asks_for_no_gpu():
    assert gpu_requests(_config(), cluster_gpus=0) == {}
    assert gpu_requests(_config(train_worker={"device": "cpu"}), cluster_gpus=1) == {}  # CPU on a GPU machine


def test_colocated_workers_split_one_gpu_by_default():
    assert gpu_requests(_config(), cluster_gpus=1) == {"trainer": 0.5, "rollout": 0.5}
    assert gpu_requests(_config(rollout={"backend": "vllm"}), cluster_gpus=8) == {"trainer": 0.5, "rollout": 0.5}
    assert gpu_requests(_config(cluster={"gpu_share": 1.0}), cluster_gpus=2) == {"trainer": 1.0, "rollout": 1.0}
    # debug_rollout starts no trainer: the rollout worker gets the whole GPU.
    assert gpu_requests(_config(debug_rollout=True, debug_rollout_dir="lake"), cluster_gpus=1) == {"rollout": 1.0}


def test_vllm_without_a_gpu_says_what_is_missing():
    """vLLM on a CPU-only cluster: refused before any actor is created, with the settings to change."""
    with pytest.raises(GpuPlacementError, match=r"rollout worker\(s\) need a GPU .*rollout.backend=vllm.*offers none"):
        gpu_requests(_config(train_worker={"device": "cpu"}, rollout={"backend": "vllm"}), cluster_gpus=0)
    with pytest.raises(GpuPlacementError, match=r"trainer and rollout worker\(s\) need a GPU"):
        gpu_requests(_config(train_worker={"device": "cuda"}), cluster_gpus=0)
