"""Where a run's workers go: how much of a GPU each asks Ray for, and the placement groups that hold
their devices: for the disaggregated trainer, one per side (train and rollout), so the sides run on
devices of their own; for a colocated run on several GPUs, one whose k-th bundle (a GPU) holds trainer
rank k and rollout worker k. A bundle per trainer rank or rollout worker, placed by
``cluster.placement_strategy`` (PACK: on as few nodes as fit; SPREAD: over nodes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trellis.engine.config import TrellisConfig
from trellis.engine.config.backends import backend_traits
from trellis.engine.run.plan import Role, roles_for

Side = Literal["train", "rollout", "colocated"]
logger = logging.getLogger(__name__)
_FIRST_LOOK_S = 10.0  # after this long unplaced, the wait says which groups hold the cluster

SIDE_OF: dict[Role, Side] = {"trainer": "train", "rollout": "rollout", "controller": "rollout"}


class GpuPlacementError(RuntimeError):
    """The run needs GPUs that the cluster does not offer."""


@dataclass(frozen=True)
class Placement:
    """Where a run's workers go, decided once (``decide_placement``) from the config and the cluster:

    - ``gpus``: the GPU fraction each role's actors ask Ray for (absent: none);
    - ``bundles``: the placement groups to hold, by side, each a bundle per trainer rank or rollout
      worker (none for a colocated run on one GPU or on CPU, whose actors go anywhere);
    - ``kind``: what a bundle holds, GPUs on a cluster with GPUs (unless the trainer is on CPU), else CPUs.
    """

    gpus: Mapping[Role, float]
    bundles: Mapping[Side, tuple[Mapping[str, float], ...]]
    kind: Literal["GPU", "CPU"]


def decide_placement(config: TrellisConfig, cluster: Mapping[str, float]) -> Placement:
    """On a cluster with GPUs, device ``auto`` means the trainer takes one and the rollout follows it
    (vLLM always needs one); by default the GPU workers split one GPU, colocated, as XTuner's colocated
    trainer does; the disaggregated trainer gives each side ``accelerators_per_worker`` of its own."""
    cluster_gpus = cluster.get("GPU", 0.0)
    device = config.train_worker.device
    kind: Literal["GPU", "CPU"] = "GPU" if cluster_gpus > 0 and device != "cpu" else "CPU"
    if config.disaggregated:
        bundles = {side: (MappingProxyType({kind: _resources(config, side).accelerators_per_worker}),) * _resources(config, side).num_workers
                   for side in ("train", "rollout")}
    else:
        workers = max(config.train_resources.num_workers, config.rollout_resources.num_workers)
        # Several colocated GPU workers: the k-th bundle (a GPU) holds trainer rank k and rollout worker k.
        several_on_gpus = workers > 1 and kind == "GPU"
        bundles = {"colocated": (MappingProxyType({kind: 1.0}),) * workers} if several_on_gpus else {}
    return Placement(gpus=MappingProxyType(_gpu_requests(config, cluster_gpus)), bundles=MappingProxyType(bundles), kind=kind)


def _gpu_requests(config: TrellisConfig, cluster_gpus: float) -> dict[Role, float]:
    roles = roles_for(config)
    device = config.train_worker.device
    trainer_gpu = device == "cuda" or (device == "auto" and cluster_gpus > 0)
    wants: list[Role] = []
    if "trainer" in roles and trainer_gpu:
        wants.append("trainer")
    if "rollout" in roles and (backend_traits(config.rollout.backend).needs_gpu or trainer_gpu):
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


def placement_strategy(config: TrellisConfig, placement: Placement, role: Role, index: int,
                       timeout_s: float) -> PlacementGroupSchedulingStrategy | None:
    """Where the ``index``-th actor of ``role`` goes: its bundle of its side's placement group, or
    anywhere (None) when the run holds no group; the controller of a colocated run goes anywhere."""
    if not placement.bundles or (role == "controller" and not config.disaggregated):
        return None
    groups = {side: _placement_group(config, placement, side, timeout_s) for side in placement.bundles}
    if config.disaggregated and groups["train"].id == groups["rollout"].id:
        raise GpuPlacementError(
            f"The train and rollout placement groups of {config.experiment_name} resolved to one group "
            f"({groups['train'].id}); a disaggregated run needs two. Release the run's workers and try again."
        )
    side = SIDE_OF[role] if config.disaggregated else "colocated"
    return PlacementGroupSchedulingStrategy(placement_group=groups[side], placement_group_bundle_index=index)


def check_fits(config: TrellisConfig, placement: Placement, cluster: Mapping[str, float]) -> None:
    """Refuse at once a run that asks for more GPUs (or CPUs) than the whole cluster has, instead of
    waiting for a placement group that can never be placed."""
    kind = placement.kind
    wanted = sum(bundle[kind] for side_bundles in placement.bundles.values() for bundle in side_bundles)
    if wanted > cluster.get(kind, 0.0) + 1e-9:
        asked = ", ".join(f"{side}: {len(b)} x {b[0][kind]:g} {kind}" for side, b in placement.bundles.items())
        raise GpuPlacementError(
            f"{config.experiment_name} asks for {wanted:g} {kind} ({asked}), but the Ray cluster has "
            f"{cluster.get(kind, 0.0):g}. Lower train_resources / rollout_resources (num_workers, "
            "accelerators_per_worker), or add nodes to the cluster."
        )


def remove_side_placements(config: TrellisConfig) -> None:
    for side in ("train", "rollout", "colocated"):
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


def _placement_group(config: TrellisConfig, placement: Placement, side: Side, timeout_s: float) -> PlacementGroup:
    name = _group_name(config, side)
    existing = _find_group(name)
    if existing is not None:
        return existing
    check_fits(config, placement, ray.cluster_resources())
    bundles = [dict(bundle) for bundle in placement.bundles[side]]
    group = placement_group(bundles, strategy=config.cluster.placement_strategy, name=name, lifetime="detached")
    first_look_s = min(_FIRST_LOOK_S, timeout_s)
    placed = group.wait(timeout_seconds=first_look_s)
    if not placed and timeout_s > first_look_s:
        logger.warning(
            "The %s side of %s waits for %s bundles of %s; the cluster's other placement groups hold: %s. "
            "Waiting up to %gs for them to be given back.",
            side, config.experiment_name, len(bundles), bundles[0], _holders(name), timeout_s,
        )
        placed = group.wait(timeout_seconds=timeout_s - first_look_s)
    if not placed:
        remove_placement_group(group)
        raise GpuPlacementError(
            f"The {side} side of {config.experiment_name} asks for {len(bundles)} bundles of {bundles[0]} "
            f"({config.cluster.placement_strategy}), which the cluster ({ray.cluster_resources()}) could not place "
            f"within {timeout_s:g}s; its other placement groups hold: {_holders(name)}."
        )
    return group


def _holders(waiting: str) -> str:
    """The live placement groups other than ``waiting``, by name and what they hold (a run whose
    workers were kept, or one that failed without giving them back, holds its devices until released)."""
    held = [
        f"{info.get('name') or group_id} {list(info['bundles'].values())}"
        for group_id, info in placement_group_table().items()
        if info.get("state") == "CREATED" and info.get("name") != waiting
    ]
    return ", ".join(held) or "none"
