"""Where a run's workers go, decided once: which ask Ray for a GPU and how much of one, which placement
groups hold their devices, and a run that cannot fit refused at once."""

import pytest

from trellis.engine.cluster.placement import GpuPlacementError, check_fits, decide_placement
from trellis.engine.config.loading import load_config


def _config(**changes):
    return load_config(None, load_from="m", train_dataset={"path": "d.parquet"}, reward={"function": "r:score"}, total_train_steps=1,
                       **changes)


def gpu_requests(config, cluster_gpus: float) -> dict:
    return dict(decide_placement(config, {"CPU": 16.0, "GPU": cluster_gpus}).gpus)


def bundles(config, cluster: dict) -> dict:
    placement = decide_placement(config, cluster)
    return {side: [dict(b) for b in held] for side, held in placement.bundles.items()}


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


def test_placement_groups_by_trainer_and_cluster():
    """Tried: a colocated run on one GPU and on CPU (its actors go anywhere), several colocated workers on
    GPUs (a bundle per GPU holds a trainer rank and a rollout worker), the disaggregated trainer on GPUs
    and on CPU (a group per side, bundles of accelerators_per_worker)."""
    two = {"train_resources": {"num_workers": 2}, "rollout_resources": {"num_workers": 2}}
    assert bundles(_config(), {"CPU": 2.0, "GPU": 1.0}) == {}
    assert bundles(_config(**two), {"CPU": 2.0}) == {}
    assert bundles(_config(**two), {"CPU": 8.0, "GPU": 2.0}) == {"colocated": [{"GPU": 1.0}] * 2}
    assert bundles(_config(train_worker={"device": "cpu"}, **two), {"CPU": 8.0, "GPU": 2.0}) == {}
    disaggregated = dict(trainer="disaggregated", train_resources={"num_workers": 2}, rollout_resources={"accelerators_per_worker": 2.0})
    assert bundles(_config(**disaggregated), {"CPU": 8.0, "GPU": 4.0}) == {"train": [{"GPU": 1.0}] * 2, "rollout": [{"GPU": 2.0}]}
    assert bundles(_config(train_worker={"device": "cpu"}, **disaggregated), {"CPU": 8.0}) == {"train": [{"CPU": 1.0}] * 2, "rollout": [{"CPU": 2.0}]}
    assert decide_placement(_config(**disaggregated), {"CPU": 8.0, "GPU": 4.0}).gpus == {"trainer": 1.0, "rollout": 2.0}


def test_a_run_larger_than_the_cluster_is_refused_with_what_it_asked():
    config = _config(trainer="disaggregated", train_resources={"num_workers": 2}, rollout_resources={"num_workers": 2})
    cluster = {"CPU": 8.0, "GPU": 3.0}
    with pytest.raises(GpuPlacementError, match=r"asks for 4 GPU \(train: 2 x 1 GPU, rollout: 2 x 1 GPU\), but the Ray cluster has 3"):
        check_fits(config, decide_placement(config, cluster), cluster)
