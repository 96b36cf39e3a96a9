"""Where a run's workers go: how much of a GPU each asks Ray for, and, for the disaggregated
trainer, the two placement groups (train and rollout) that keep the sides on devices of their own."""

from __future__ import annotations

from typing import Literal

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import TrellisConfig
from engine.run.plan import Role, roles_for

Side = Literal["train", "rollout"]
SIDE_OF: dict[Role, Side] = {"trainer": "train", "rollout": "rollout", "controller": "rollout"}


class GpuPlacementError(RuntimeError):
    """The run needs GPUs that the cluster does not offer."""


def gpu_requests(config: TrellisConfig, cluster_gpus: float) -> dict[Role, float]:
    """The GPU fraction each role asks Ray for. On a cluster with GPUs, device ``auto`` means the
    trainer takes one, and the rollout follows it (vLLM always needs one); by default the GPU workers
    split one GPU, colocated, as XTuner's colocated trainer does."""
    roles = roles_for(config)
    device = config.train_worker.device
    trainer_gpu = device == "cuda" or (device == "auto" and cluster_gpus > 0)
    wants: list[Role] = []
    if "trainer" in roles and trainer_gpu:
        wants.append("trainer")
    if "rollout" in roles and (config.rollout.backend == "vllm" or trainer_gpu):
        wants.append("rollout")
    if wants and cluster_gpus <= 0:
        raise GpuPlacementError(
            f"The {' and '.join(wants)} worker(s) need a GPU (train_worker.device={device}, "
            f"rollout.backend={config.rollout.backend}), but the Ray cluster offers none. Start the cluster on a "
            "GPU machine, or use train_worker.device: cpu with rollout.backend: transformers."
        )
    if config.disaggregated:  # each side holds GPUs of its own
        return {role: _resources(config, SIDE_OF[role]).accelerators_per_worker for role in wants}
    share = config.cluster.gpu_share or (1.0 / len(wants) if wants else 0.0)
    return {role: share for role in wants}


def _resources(config: TrellisConfig, side: Side):
    return config.train_resources if side == "train" else config.rollout_resources


def side_placement(config: TrellisConfig, role: Role, timeout_s: float) -> PlacementGroupSchedulingStrategy:
    """The scheduling strategy that puts ``role`` in its side's placement group (made on first use:
    ``num_workers`` bundles of ``accelerators_per_worker`` GPUs, or CPUs on a cluster without GPUs)."""
    groups = {side: _placement_group(config, side, timeout_s) for side in ("train", "rollout")}
    if groups["train"].id == groups["rollout"].id:
        raise GpuPlacementError(
            f"The train and rollout placement groups of {config.experiment_name} resolved to one group "
            f"({groups['train'].id}); a disaggregated run needs two. Release the run's workers and try again."
        )
    return PlacementGroupSchedulingStrategy(placement_group=groups[SIDE_OF[role]], placement_group_bundle_index=0)


def remove_side_placements(config: TrellisConfig) -> None:
    for side in ("train", "rollout"):
        group = _find_group(_group_name(config, side))
        if group is not None:
            remove_placement_group(group)


def _find_group(name: str) -> PlacementGroup | None:
    """The live placement group called ``name``, whichever driver made it: ``get_placement_group``
    looks in the caller's job namespace only, and a run's groups outlive the flow process that made
    them (a resume from another process must find them, not wait for their resources)."""
    for group_id, info in placement_group_table().items():
        if info.get("name") == name and info.get("state") != "REMOVED":
            return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
    return None


def _group_name(config: TrellisConfig, side: Side) -> str:
    return f"trellis-{config.experiment_name}-{side}"


def _placement_group(config: TrellisConfig, side: Side, timeout_s: float) -> PlacementGroup:
    name = _group_name(config, side)
    existing = _find_group(name)
    if existing is not None:
        return existing
    resources = _resources(config, side)
    kind = "GPU" if ray.cluster_resources().get("GPU", 0.0) > 0 and config.train_worker.device != "cpu" else "CPU"
    group = placement_group(
        [{kind: resources.accelerators_per_worker}] * resources.num_workers, strategy="PACK", name=name, lifetime="detached"
    )
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        raise GpuPlacementError(
            f"The {side} side of {config.experiment_name} asks for {resources.num_workers} x "
            f"{resources.accelerators_per_worker} {kind}, which the cluster ({ray.cluster_resources()}) cannot give."
        )
    return group
