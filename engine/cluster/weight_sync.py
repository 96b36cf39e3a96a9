"""Weights from the trainer ranks to the rollout workers, driven from the flow's side: which transport
their placement and ``cluster.weight_sync`` call for, and the calls to every actor that run it.

Every trainer rank takes part in each transport: gathering the full weights out of FSDP shards is a
collective. Rank 0 sends them on, or, colocated on GPUs, each rank hands its own GPU's rollout worker
the gathered weights through CUDA IPC.
"""

from __future__ import annotations

from typing import Sequence

import ray
import torch

from trellis.engine.cluster.actor_gpus import gpus_of
from trellis.engine.config import TrellisConfig
from trellis.engine.weights.buckets import ROLLOUT_GPU_DTYPE
from trellis.engine.weights.lora import sends_adapters


class WeightSyncError(RuntimeError):
    """The trainer ranks and rollout workers sit on GPUs no transport serves."""


def push_weights(config: TrellisConfig, trainers, rollouts, policy_version: int) -> str:
    """Trainer weights into every rollout worker with no disk round trip. Returns the transport used
    (``cluster.weight_sync`` chooses): CUDA IPC when each rollout worker shares a GPU with a trainer
    rank, a broadcast in a process group of their own (NCCL) when they are on other GPUs, and
    otherwise (CPU) Ray's object store, or a gloo broadcast when asked for; a LoRA policy's adapters
    alone through the object store where ``lora.sync`` says so. ``trainers`` and
    ``rollouts`` are actor handles, or lists of them (all trainer ranks, all rollout workers)."""
    trainers, rollouts = _as_list(trainers), _as_list(rollouts)
    timeout = config.cluster.ray_get_timeout_s
    trainer_gpus, rollout_gpus = gpus_of(trainers, timeout), gpus_of(rollouts, timeout)
    transport = weight_transport(config.cluster.weight_sync, trainer_gpus, rollout_gpus)
    if sends_adapters(config, transport):  # megabytes, not the model: the object store serves any placement
        exports = [t.export_adapter.remote() for t in trainers]  # rank 0's holds the adapters
        ray.get(exports[1:] + [r.load_adapter.remote(exports[0], policy_version) for r in rollouts], timeout=timeout)
        return "adapter"
    if transport == "object_store":
        exports = [t.export_weights.remote() for t in trainers]  # rank 0's holds the weights
        ray.get(exports[1:] + [r.load_weights.remote(exports[0], policy_version) for r in rollouts], timeout=timeout)
    elif transport == "cuda_ipc":
        shared = [t.share_weights.remote() for t in trainers]
        on_gpu = dict(zip(trainer_gpus, shared))
        try:
            loads = [r.load_shared_weights.remote(on_gpu[gpu], policy_version) for r, gpu in zip(rollouts, rollout_gpus)]
            ray.get(shared + loads, timeout=timeout)
        finally:
            ray.get([t.release_shared_weights.remote() for t in trainers], timeout=timeout)
    else:
        _broadcast_weights(config, trainers, rollouts, policy_version, nccl=transport == "nccl", rollout_on_gpu=rollout_gpus[0] is not None)
    return transport


def weight_transport(choice: str, trainer_gpus: Sequence[str | None], rollout_gpus: Sequence[str | None]) -> str:
    """``cuda_ipc``, ``nccl``, ``gloo`` or ``object_store`` for workers on these GPUs (None: on CPU)."""
    all_on_gpus = all(g is not None for g in [*trainer_gpus, *rollout_gpus])
    shared = [gpu in trainer_gpus for gpu in rollout_gpus if gpu is not None]
    if all_on_gpus and all(shared):
        return "cuda_ipc"  # NCCL cannot pair two processes on one GPU, and IPC copies nothing twice
    if any(shared):
        raise WeightSyncError(
            f"Some rollout workers share a GPU with a trainer rank and some do not (trainer GPUs {list(trainer_gpus)}, "
            f"rollout GPUs {list(rollout_gpus)}); place them all colocated or all on GPUs of their own."
        )
    if choice == "broadcast":
        return "nccl" if all_on_gpus else "gloo"
    if choice == "auto" and all_on_gpus:
        return "nccl"
    return "object_store"


def _broadcast_weights(config: TrellisConfig, trainers: list, rollouts: list, policy_version: int, *, nccl: bool, rollout_on_gpu: bool) -> None:
    """One group of trainer rank 0 and every rollout worker; the other trainer ranks help gather."""
    timeout = config.cluster.ray_get_timeout_s
    sender = trainers[0]
    pids = ray.get([sender.pid.remote(), *[r.pid.remote() for r in rollouts]], timeout=timeout)
    key = "trellis-weights-" + "-".join(map(str, pids))  # a restarted worker is a new process: a new group
    address = ray.get(sender.weight_group_address.remote(key, nccl, len(rollouts) + 1), timeout=timeout)
    joins = [sender.join_weight_group.remote(address)]
    joins += [r.join_weight_group.remote(address, rank) for rank, r in enumerate(rollouts, start=1)]
    ray.get(joins, timeout=timeout)
    dtype = ROLLOUT_GPU_DTYPE if rollout_on_gpu else torch.float32  # a CPU rollout runs in the trainer's float32
    layouts = ray.get([t.weight_layouts.remote(dtype) for t in trainers], timeout=timeout)[0]  # a collective too
    sends = [t.broadcast_weights.remote(dtype) for t in trainers]
    ray.get(sends + [r.receive_weights.remote(layouts, policy_version) for r in rollouts], timeout=timeout)


def _as_list(handles) -> list:
    return list(handles) if isinstance(handles, (list, tuple)) else [handles]
